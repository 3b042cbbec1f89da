"""THE training loop: one per rank, the same for every strategy.

Started by `commbench run CONFIG` through torchrun (`python -m bench.run.train RUN_DIR`), it
reads RUN_DIR/config.yaml, trains, and writes metrics.jsonl, comm.jsonl, summary.json and
checkpoints (paths: bench.run.records.RunDir; schema: bench/run/summary.py; checkpoints:
bench/run/checkpoint.py). It never mentions an algorithm by name: the strategy is built from
the registry and called through the Strategy interface (algorithms/base.py). A stop signal
(bench/run/stop.py) ends the run at the next step boundary that every rank agrees on, after a
checkpoint there: the run is recorded `interrupted`, to be resumed bit-exactly.

Timing (bench/run/meter.py says how and why). Each step is timed on the host with the device
synchronised before and after: `step_s` is the whole step, `comm_s` the strategy's
exposed communication, `compute_s` the rest (a `run.straggler` rank's extra sleep is
inside its timed step, like a slow GPU's time). The run's clock (`elapsed_s`, `wall_s`)
advances at each metrics row, validation and checkpoint by the SLOWEST rank's step
seconds since the previous one; tokens are those consumed, summed over ranks; projected
times accumulate step by step. Validation, logging and checkpointing are outside the
clock; each process's first `run.warmup_steps` steps and its communicator creation are on
it but measured apart (`warmup_s`), so throughput = steady tokens / steady wall_s (the
warm-up left out, bench/run/meter.py). The harness's own reductions go straight to
torch.distributed, never into the ledger, which holds only algorithm traffic.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import sys
import time
import traceback
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from algorithms.base import mean_loss, strategy_class
from algorithms.clocks import WALL, peak_memory_bytes, set_compute_clock, work_clock
from algorithms.comm import Communicator
from algorithms.contract import StepStats, TrainSetup
from algorithms.ledger import CommLedger
from bench.config import Config, from_dict, load_raw
from bench.data import load_corpus
from bench.data.batches import BatchStream, validation_set
from bench.data.tokenizers import get_tokenizer
from bench.env import (
    capture_env,
    fault_injection,
    inject_fault,
    peak_flops,
    ranks_per_core,
    resolve_device,
    share_cores,
    straggle,
    synchronize,
)
from bench.memory import plan as memory_plan
from bench.memory import reset_peak
from bench.model import autocast_context, build_model, config_of, lm_loss
from bench.network import delay_policy, get_profile
from bench.network.timeline import compute_stats, robust_projection
from bench.optim import describe_optimizer, lr_at, make_optimizer_factory
from bench.run import checkpoint
from bench.run.files import write_json, write_jsonl, write_text
from bench.run.meter import (
    TRAIN_PHASES,
    LoopState,
    MetricsWindow,
    StepClock,
    all_reduce_floats,
    peak_sync_bytes,
    run_totals,
)
from bench.run.records import RunDir
from bench.run.stop import StopRequest, announce_start, die_with_parent, handle_signals
from bench.run.summary import Projection, Summary, progress_line, train_row, val_row

__all__ = ["TRAIN_PHASES", "Trainer", "lr_at", "make_optimizer_factory", "main"]


class Trainer:
    """Builds everything for one rank and runs the steps."""

    def __init__(self, cfg: Config, run_dir: Path, device: torch.device, backend: str,
                 keep_records: bool = False, stop: StopRequest | None = None):
        """`keep_records`: the ledger keeps every record (tests, debugging; memory grows
        with the run), else only the current step's besides its bounded aggregates.
        `stop`: this rank's stop requests (bench/run/stop.py; None: a new one)."""
        self.cfg, self.run_dir, self.device, self.backend = cfg, Path(run_dir), device, backend
        self.records = RunDir(run_dir)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(cfg.run.seed)
        self.checkpoint_group = checkpoint.barrier_group(cfg.checkpoint.timeout_s)
        self.stop = stop or StopRequest(self.rank, self.world, cfg.checkpoint.timeout_s)

        tokenizer = get_tokenizer(cfg.data.tokenizer)
        if self.rank != 0:
            dist.barrier()  # rank 0 tokenises and caches the corpus first
        splits = load_corpus(cfg.data.corpus, cfg.data.tokenizer, cfg.data.cache_dir,
                             cfg.data.val_fraction)
        if self.rank == 0:
            dist.barrier()

        self.memory_plan = memory_plan(cfg, on_cuda=device.type == "cuda")
        self.start_memory = reset_peak(device)  # the peak counts from the model's build
        self.model_config = config_of(cfg.model, tokenizer.vocab_size)
        with torch.device("meta"):  # nothing allocated: each strategy materialises its part
            model = build_model(self.model_config)
        model.enable_activation_checkpointing(cfg.model.activation_checkpointing == "blocks")
        self.model = model  # the parameters (COMMBENCH_FAULT=...:nan poisons them)
        self.num_params, self.flops_per_token = model.num_params(), model.flops_per_token()

        self.local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.ranks_per_node = cfg.network.ranks_per_node or self.local_ranks
        set_compute_clock(cfg.run.compute_clock)  # before the strategy makes its clocks
        self.compute_clock, self.work = work_clock(device)
        """Which clock a step's compute is measured on, and its seconds function: the
        strategies' `work()` marks (DDP's bucket leads) are on the same one."""
        self.profiles = {name: get_profile(name) for name in cfg.network.profiles}
        self.net_model = backend if cfg.network.model == "auto" else cfg.network.model
        delay = (delay_policy(get_profile(cfg.network.emulate), self.rank, self.ranks_per_node,
                              backend=self.net_model) if cfg.network.emulate else None)
        self.ledger = CommLedger(keep_records)
        self.comm = Communicator(self.rank, self.world, device, self.ledger, delay,
                                 self.ranks_per_node)
        precision = cfg.model.precision
        setup = TrainSetup(
            model=model, comm=self.comm, make_optimizer=make_optimizer_factory(cfg),
            total_steps=cfg.run.steps, grad_clip=cfg.optim.grad_clip,
            group_size=cfg.parallel.group_size, rank_batch_size=cfg.data.batch_size,
            num_microbatches=cfg.parallel.num_microbatches,
            autocast=lambda: autocast_context(device.type, precision),
            num_stages=cfg.parallel.num_stages, partition=cfg.parallel.partition,
            loss_fn=lm_loss, delay_correction=cfg.optim.delay_correction,
            ef_lambda=cfg.optim.ef_lambda, shard=cfg.parallel.shard,
            # the strategy compiles what it trains, after wrapping it (compile(DDP(model)))
            compile=torch.compile if cfg.model.compile else None, precision=precision,
        )
        self.strategy = strategy_class(cfg.strategy.name)(cfg.strategy, setup)
        shard, num_shards = self.strategy.data_shard()
        self.stream = BatchStream(splits.train, cfg.model.seq_len, cfg.data.batch_size, shard,
                                  num_shards, cfg.run.seed)
        # the same windows for every layout; ranks sharing a batch share its share of them
        self.val_set = validation_set(splits.val, cfg.model.seq_len, cfg.run.val_sequences)
        self.val = self.val_set.batches(cfg.data.batch_size, shard, num_shards)
        self.data_meta = splits.meta

    # ------------------------------------------------------------------ evaluation

    def validate(self) -> tuple[float, dict[str, float]]:
        """Validation loss of the strategy's eval model, and of its extra eval models: each
        the exact mean over every position of the validation set (`mean_loss`)."""
        with self.comm.phase("eval"):
            loss = self.strategy.evaluate(self.val)
            extra = self.strategy.extra_eval_models()
        return loss, {name: mean_loss(m, self.val, self.device, self.strategy.setup.autocast)
                      for name, m in extra.items()}

    # ------------------------------------------------------------------------ loop

    def run(self) -> dict:
        """Train from step 0 (or the checkpoint when resuming); returns summary.json's body."""
        cfg, rank = self.cfg, self.rank
        saved = checkpoint.load_state(self.records, rank, self.strategy, self.ledger,
                                      self.checkpoint_group)
        window = MetricsWindow()
        if saved and "window" in saved:  # a checkpoint between two metrics rows
            window.load_state_dict(saved.pop("window"))
        state = LoopState.restore(saved) if saved else LoopState()
        saved_step = state.step if saved else None  # the step of the state on disk
        clock = StepClock(self.profiles, rank, self.ranks_per_node, self.device, self.net_model,
                          self.strategy.critical_path(), state.recent_compute_s)
        progress = sys.stderr if rank == 0 and os.environ.get("COMMBENCH_PROGRESS") else None
        fault = fault_injection(rank)
        every = checkpoint.interval(cfg)
        state.add_one_off(self.warm_up(state.step))  # the same fresh or resumed
        first_step = state.step
        warm_end = min(first_step + cfg.run.warmup_steps, cfg.run.steps)  # one-off costs
        settled_at = first_step

        def settle() -> None:
            """Fold the steps since the last settle into the state: those before warm_end
            as warm-up (a settle always falls at warm_end, so no window holds both)."""
            nonlocal settled_at
            warm = max(0, min(state.step, warm_end) - settled_at)
            state.advance(clock.settle(), warmup_steps=warm)
            settled_at = state.step

        stopped = False
        for step in range(state.step, cfg.run.steps):
            if self.stop.reached(step):  # the boundary after `step` steps
                stopped = True
                break
            if fault is not None and step == fault[0]:
                inject_fault(fault[1], rank, step, self.model)
            if (step + 1) % cfg.run.log_every == 0 or step + 1 == cfg.run.steps:
                self.strategy.watch_next_step()  # its metrics row follows this step
            stats, step_s, compute_s, step_records = self.timed_step(step)
            state.step = step + 1
            state.compute_s += compute_s
            state.comm_s += stats.comm_s
            state.idle_s += stats.idle_s
            window.add(stats, step_s, sum(r.nbytes for r in step_records), state.step,
                       compute_s)
            clock.add(step_s, stats, step_records, state.compute_samples, compute_s)
            if state.step == warm_end:  # the warm-up steps, settled apart
                settle()

            last = state.step == cfg.run.steps
            if state.step % cfg.run.log_every == 0 or last:
                settle()
                values, nonfinite = window.flush(self.device, self.world)
                with self.comm.phase("metrics"):
                    values.update(self.strategy.metrics())
                row = train_row(state.step, state.tokens, state.elapsed_s, state.projected_s,
                                lr=lr_at(step, cfg), **values)
                if rank == 0:
                    self.records.append_metrics(row)
                    if progress:
                        print(progress_line(row, cfg.run.steps), file=progress, flush=True)
                if nonfinite:
                    state.status, state.diverged = "diverged", window.culprit
                    break
            if (cfg.run.val_every and state.step % cfg.run.val_every == 0) or last:
                settle()
                self.validation_row(state)
                if not math.isfinite(state.last_val):
                    state.status = "diverged"
                    break
            if every and state.step % every == 0 and not last:
                settle()
                every = checkpoint.save_periodic(self.records, rank, state.step, self.strategy,
                                                 self.ledger, self.loop_state(state, window),
                                                 cfg, every, self.checkpoint_group)
                saved_step = state.step if every else saved_step
        settle()  # every rank has passed its last boundary
        self.stop.close()
        if stopped:
            if saved_step != state.step and cfg.checkpoint.every != 0:
                checkpoint.save_at_stop(self.records, rank, state.step, self.strategy,
                                        self.ledger, self.loop_state(state, window),
                                        self.checkpoint_group)
            state.status = "failed"

        if state.status == "ok" and cfg.checkpoint.final:
            with self.comm.phase("eval"):  # e.g. GASLoC's average: not training traffic
                checkpoint.save_eval_model(self.records, rank, self.strategy,
                                           vars(self.model_config), cfg.data.tokenizer,
                                           cfg.run.steps, self.checkpoint_group)
        summary = self.summarise(state)
        if stopped:  # partial (bench/run/records.py status_of): resumed, not kept as a failure
            summary.update(interrupted=True, stopped_by=self.stop.reason,
                           error=f"stopped by {self.stop.reason} at step {state.step}")
        return summary

    @staticmethod
    def loop_state(state: LoopState, window: MetricsWindow) -> dict:
        """What a checkpoint carries of the loop: LoopState and the open metrics window."""
        return {**asdict(state), "window": window.state_dict()}

    def warm_up(self, step: int) -> float:
        """One-off work before this process's first step `step`, outside the timed steps:
        every group's communicator created (`Communicator.warm_up`; NCCL makes them lazily)
        and the strategy's own (`Strategy.warm_up`: DDP's bucket rebuild). The slowest
        rank's seconds (a one-off cost, bench/run/meter.py Warm-up)."""
        synchronize(self.device)
        start = time.perf_counter()
        self.comm.warm_up()
        if step < self.cfg.run.steps:
            self.strategy.warm_up(tuple(t.to(self.device) for t in self.stream.batch(step)))
        synchronize(self.device)
        (seconds,) = all_reduce_floats([time.perf_counter() - start], self.device,
                                       dist.ReduceOp.MAX)
        return seconds

    def timed_step(self, step: int) -> tuple[StepStats, float, float, list]:
        """One training step: (its stats, its seconds, its compute seconds on the work clock,
        its training-traffic ledger records). Compute: on CPU this rank's CPU time in the
        step plus a straggler's sleep; on CUDA step_s - comm_s (bench/run/meter.py, Compute
        clock)."""
        self.comm.step = step
        self.strategy.set_lr(lr_at(step, self.cfg))
        x, y = (t.to(self.device, non_blocking=True) for t in self.stream.batch(step))
        self.ledger.trim()  # the aggregates keep the run; the records, this step
        first_record = len(self.ledger.records)
        synchronize(self.device)
        work_start, start = self.work(), time.perf_counter()
        stats = self.strategy.train_step((x, y))
        synchronize(self.device)
        work_s = self.work() - work_start
        slept = straggle(self.cfg.run.straggler, self.rank, time.perf_counter() - start)
        step_s = time.perf_counter() - start
        compute_s = (step_s - stats.comm_s if self.compute_clock == WALL
                     else work_s + slept)
        records = [r for r in self.ledger.records[first_record:] if r.phase in TRAIN_PHASES]
        return stats, step_s, compute_s, records

    def validation_row(self, state: LoopState) -> None:
        """Validate, log the row, and note the first time the target loss is reached."""
        state.last_val, state.extra_val = self.validate()
        state.best_val = min(state.best_val, state.last_val)
        if self.rank == 0:
            self.records.append_metrics(val_row(state.step, state.tokens, state.elapsed_s,
                                                state.projected_s, state.last_val,
                                                state.extra_val))
        target = self.cfg.run.target_loss
        if target is not None and state.target is None and state.last_val <= target:
            state.target = {"time_to_target_s": state.elapsed_s,
                            "time_to_target_steady_s": state.elapsed_s - state.warmup_s,
                            "tokens_to_target": state.tokens,
                            "projected_time_to_target_s": dict(state.projected_s)}

    def _projections(self, total_s: dict[str, float], compute_s: dict[str, float],
                     warmup_s: dict[str, float], state: LoopState) -> dict[str, Projection]:
        """Per profile: the run's projected total, its compute and comm per step (one
        timeline: bench/network/timeline.py `coupled_max`), steady rate."""
        return {name: Projection.of(total_s.get(name, 0.0), compute_s.get(name, 0.0),
                                    state.step, state.tokens, warmup_s.get(name, 0.0),
                                    state.warmup_tokens) for name in self.profiles}

    def summarise(self, state: LoopState) -> dict:
        """The run's summary (every rank returns it) and, on rank 0, comm.jsonl."""
        cfg = self.cfg
        totals = run_totals(self.ledger, self.device, self.net_model)
        if self.rank == 0:
            write_jsonl(self.records.comm, totals.comm_rows)
        with self.comm.phase("metrics"):
            fields = self.strategy.summary_fields()
        busy_s, idle_s = all_reduce_floats([state.compute_s + state.comm_s, state.idle_s],
                                           self.device)
        (projection_s,) = all_reduce_floats([state.projection_s], self.device,
                                            dist.ReduceOp.MAX)
        peaks = self.per_rank(peak_memory_bytes(self.device))
        estimate = self.memory_plan.per_rank(on_cpu=self.device.type == "cpu")
        peak = peak_flops(self.device, cfg.model.precision)
        steady_tokens, steady_s = state.steady()
        peak_sync = peak_sync_bytes(state.bytes_series)
        mfu = (self.flops_per_token * steady_tokens / steady_s / (peak * self.world)
               if peak and steady_s > 0 else None)
        robust = self.robust_fields(state)
        return Summary(
            status=state.status, run_name=cfg.run.name, strategy=cfg.strategy.name,
            world_size=self.world, steps=state.step, total_tokens=state.tokens,
            wall_s=state.elapsed_s, warmup_s=state.warmup_s, warmup_steps=state.warmup_steps,
            warmup_tokens=state.warmup_tokens, compute_s_total=state.compute_s,
            comm_s_total=state.comm_s,
            comm_bytes_total=totals.logical_bytes, comm_wire_bytes_total=totals.wire_bytes,
            comm_peak_sync_bytes=peak_sync[0], comm_peak_sync_wire_bytes=peak_sync[1],
            comm_bytes_series=state.bytes_series,
            final_val_loss=state.last_val,
            val_set=self.val_set.record(),
            best_val_loss=state.best_val if math.isfinite(state.best_val) else None,
            final_val_loss_extra=state.extra_val, target_loss=cfg.run.target_loss,
            **(state.target or {}),
            projected=self._projections(state.projected_s, state.projected_compute_s,
                                        state.warmup_projected_s, state),
            projected_no_overlap=self._projections(state.projected_no_overlap_s,
                                                   state.projected_compute_no_overlap_s,
                                                   state.warmup_projected_no_overlap_s, state),
            projection_model=f"{self.net_model} collectives, overlap-aware" + (
                "; FSDP's all-gathers and reduce-scatters priced with no overlap (an upper "
                "bound: FSDP2 overlaps them with compute on a GPU)"
                if cfg.parallel.shard != "none" else ""),
            optim=describe_optimizer(getattr(self.strategy, "optimizer", None), cfg),
            num_params=self.num_params, flops_per_token=self.flops_per_token,
            device=self.device.type, backend=self.backend, data=self.data_meta, mfu=mfu,
            error=state.diverged,
            bubble_fraction_measured=idle_s / busy_s if busy_s > 0 else None,
            peak_memory_bytes=max(peaks), peak_memory_bytes_per_rank=peaks,
            peak_memory_above_start_bytes_per_rank=self.per_rank(
                peak_memory_bytes(self.device) - self.start_memory),
            memory_estimate_bytes_per_rank=estimate,
            memory_estimate_terms=self.memory_plan.ranks[
                self.memory_plan.rank_roles[estimate.index(max(estimate))]].terms,
            projection_s_total=projection_s,
            projection_s_per_step=projection_s / state.step if state.step else None,
            ranks_per_node=self.ranks_per_node, compute_clock=self.compute_clock,
            ranks_per_core=ranks_per_core(self.local_ranks, self.device), **robust, **fields,
        ).to_dict()

    def robust_fields(self, state: LoopState) -> dict:
        """summary.json's `compute_per_step` (every rank's compute per step kind: median,
        10th/90th percentile, mean) and `projected_robust` (the overlap-aware projection
        with each rank's median compute per step kind: bench/network/timeline.py
        `robust_projection`). Collective (outside the ledger)."""
        stats = [None] * self.world
        dist.all_gather_object(stats, compute_stats(state.compute_samples))
        kinds = sorted({k for rank in stats for k in rank})
        per_kind = {kind: {key: [rank.get(kind, {}).get(key) for rank in stats]
                           for key in ("steps", "median_s", "p10_s", "p90_s", "mean_s")}
                    for kind in kinds}
        if not state.robust_stretches:  # none, or dropped (meter.py ROBUST_RECORD_LIMIT)
            return {"compute_per_step": per_kind or None}
        medians = [{k: v["median_s"] for k, v in rank.items()} for rank in stats]
        names = list(self.profiles)
        totals, compute = robust_projection(
            state.robust_stretches, medians, 2 * len(names),
            self.strategy.critical_path(), len(names))
        projected = {name: Projection.of(totals[i], compute[i], state.step, state.tokens)
                     for i, name in enumerate(names)}  # overlap-aware: the first columns
        return {"compute_per_step": per_kind, "projected_robust": projected}

    def per_rank(self, value: int) -> list[int]:
        """Every rank's `value`, in rank order (a collective outside the ledger)."""
        values = [0.0] * self.world
        values[self.rank] = float(value)
        return [int(v) for v in all_reduce_floats(values, self.device)]


