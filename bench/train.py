"""THE training loop: one per rank, the same for every strategy.

Started by `commbench run CONFIG` through torchrun (`python -m bench.train RUN_DIR`), it
reads RUN_DIR/config.yaml, trains, and writes metrics.jsonl, comm.jsonl, summary.json and
checkpoints. It never mentions an algorithm by name: the strategy is built from the
registry and called through the Strategy interface (algorithms/base.py).

Timing. Each step is timed on the host with the device synchronised before and after.
`step_s` is the whole step; `comm_s` is the strategy's exposed communication; `compute_s`
is the rest. Validation, logging and checkpointing are outside the timed steps, so
throughput = tokens / sum(step_s). Metric rows are means over ranks and over the steps
since the previous row; the harness's own metric reductions go straight to
torch.distributed and never enter the ledger, which holds only algorithm traffic.
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from algorithms.base import StepStats, TrainSetup, strategy_class, unwrap
from algorithms.comm import CommLedger, Communicator
from bench import records
from bench.config import Config, from_dict, load_raw
from bench.data import BatchStream, get_tokenizer, load_corpus, val_batches
from bench.model import GPT, autocast_context, gpt_config
from bench.network import delay_policy, get_profile, project
from bench.optim import lr_at, make_optimizer_factory

TRAIN_PHASES = ("train", "inner", "outer", "gossip")
"""Ledger phases counted as training traffic (evaluation and metrics traffic is not)."""


def resolve_device(cfg: Config) -> tuple[torch.device, str]:
    want = cfg.parallel.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("parallel.device is 'cuda' but no CUDA device is available")
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    return device, backend


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reduce(values: list[float], device: torch.device, op=dist.ReduceOp.SUM) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


class Trainer:
    """Builds everything for one rank and runs the steps."""

    def __init__(self, cfg: Config, run_dir: Path, device: torch.device, backend: str):
        self.cfg, self.run_dir, self.device, self.backend = cfg, run_dir, device, backend
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(cfg.run.seed)

        tokenizer = get_tokenizer(cfg.data.tokenizer)
        if self.rank != 0:
            dist.barrier()  # rank 0 tokenises and caches the corpus first
        splits = load_corpus(cfg.data.corpus, cfg.data.tokenizer, cfg.data.cache_dir,
                             cfg.data.val_fraction)
        if self.rank == 0:
            dist.barrier()

        self.model_config = gpt_config(
            cfg.model.preset, tokenizer.vocab_size, cfg.model.seq_len, cfg.model.dropout,
            n_layer=cfg.model.n_layer, n_head=cfg.model.n_head, n_embd=cfg.model.n_embd,
        )
        model = GPT(self.model_config).to(device)
        self.num_params = model.num_params()
        self.flops_per_token = model.flops_per_token()
        if cfg.model.compile:
            model = torch.compile(model)

        ranks_per_node = cfg.network.ranks_per_node or int(
            os.environ.get("LOCAL_WORLD_SIZE", self.world)
        )
        self.ranks_per_node = ranks_per_node
        delay = None
        if cfg.network.emulate:
            delay = delay_policy(get_profile(cfg.network.emulate), self.rank, ranks_per_node)
        self.ledger = CommLedger()
        comm = Communicator(self.rank, self.world, device, self.ledger, delay, ranks_per_node)
        precision = cfg.model.precision
        setup = TrainSetup(
            model=model,
            comm=comm,
            make_optimizer=make_optimizer_factory(cfg),
            total_steps=cfg.run.steps,
            grad_clip=cfg.optim.grad_clip,
            group_size=cfg.parallel.group_size,
            rank_batch_size=cfg.data.batch_size,
            num_microbatches=cfg.parallel.num_microbatches,
            autocast=lambda: autocast_context(device.type, precision),
        )
        self.comm = comm
        self.strategy = strategy_class(cfg.strategy.name)(cfg.strategy, setup)
        shard, num_shards = self.strategy.data_shard()
        self.stream = BatchStream(
            splits.train, cfg.model.seq_len, cfg.data.batch_size, shard, num_shards,
            cfg.run.seed,
        )
        self.global_batch_tokens = cfg.data.batch_size * num_shards * cfg.model.seq_len
        all_val = val_batches(splits.val, cfg.model.seq_len, cfg.data.batch_size,
                              cfg.run.val_batches)
        self.val = all_val[self.rank :: self.world]
        self.data_meta = splits.meta

    # ------------------------------------------------------------------ evaluation

    def validate(self) -> tuple[float, dict[str, float]]:
        """Validation loss of the strategy's eval model, and of its extra eval models."""
        with self.comm.phase("eval"):
            model = self.strategy.eval_model()
            extra = self.strategy.extra_eval_models()
        return self.val_loss(model), {name: self.val_loss(m) for name, m in extra.items()}

    @torch.no_grad()
    def val_loss(self, model: torch.nn.Module) -> float:
        was_training = model.training
        model.eval()
        total, count = 0.0, 0
        for x, y in self.val:
            with autocast_context(self.device.type, self.cfg.model.precision):
                _, loss = model(x.to(self.device), y.to(self.device))
            total += loss.item()
            count += 1
        model.train(was_training)
        total, count = _reduce([total, count], self.device)
        return total / count

    # ------------------------------------------------------------------------ loop

    def run(self) -> dict:
        cfg, rank = self.cfg, self.rank
        metrics = self.run_dir / "metrics.jsonl"
        start_step, state = self.maybe_resume()
        elapsed, tokens = state.get("elapsed", 0.0), state.get("tokens", 0)
        totals = state.get("totals", {"compute_s": 0.0, "comm_s": 0.0, "steps": 0})
        best_val = state.get("best_val", math.inf)
        target = state.get("target", None)
        window = _Window()
        status, last_val = "ok", state.get("last_val")
        extra_val = state.get("extra_val", {})
        progress = sys.stderr if rank == 0 and os.environ.get("COMMBENCH_PROGRESS") else None

        fault = _fault_injection(rank)
        for step in range(start_step, cfg.run.steps):
            self.comm.step = step
            if fault is not None and step == fault[0]:
                _inject(fault[1], rank, step)
            self.strategy.set_lr(lr_at(step, cfg))
            x, y = (t.to(self.device, non_blocking=True) for t in self.stream.batch(step))
            first_record = len(self.ledger.records)
            _sync(self.device)
            t0 = time.perf_counter()
            stats: StepStats = self.strategy.train_step((x, y))
            _sync(self.device)
            step_s = time.perf_counter() - t0
            step_bytes, _ = self.ledger.totals(TRAIN_PHASES, start=first_record)
            elapsed += step_s
            tokens += self.global_batch_tokens
            totals["comm_s"] += stats.comm_s
            totals["compute_s"] += step_s - stats.comm_s
            totals["steps"] += 1
            window.add(stats, step_s, step_bytes)

            last = step == cfg.run.steps - 1
            if (step + 1) % cfg.run.log_every == 0 or last:
                row = window.flush(self.device, self.world)
                with self.comm.phase("metrics"):
                    row.update(self.strategy.metrics())
                row.update(step=step + 1, tokens=tokens, elapsed_s=elapsed,
                           lr=lr_at(step, cfg))
                nonfinite = row.pop("nonfinite")
                if rank == 0:
                    records.append_jsonl(metrics, row)
                    if progress:
                        print(_progress_line(row, cfg.run.steps), file=progress, flush=True)
                if nonfinite:
                    status = "diverged"
                    break
            if (cfg.run.val_every and (step + 1) % cfg.run.val_every == 0) or last:
                last_val, extra_val = self.validate()
                best_val = min(best_val, last_val)
                if rank == 0:
                    records.append_jsonl(metrics, {"step": step + 1, "tokens": tokens,
                                                   "elapsed_s": elapsed, "val_loss": last_val,
                                                   **_prefixed("val_loss_", extra_val)})
                if (cfg.run.target_loss is not None and target is None
                        and last_val <= cfg.run.target_loss):
                    target = {"time_to_target_s": elapsed, "tokens_to_target": tokens}
                if not math.isfinite(last_val):
                    status = "diverged"
                    break
            if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0 and not last:
                self.save_state(step + 1, {"elapsed": elapsed, "tokens": tokens,
                                           "totals": totals, "best_val": best_val,
                                           "target": target, "last_val": last_val,
                                           "extra_val": extra_val})

        if status == "ok" and cfg.checkpoint.final:
            self.save_eval_model(cfg.run.steps)
        return self.summarise(status, elapsed, tokens, totals, last_val, best_val, target,
                              extra_val)

    # ---------------------------------------------------------------- checkpoints

    def state_path(self) -> Path:
        return self.run_dir / "checkpoints" / f"state-rank{self.rank}.pt"

    def save_state(self, step: int, loop_state: dict) -> None:
        payload = {"step": step, "strategy": self.strategy.state_dict(), "loop": loop_state,
                   "rng": torch.get_rng_state(), "ledger": self.ledger.records}
        path = self.state_path()
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, path)
        dist.barrier()  # every rank's state is on disk before any rank moves on

    def maybe_resume(self) -> tuple[int, dict]:
        path = self.state_path()
        if not os.environ.get("COMMBENCH_RESUME") or not path.exists():
            return 0, {}
        payload = torch.load(path, weights_only=False)
        self.strategy.load_state_dict(payload["strategy"])
        torch.set_rng_state(payload["rng"])
        self.ledger.records.extend(payload["ledger"])
        step = payload["step"]
        if self.rank == 0:  # drop rows logged after the checkpoint; they will be redone
            metrics = self.run_dir / "metrics.jsonl"
            rows = [r for r in records.read_jsonl(metrics) if r["step"] <= step]
            records.write_jsonl(metrics, rows)
        return step, payload["loop"]

    def save_eval_model(self, step: int) -> None:
        with self.comm.phase("eval"):
            model = self.strategy.eval_model()
        if self.rank == 0:
            model = unwrap(model)
            state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            payload = {"model": state, "gpt_config": vars(self.model_config).copy(),
                       "tokenizer": self.cfg.data.tokenizer, "step": step}
            path = self.run_dir / "checkpoints" / "final.pt"
            path.parent.mkdir(exist_ok=True)
            torch.save(payload, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)

    # -------------------------------------------------------------------- summary

    def summarise(self, status, elapsed, tokens, totals, last_val, best_val, target,
                  extra_val=None) -> dict:
        cfg = self.cfg
        steps = max(1, totals["steps"])
        train = [r for r in self.ledger.records if r.phase in TRAIN_PHASES]
        local_bytes = sum(r.nbytes for r in train)
        compute_per_step = totals["compute_s"] / steps
        projected_comm = [
            project(train, get_profile(name), self.rank, self.ranks_per_node) / steps
            for name in cfg.network.profiles
        ]
        # the slowest rank sets the pace: take maxima over ranks
        maxima = _reduce([compute_per_step, *projected_comm], self.device, dist.ReduceOp.MAX)
        sums = _reduce([local_bytes, elapsed], self.device)
        compute_max, comm_by_profile = maxima[0], maxima[1:]
        tokens_per_step = self.global_batch_tokens
        projected = {}
        for name, comm_s in zip(cfg.network.profiles, comm_by_profile, strict=True):
            step_s = compute_max + comm_s
            projected[name] = {
                "step_s": step_s,
                "comm_s": comm_s,
                "total_s": step_s * cfg.run.steps,
                "throughput_tokens_per_s": tokens_per_step / step_s if step_s > 0 else None,
            }
        aggregates = [None] * self.world
        dist.all_gather_object(aggregates, self.ledger.aggregate())
        if self.rank == 0:
            rows = [{"rank": r, **row} for r, agg in enumerate(aggregates) for row in agg]
            records.write_jsonl(self.run_dir / "comm.jsonl", rows)
        summary = {
            "status": status,
            "run_name": cfg.run.name,
            "strategy": cfg.strategy.name,
            "num_params": self.num_params,
            "flops_per_token": self.flops_per_token,
            "world_size": self.world,
            "device": self.device.type,
            "backend": self.backend,
            "steps": totals["steps"],
            "total_tokens": tokens,
            "wall_s": elapsed,
            "throughput_tokens_per_s": tokens / elapsed if elapsed > 0 else None,
            "compute_s_total": totals["compute_s"],
            "comm_s_total": totals["comm_s"],
            "comm_share": totals["comm_s"] / elapsed if elapsed > 0 else None,
            "comm_bytes_total": int(sums[0]),
            "comm_bytes_per_rank": int(sums[0]) // self.world,
            "final_val_loss": last_val,
            **_prefixed("final_val_loss_", extra_val or {}),
            "best_val_loss": best_val if math.isfinite(best_val) else None,
            "target_loss": cfg.run.target_loss,
            **(target or {"time_to_target_s": None, "tokens_to_target": None}),
            "projected": projected,
            "data": self.data_meta,
        }
        if self.device.type == "cuda" and elapsed > 0:
            peak = _peak_flops(self.device)
            if peak:
                summary["mfu"] = self.flops_per_token * tokens / elapsed / (peak * self.world)
        return summary


