"""The record schema: summary.json and the metrics.jsonl rows, defined once.

`commbench run` writes them through these builders (bench/run/train.py at the end of the
loop, bench/launch/run.py for the launcher's fields); tests build fixtures with the same
builders: `train_row(...)`, `val_row(...)` and tests/fakes.py's `make_summary(...)`, then
`write_fake_run(path, config, rows, summary)`.

How the times are measured (max over ranks, real tokens, step-by-step projection) is in
bench/run/meter.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Projection:
    """The run's time on one network profile (bench/network/), modelled from its ledger.

    Every figure prices one timeline (bench/network/timeline.py `coupled_max`): per stretch between
    the steps where ranks communicate, the rank whose compute + modelled comm ends it.
    So step_s == compute_s + comm_s, total_s == step_s x steps, and the throughput and
    the projected clock of metrics.jsonl (`projected_elapsed_s`, whose last value is
    total_s) are the same totals'."""

    total_s: float
    """Measured compute + modelled comm, the slowest rank's between the steps where ranks
    communicate, summed (bench/network/timeline.py `coupled_max`)."""
    step_s: float
    """total_s / steps."""
    compute_s: float
    """Measured compute seconds per step on that timeline: per stretch, the compute of
    the rank that ends it (not the slowest rank's compute overall, nor a mean)."""
    comm_s: float
    """Modelled seconds per step on that timeline that are not compute: step_s -
    compute_s (exposed communication; for a pipeline priced on its critical path, the
    bubble and exposed hops too)."""
    throughput_tokens_per_s: float | None
    """Steady state: tokens consumed / total_s, both without the warm-up steps' (None
    when every step was warm-up)."""
    warmup_s: float = 0.0
    """The warm-up steps' share of total_s (bench/run/meter.py, Warm-up)."""

    @classmethod
    def of(cls, total_s: float, compute_s: float, steps: int, tokens: int,
           warmup_s: float = 0.0, warmup_tokens: int = 0) -> Projection:
        """From the run's totals: `total_s` and the `compute_s` inside it (both summed over
        the run, on one timeline)."""
        steady_s = total_s - warmup_s
        step_s, compute_per_step = total_s / max(1, steps), compute_s / max(1, steps)
        return cls(total_s=total_s, step_s=step_s, compute_s=compute_per_step,
                   comm_s=step_s - compute_per_step,
                   throughput_tokens_per_s=(tokens - warmup_tokens) / steady_s
                   if steady_s > 0 else None, warmup_s=warmup_s)