def main(run_dir: str) -> int:
    die_with_parent()  # never outlive torchrun (bench/launch/torchrun.py)
    announce_start()  # the launcher's bound on torchrun's rendezvous ends here
    run = RunDir(run_dir)
    cfg = from_dict(load_raw(run.config))
    device, backend = resolve_device(cfg)
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.parallel.timeout_s))
    rank = dist.get_rank()
    share_cores(int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())))
    try:
        stop = StopRequest(rank, dist.get_world_size(), cfg.checkpoint.timeout_s)
        handle_signals(stop)
        if run.stop_request.exists():  # the launcher relayed a stop before the handlers
            stop.request(run.stop_request.read_text().strip() or "a stop request")
        write_node_record(run)
        trainer = Trainer(cfg, run.path, device, backend, stop=stop)
        if rank == 0:
            write_json(run.env, capture_env(dist.get_world_size(), backend, device.type))
        summary = trainer.run()
        trainer.strategy.close()
        if rank == 0:
            run.update_summary(summary)
        write_text(run.finished(rank), "")
        dist.barrier()
        fault = fault_injection(rank)
        if fault is not None and fault[1] == "exit":
            os.abort()
        return 0
    except Exception:
        with contextlib.suppress(OSError):  # a full disk: torchrun's output has it too
            write_text(run.error_log(rank), traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def write_node_record(run: RunDir) -> None:
    """On each node's local rank 0: logs/nodeN.json, its host and ranks (torchrun's env)."""
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        return
    first, count = dist.get_rank(), int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    write_json(run.node_record(int(os.environ.get("GROUP_RANK", 0))),
               {"host": socket.gethostname(), "ranks": list(range(first, first + count))})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