class _Window:
    """Per-rank sums since the last metrics row."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.n, self.loss, self.step_s, self.comm_s, self.bytes = 0, 0.0, 0.0, 0.0, 0
        self.nonfinite = 0
        self.extras: dict[str, float] = {}

    def add(self, stats: StepStats, step_s: float, nbytes: int):
        self.n += 1
        if math.isfinite(stats.loss):
            self.loss += stats.loss
        else:
            self.nonfinite += 1
        self.step_s += step_s
        self.comm_s += stats.comm_s
        self.bytes += nbytes
        self.extras.update(stats.extras)  # latest value of each algorithm scalar

    def flush(self, device, world) -> dict:
        sums = _reduce([self.loss, self.step_s, self.comm_s, self.bytes, self.nonfinite],
                       device)
        n = self.n * world
        finite = n - sums[4]
        row = {
            "loss": sums[0] / finite if finite else float("nan"),
            "step_s": sums[1] / n,
            "compute_s": (sums[1] - sums[2]) / n,
            "comm_s": sums[2] / n,
            "comm_bytes": sums[3] / n,
            **self.extras,
            "nonfinite": bool(sums[4]),
        }
        self.reset()
        return row


def _prefixed(prefix: str, values: dict[str, float]) -> dict[str, float]:
    return {prefix + name: value for name, value in values.items()}


def _progress_line(row: dict, steps: int) -> str:
    share = row["comm_s"] / row["step_s"] if row["step_s"] else 0.0
    tps = row["tokens"] / row["elapsed_s"] if row["elapsed_s"] else 0.0
    return (f"PROGRESS step {row['step']}/{steps} loss {row['loss']:.4f} "
            f"tok/s {tps:,.0f} comm {share:.0%}")


def _fault_injection(rank: int) -> tuple[int, str] | None:
    """COMMBENCH_FAULT="RANK:STEP:crash|hang" makes one rank fail on purpose.

    Used by the tests (and handy on a cluster) to check that a dead or stuck rank ends
    the run with status failed and its error text, within the process-group timeout.
    """
    spec = os.environ.get("COMMBENCH_FAULT")
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) != 3 or not (parts[0].isdigit() and parts[1].isdigit()) or \
            parts[2] not in ("crash", "hang"):
        raise ValueError(f"COMMBENCH_FAULT must be RANK:STEP:crash|hang, got {spec!r}")
    return (int(parts[1]), parts[2]) if int(parts[0]) == rank else None


def _inject(mode: str, rank: int, step: int) -> None:
    if mode == "hang":
        time.sleep(10**6)
    raise RuntimeError(f"injected fault on rank {rank} at step {step} (COMMBENCH_FAULT)")


def _peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of known GPUs (for MFU); None when unknown."""
    name = torch.cuda.get_device_name(device)
    for key, flops in {"H200": 989e12, "H100": 989e12, "A100": 312e12, "GH200": 989e12}.items():
        if key in name:
            return flops
    return None


def main(run_dir: str) -> int:
    run_dir = Path(run_dir)
    cfg = from_dict(load_raw(run_dir / "config.yaml"))
    device, backend = resolve_device(cfg)
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.parallel.timeout_s))
    rank = dist.get_rank()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    try:
        trainer = Trainer(cfg, run_dir, device, backend)
        if rank == 0:
            records.write_json(run_dir / "env.json",
                               records.capture_env(dist.get_world_size(), backend, device.type))
        summary = trainer.run()
        trainer.strategy.close()
        if rank == 0:
            records.update_summary(run_dir, summary)
        dist.barrier()
        return 0
    except Exception:
        log = run_dir / "logs" / f"error-rank{rank}.txt"
        log.parent.mkdir(exist_ok=True)
        log.write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