@dataclass
class Summary:
    """summary.json of a run that ended (status ok, diverged or failed).

    `to_dict()` is the record: these fields, plus the derived throughput_tokens_per_s,
    comm_share and comm_bytes_per_rank, plus final_val_loss_NAME for each extra eval model.
    Optional fields that are None are left out.
    """

    status: str
    """ok | diverged | failed (running while training; see bench.run.records.status_of)."""
    run_name: str
    strategy: str
    world_size: int
    steps: int = 0
    """Steps trained."""
    total_tokens: int = 0
    """Tokens consumed, summed over ranks (StepStats.tokens)."""
    wall_s: float = 0.0
    """Step-synchronised wall clock: max over ranks between settle points (bench/run/meter.py);
    includes the one-off costs in warmup_s."""
    warmup_s: float = 0.0
    """One-off seconds in wall_s: each process's first run.warmup_steps steps (compile,
    communicator creation, autotuning) and the eager creation of its groups' communicators
    (bench/run/meter.py, Warm-up). Throughput and MFU leave them out."""
    warmup_steps: int = 0
    """Steps measured as warm-up (per process: a resumed run warms up again)."""
    warmup_tokens: int = 0
    """Tokens consumed in the warm-up steps (left out of throughput)."""
    compute_s_total: float = 0.0
    """Rank 0's measured compute seconds, on the clock `compute_clock` names."""
    comm_s_total: float = 0.0
    """Rank 0's exposed communication seconds."""
    comm_bytes_total: int = 0
    """Logical bytes of training traffic, summed over ranks."""
    comm_wire_bytes_total: int | None = None
    """Modelled bytes on the wire (e.g. a ring all-reduce sends 2(n-1)/n of its payload),
    summed over ranks (bench.network.wire_bytes)."""
    comm_peak_sync_bytes: int | None = None
    """The largest logical payload of training traffic any rank sent in one step: one
    synchronisation's bytes (DDP: a step's gradients; DiLoCo: a round's pseudo-gradient;
    Streaming DiLoCo: a fragment's, in the step that waited for it), the last step's
    closing sync left out (bench/run/meter.py, Bytes per step). Peak bandwidth is this over
    the time a sync may take."""
    comm_peak_sync_wire_bytes: int | None = None
    """The same in modelled wire bytes (bench.network.wire_bytes)."""
    comm_bytes_series: list[list[int]] | None = None
    """Per step, the largest training traffic any rank sent in it, run-length encoded:
    [[first step (1-based), steps, bytes, wire bytes], ...] (DDP: one run; DiLoCo: a spike
    every H steps; Streaming DiLoCo: P smaller ones)."""
    final_val_loss: float | None = None
    best_val_loss: float | None = None
    val_set: dict | None = None
    """The validation set every val_loss is the exact mean over: {id, sequences, seq_len,
    tokens} (bench/data/batches.py `ValidationSet.record`; tokens = positions scored). Losses
    compare only between runs with the same `id`; records without it predate it."""
    final_val_loss_extra: dict[str, float] = field(default_factory=dict)
    """Final validation loss of each extra eval model, recorded as final_val_loss_NAME."""
    target_loss: float | None = None
    time_to_target_s: float | None = None
    """wall_s at the first validation at or below target_loss (one-off costs included)."""
    time_to_target_steady_s: float | None = None
    """time_to_target_s without the one-off costs (warmup_s) paid by then."""
    tokens_to_target: int | None = None
    projected_time_to_target_s: dict[str, float] | None = None
    """Per profile: projected elapsed seconds at that validation."""
    projected: dict[str, Projection] = field(default_factory=dict)
    """Per profile, overlap-aware (see projection_model)."""
    projected_no_overlap: dict[str, Projection] = field(default_factory=dict)
    """Per profile, every modelled op added to compute (an upper bound on overlap's gain)."""
    projection_model: str | None = None
    """How `projected` was modelled, e.g. "gloo collectives, overlap-aware"."""
    projected_robust: dict[str, Projection] = field(default_factory=dict)
    """Per profile, overlap-aware, robust to load spikes: `projected` with each rank's
    measured compute replaced by its median for the step's kind (bench/network/timeline.py
    `robust_projection`; one-off costs, e.g. warm-up compile, left out). Its compute_s
    is the medians' on its own timeline (per profile: the rank ending each stretch)."""
    compute_per_step: dict | None = None
    """Measured compute seconds per step, by step kind (bench/network/timeline.py
    `step_kind`: the step's training traffic, and whether it read a batch): {kind: {steps, median_s,
    p10_s, p90_s, mean_s}}, each a list over ranks (None where a rank had no such
    step). The spread behind `projected` (mean) and `projected_robust` (median)."""
    projection_s_total: float | None = None
    """Harness seconds spent projecting (bench/run/meter.py, Projection cost): per rank, its
    seconds in `StepClock.add` (every step's records priced on every profile and overlap
    mode) and in `settle`'s own work (its reductions left out), summed over the run; the
    maximum over ranks. Outside the timed steps and off the clock (wall_s)."""
    projection_s_per_step: float | None = None
    """projection_s_total / steps: what projecting adds to each step on the host."""
    ranks_per_node: int | None = None
    """Ranks per node the projections tiered the links with (`network.ranks_per_node`, or
    the launcher's local size)."""
    compute_clock: str | None = None
    """What every compute figure of the run was measured on (bench/run/meter.py, Compute clock):
    `thread_cpu` (a CPU rank's own thread's CPU time: torch on one thread) or `wall` (step
    seconds minus exposed communication: CUDA, and CPU ranks with cores of their own).
    None in records made before it was recorded (they are `wall`)."""
    ranks_per_core: float | None = None
    """CPU devices: this node's ranks over the cores they may use (bench/env.py). Above 1
    the ranks wait for cores: measured wall times (wall_s, throughput, comm_s) hold those
    waits; projections stay contention-free only on a CPU-time `compute_clock`."""
    optim: dict | None = None
    """The optimizer(s), their parameter groups and the delay settings (bench/optim.py)."""
    num_params: int | None = None
    flops_per_token: int | None = None
    device: str | None = None
    backend: str | None = None
    data: dict | None = None
    """The corpus's metadata (name, tokenizer, token counts)."""
    mfu: float | None = None
    """Model FLOPs utilisation in the steady state (warm-up left out), against the peak of
    the GPU model for the run's precision (bench/env.py `peak_flops`; known GPUs only)."""
    bubble_fraction_measured: float | None = None
    """Idle (point-to-point wait) seconds over step seconds, summed over ranks: a
    pipeline's measured bubble (0 for data-parallel strategies)."""
    bubble_fraction_theory: float | None = None
    """A pipeline schedule's (S-1)/(M+S-1) (interleaved: (S-1)/(V*M+S-1); 2BW: 0)."""
    peak_memory_bytes: int | None = None
    """Max over ranks of peak memory since the model's build began (CUDA
    max_memory_allocated; CPU: peak RSS, the interpreter and torch included)."""
    peak_memory_bytes_per_rank: list[int] | None = None
    """Each rank's peak memory, as `peak_memory_bytes`."""
    peak_memory_above_start_bytes_per_rank: list[int] | None = None
    """Each rank's peak minus what it held before the model was built (CPU: without the
    interpreter, torch and the data): what `memory_estimate_bytes_per_rank` estimates."""
    memory_estimate_bytes_per_rank: list[int] | None = None
    """Each rank's memory plan before launch (bench/memory.py)."""
    memory_estimate_terms: dict[str, int] | None = None
    """The plan's terms (bytes) of the rank with the largest estimate."""
    peak_memory_bytes_per_stage: list[int] | None = None
    """Pipelines: per stage, the max over replicas of peak memory."""
    activation_bytes_per_boundary: list[dict[str, int]] | None = None
    """Pipelines: per stage boundary, p2p bytes sent per step and replica
    ({"forward": activations, "backward": gradients})."""
    config_hash: str | None = None
    error: str | None = None
    eval: dict[str, float] | None = None
    """lm-eval's key numbers {"task/metric": value} (eval/runner.py)."""

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        extra = record.pop("final_val_loss_extra")
        wall, steady_s = self.wall_s, self.wall_s - self.warmup_s
        record.update(
            throughput_tokens_per_s=(self.total_tokens - self.warmup_tokens) / steady_s
            if steady_s > 0 else None,
            comm_share=self.comm_s_total / wall if wall > 0 else None,
            comm_bytes_per_rank=int(self.comm_bytes_total) // max(1, self.world_size),
            comm_wire_bytes_per_rank=(None if self.comm_wire_bytes_total is None else
                                      int(self.comm_wire_bytes_total) // max(1, self.world_size)),
            **{f"final_val_loss_{name}": value for name, value in extra.items()},
        )
        for key in _LEFT_OUT_WHEN_NONE:
            if record[key] is None:
                del record[key]
        return record


_LEFT_OUT_WHEN_NONE = ("time_to_target_steady_s", "compute_per_step",
                       "projection_s_total", "projection_s_per_step",
                       "ranks_per_node", "compute_clock", "ranks_per_core", "num_params",
                       "flops_per_token", "device",
                       "backend", "data", "mfu",
                       "config_hash", "error", "eval", "comm_wire_bytes_total",
                       "comm_wire_bytes_per_rank", "projection_model", "optim",
                       "bubble_fraction_measured", "bubble_fraction_theory",
                       "peak_memory_bytes", "peak_memory_bytes_per_stage",
                       "peak_memory_bytes_per_rank", "peak_memory_above_start_bytes_per_rank",
                       "memory_estimate_bytes_per_rank", "memory_estimate_terms",
                       "activation_bytes_per_boundary", "val_set", "comm_peak_sync_bytes",
                       "comm_peak_sync_wire_bytes", "comm_bytes_series")


def running_header(run_name: str, config_hash: str, strategy: str, world_size: int,
                   **more: Any) -> dict[str, Any]:
    """The summary fields known before training starts (status running, or failed early)."""
    return {"status": "running", "run_name": run_name, "config_hash": config_hash,
            "strategy": strategy, "world_size": world_size, **more}


# ------------------------------------------------------------------- metrics.jsonl rows


def train_row(step: int, tokens: int, elapsed_s: float, projected_elapsed_s: dict[str, float],
              lr: float, loss: float, step_s: float, compute_s: float, comm_s: float,
              comm_bytes: float, **extras: float) -> dict[str, Any]:
    """A training row: means over ranks and over the steps since the previous row (loss,
    step_s, compute_s, comm_s, comm_bytes), the clock and tokens at `step` (as in
    `Summary`), and the strategy's scalars (`extras`)."""
    return {"step": step, "tokens": tokens, "elapsed_s": elapsed_s,
            "projected_elapsed_s": dict(projected_elapsed_s), "lr": lr, "loss": loss,
            "step_s": step_s, "compute_s": compute_s, "comm_s": comm_s,
            "comm_bytes": comm_bytes, **extras}


def val_row(step: int, tokens: int, elapsed_s: float, projected_elapsed_s: dict[str, float],
            val_loss: float, extra: dict[str, float] | None = None) -> dict[str, Any]:
    """A validation row: val_loss of the eval model, val_loss_NAME of each extra one."""
    return {"step": step, "tokens": tokens, "elapsed_s": elapsed_s,
            "projected_elapsed_s": dict(projected_elapsed_s), "val_loss": val_loss,
            **{f"val_loss_{name}": value for name, value in (extra or {}).items()}}


def progress_line(row: dict, steps: int) -> str:
    """The PROGRESS line a rank prints for a training row (bench/launch/run.py shows it). Its
    tok/s is the rate of the steps since the previous row, not of the whole run so far,
    which carries the warm-up (on an H100, a compiled tiny GPT's line read 2,052 tok/s at
    step 40 of 40 against 139,862 steady: docs/gpu.md)."""
    share = row["comm_s"] / row["step_s"] if row["step_s"] else 0.0
    tokens_per_step = row["tokens"] / row["step"] if row["step"] else 0.0
    tps = tokens_per_step / row["step_s"] if row["step_s"] else 0.0
    return (f"PROGRESS step {row['step']}/{steps} loss {row['loss']:.4f} "
            f"tok/s {tps:,.0f} comm {share:.0%}")


def nonfinite_loss_steps(rows: list[dict]) -> str | None:
    """The steps of metrics rows whose loss or val_loss is a float that is not finite (NaN,
    Infinity), as words ("steps 4, 6"; at most five named), or None: what a run recorded ok
    cannot hold (rows appended after it; the report and `track` warn)."""
    bad = list(dict.fromkeys(row.get("step") for row in rows
                             if any(isinstance(row.get(k), float) and not math.isfinite(row[k])
                                    for k in ("loss", "val_loss"))))
    if not bad:
        return None
    return (f"step{'s' * (len(bad) > 1)} {', '.join(map(str, bad[:5]))}"
            f"{' ...' * (len(bad) > 5)}")
