"""What the training loop measures: the step-synchronised clock and the metrics window.

Exercised by every `commbench run`: bench/run/train.py keeps a `LoopState`, calls the
clock's and the window's `add` after each timed step, and `settle`/`flush` at its
metrics rows, validations and checkpoints.

Wall clock under stragglers (docs/architecture.md, "Timing"). Each rank times its own
steps, with the device synchronised before and after. Between two settle points the
ranks run on their own (GASLoC's idle workers, a slow link's late rank) and then meet in
the harness's reductions, where the fast ranks wait, untimed, for the slow one. So the
wall time of the interval is at least the slowest rank's timed steps, and the clock
advances by the MAXIMUM over ranks of the step seconds since the previous settle point
(not by rank 0's). Waits inside a strategy's own collectives are already in the waiting
rank's timed step; validation, metrics and checkpoint time stay outside the clock.

Tokens are the tokens actually consumed: the SUM over ranks of `StepStats.tokens` (an
idle worker reports 0), not the nominal global batch.

Compute clock. A rank's compute in a step is measured on its work clock
(algorithms/clocks.py `work_clock`): on a CPU device its own CPU time over the step (plus
a `run.straggler`'s sleep, which stands for a slower device), so that ranks sharing cores
do not count their waits for a core as compute, nor, through a peer's wait, as
communication; on CUDA step_s - comm_s. summary.json records which (`compute_clock`) and
the ranks per core (`ranks_per_core`); the report marks projections of runs whose
compute is wall time on shared cores.

Projected time: each rank's measured compute plus its modelled communication on a
profile, the steps cut into stretches between those where ranks communicate, each the
slowest rank's; bench/network/timeline.py (the pricing engine) says how.

Projection cost. `StepClock.add` prices a step after it and `settle` reduces the window,
outside the timed steps and off the clock (no synchronisation added): harness time, each
rank's seconds in `add` and `settle`'s own work (its reductions, mostly the wait for
slower ranks, left out) summed over the run (`LoopState.projection_s`); summary.json's
`projection_s_total` is the maximum over ranks, `projection_s_per_step` that over the
steps (tests/benchmarks/test_bench_hot_paths.py times `add` and the settle replay).

Bytes per step. Each step's training traffic is summed per rank (logical payload, and
modelled wire bytes); at each settle point the maximum over ranks of every step joins
`LoopState.bytes_series` (run-length encoded: [first step, steps, bytes, wire bytes]).
`peak_sync_bytes(series)` is the largest bytes any rank sent in one step, i.e. in one
synchronisation (DDP: every step; DiLoCo: a round's end; Streaming DiLoCo: a fragment's
sync, recorded in the step that waited for it), leaving out the run's last step when an
earlier step sent anything: the last step closes every open round at once (DiLoCo's
shorter last round, Streaming DiLoCo's final sync of every fragment), a one-off, not the
rate a link must sustain; the series keeps it.

Warm-up (one-off costs). A process's first steps hold costs a longer run does not pay
again: torch.compile, NCCL communicator creation, kernel autotuning, optimizer-state
allocation. The communicators of every group are created before step 0
(`Communicator.warm_up`, timed, max over ranks) and the first `run.warmup_steps` steps
of each process (a resume warms up again) are settled on their own; both stay on the
clock (what a user waits for) and are also summed into `LoopState.warmup_*`. Throughput,
MFU and projected throughput are steady state: tokens and seconds without the warm-up
ones. Time to target is kept both ways: `time_to_target_s` with the one-off costs,
`time_to_target_steady_s` without (the report says which it shows).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist

from algorithms.contract import CriticalPath, StepStats
from algorithms.ledger import CommLedger, CommRecord
from bench.network import Profile
from bench.network.timeline import (
    OVERLAP_MODES,
    StepPricer,
    aggregate_wire_bytes,
    kind_id,
    price_window,
    span_window_s,
    stretch_size,
)

HARNESS_PHASES = ("eval", "metrics")
"""Ledger phases of the harness's own calls into strategies; every other phase (train,
inner, outer, gossip, dp, tied, clip, ...) is training traffic."""


class TrainingPhases:
    """Every ledger phase but the harness's: `phase in TRAIN_PHASES` is True for training
    traffic whatever phases the algorithms name."""

    def __contains__(self, phase: object) -> bool:
        return phase not in HARNESS_PHASES

    def __repr__(self) -> str:
        return f"TrainingPhases(all but {HARNESS_PHASES})"


TRAIN_PHASES = TrainingPhases()


def all_reduce_floats(values: list[float], device: torch.device,
                      op=dist.ReduceOp.SUM) -> list[float]:
    """`values` reduced element-wise over all ranks (float64), outside the CommLedger."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


@dataclass
class LoopState:
    """What the loop carries from step to step; saved in checkpoints, restored on resume."""

    step: int = 0
    """Steps done."""
    elapsed_s: float = 0.0
    """Step-synchronised wall clock (the module docstring says how)."""
    tokens: int = 0
    """Tokens consumed, summed over ranks."""
    projected_s: dict[str, float] = field(default_factory=dict)
    """Projected elapsed seconds per network profile (overlap-aware)."""
    projected_no_overlap_s: dict[str, float] = field(default_factory=dict)
    """The same without overlap: every modelled op added to compute."""
    projected_compute_s: dict[str, float] = field(default_factory=dict)
    """Per profile: the measured compute inside `projected_s`, on its own timeline (per
    stretch, the compute of the rank that ends it: `coupled_max`); the rest of
    `projected_s` is modelled communication (summary.json's projected compute_s and comm_s
    per step)."""
    projected_compute_no_overlap_s: dict[str, float] = field(default_factory=dict)
    compute_s: float = 0.0
    """This rank's measured compute seconds."""
    comm_s: float = 0.0
    """This rank's exposed communication seconds."""
    idle_s: float = 0.0
    """This rank's seconds waiting on point-to-point traffic (pipelines; in comm_s)."""
    last_val: float | None = None
    best_val: float = math.inf
    extra_val: dict[str, float] = field(default_factory=dict)
    target: dict | None = None
    """Clock, tokens and projected clock at the first validation reaching run.target_loss."""
    status: str = "ok"
    diverged: str | None = None
    """Which rank saw a non-finite loss first, and at which step (when diverged)."""
    warmup_s: float = 0.0
    """One-off seconds on the clock (module docstring, Warm-up): each process's warm-up
    steps and communicator creation; part of `elapsed_s`."""
    warmup_steps: int = 0
    """Steps measured as warm-up (run.warmup_steps per process: a resume warms up again)."""
    warmup_tokens: int = 0
    """Tokens consumed in the warm-up steps."""
    warmup_projected_s: dict[str, float] = field(default_factory=dict)
    """Per profile: the warm-up steps' share of `projected_s`."""
    warmup_projected_no_overlap_s: dict[str, float] = field(default_factory=dict)
    bytes_series: list[list[int]] = field(default_factory=list)
    """Per step, the largest training traffic any rank sent in it, logical payload and
    modelled wire bytes (bench.network.wire_bytes), run-length encoded: [first step
    (1-based), steps, bytes, wire bytes] (module docstring, Bytes per step)."""
    recent_compute_s: list[float] = field(default_factory=list)
    """This rank's measured compute seconds of its last steps (at most `COMPUTE_HISTORY`),
    for ops that span steps (`StepClock`); kept in checkpoints so a resumed run prices the
    exchange in flight across the resume as the uninterrupted one does."""
    compute_samples: dict[str, list[float]] = field(default_factory=dict)
    """This rank's measured compute seconds of every step, by step kind (`step_kind`):
    the noise-robust projection's medians (`robust_projection`)."""
    robust_stretches: dict = field(default_factory=dict)
    """The run's stretches between coupled steps, by content (`Settled.stretches`) ->
    how many: what the robust projection prices with each rank's median compute."""
    stretch_format: int = 3
    """The layout and pricing of `robust_stretches`' contents (`STRETCH_FORMAT`): a
    checkpoint with another is refused on resume (2: a pipeline column's link is its
    (d, h) pair; 3: a pipeline's stages are replayed each at its own rank's compute, so
    the clocks of a format-2 run priced its steps at the slowest rank's)."""
    projection_s: float = 0.0
    """This rank's seconds spent projecting (`StepClock.add` and `settle`'s own work,
    its reductions left out): harness time outside the timed steps and off the clock
    (module docstring, Projection cost)."""
    robust_dropped: bool = False
    """The distinct stretches outgrew ROBUST_RECORD_LIMIT (a long run on many ranks: every
    rank holds and checkpoints them all): the record was dropped and the run has no
    `projected_robust`, rather than a memory that grows with every step."""

    @classmethod
    def restore(cls, saved: dict) -> LoopState:
        """The state a checkpoint saved (`asdict`). A checkpoint from another version, with
        fields this one lacks or without some of its own, is refused: a missing field would
        start from its default at the resume step (a projection's compute from step 0:
        `projected_compute_s`), and the resumed run's figures would not be the
        uninterrupted run's."""
        known = {f.name for f in fields(cls)}
        unknown, missing = sorted(set(saved) - known), sorted(known - set(saved))
        if saved.get("stretch_format", STRETCH_FORMAT) != STRETCH_FORMAT:
            unknown.append(f"stretch_format {saved['stretch_format']}")
        if unknown or missing:
            raise RuntimeError(
                f"resume: the checkpoint's loop state is from another version of commbench "
                f"(fields unknown here: {unknown or 'none'}; missing: {missing or 'none'}); "
                f"its projected figures cannot be continued on the same timeline: start the "
                f"run again without --resume")
        return cls(**saved)

    def advance(self, settled: Settled, warmup_steps: int = 0) -> None:
        """Move the clock, tokens and projected clocks on by what the ranks did together;
        with `warmup_steps` (or `settled` holding no step: communicator creation) the
        window is one-off cost and is also added to the warm-up figures."""
        self.elapsed_s += settled.elapsed_s
        self.tokens += settled.tokens
        self.projection_s += settled.projection_s
        pairs = [(self.projected_s, settled.projected_s),
                 (self.projected_no_overlap_s, settled.projected_no_overlap_s),
                 (self.projected_compute_s, settled.compute_s),
                 (self.projected_compute_no_overlap_s, settled.compute_no_overlap_s)]
        if warmup_steps:
            self.warmup_s += settled.elapsed_s
            self.warmup_steps += warmup_steps
            self.warmup_tokens += settled.tokens
            pairs += [(self.warmup_projected_s, settled.projected_s),
                      (self.warmup_projected_no_overlap_s, settled.projected_no_overlap_s)]
        for mine, theirs in pairs:
            for name, seconds in theirs.items():
                mine[name] = mine.get(name, 0.0) + seconds
        step = self.step - len(settled.step_bytes) + 1
        for sent in zip(settled.step_bytes, settled.step_wire_bytes, strict=True):
            sent = [round(x) for x in sent]
            last = self.bytes_series[-1] if self.bytes_series else None
            if last is not None and last[2:] == sent and last[0] + last[1] == step:
                last[1] += 1
            else:
                self.bytes_series.append([step, 1, *sent])
            step += 1
        if self.robust_dropped:
            return
        for stretch, count in settled.stretches.items():
            self.robust_stretches[stretch] = self.robust_stretches.get(stretch, 0) + count
        if self.robust_stretches and len(self.robust_stretches) * stretch_size(
                next(iter(self.robust_stretches))) > ROBUST_RECORD_LIMIT:
            self.robust_stretches, self.robust_dropped = {}, True

    def add_one_off(self, seconds: float) -> None:
        """One-off seconds outside any step (communicator creation), on the clock as warm-up
        (the projected clocks do not model it)."""
        self.elapsed_s += seconds
        self.warmup_s += seconds

    def steady(self) -> tuple[int, float]:
        """(tokens, seconds) of the steady state: the clock without its one-off costs."""
        return self.tokens - self.warmup_tokens, self.elapsed_s - self.warmup_s


ROBUST_RECORD_LIMIT = 2_000_000
"""Numbers the robust projection's stretch record may hold (`LoopState.robust_stretches`;
~64 MB of Python tuples, on every rank and in every checkpoint). A stretch holds about
3 x projection columns numbers per rank, and with measured overlap nearly every step is a
new stretch: on 2 ranks the record reaches the limit after ~50,000 distinct stretches, on
64 ranks after ~1,700."""


STRETCH_FORMAT = 3
"""`LoopState.stretch_format` of this version."""


@dataclass
class Settled:
    """What the ranks did together since the previous settle point."""

    elapsed_s: float
    """Max over ranks of their timed step seconds."""
    tokens: int
    """Sum over ranks of the tokens consumed."""
    projected_s: dict[str, float]
    """Per profile: sum over stretches between coupled steps of the max over ranks of
    compute + modelled comm (`coupled_max`)."""
    projected_no_overlap_s: dict[str, float]
    compute_s: dict[str, float] = field(default_factory=dict)
    """Per profile: the measured compute inside `projected_s`, sum over stretches of the
    compute of the rank that ends the stretch (`coupled_max`): `projected_s` minus it is
    that timeline's modelled communication."""
    compute_no_overlap_s: dict[str, float] = field(default_factory=dict)
    stretches: dict = field(default_factory=dict)
    """The window's stretches between coupled steps, by what every rank did in them
    (bench/network/timeline.py `stretches`) -> how many (`robust_projection` prices them)."""
    step_bytes: list[float] = field(default_factory=list)
    """Per step of the window: the max over ranks of its training traffic's logical bytes."""
    step_wire_bytes: list[float] = field(default_factory=list)
    """The same in modelled wire bytes."""
    projection_s: float = 0.0
    """THIS rank's seconds spent projecting the window (not reduced over ranks):
    `StepClock.add` of its steps and `settle`'s own work, its collectives left out."""


def peak_sync_bytes(series: list[list[int]]) -> tuple[int, int]:
    """(logical, wire) bytes of the largest step of `LoopState.bytes_series`, the run's last
    step left out when an earlier one sent anything (module docstring, Bytes per step)."""
    if not series:
        return 0, 0
    first, steps, *last_sent = series[-1]
    earlier = [entry[2:] for entry in series[:-1]]
    if steps > 1:
        earlier.append(last_sent)
    if not any(nbytes for nbytes, _ in earlier):
        earlier = [last_sent]
    return max(nbytes for nbytes, _ in earlier), max(wire for _, wire in earlier)


COMPUTE_HISTORY = 1024
"""Steps of compute seconds a StepClock keeps for ops that span steps (an op launched
longer ago than this gets no window for the steps beyond)."""


class StepClock:
    """This rank's timed steps since the last settle point; `settle` reduces them."""

    def __init__(self, profiles: dict[str, Profile], rank: int, ranks_per_node: int,
                 device: torch.device, model: str | None = None,
                 critical_path: CriticalPath | None = None,
                 recent_compute_s: list[float] | None = None):
        """`recent_compute_s`: the list of this rank's last compute seconds to keep up to
        date (`LoopState.recent_compute_s`, so checkpoints carry it)."""
        self.recent_compute_s = [] if recent_compute_s is None else recent_compute_s
        self.critical_path = critical_path
        """Strategy.critical_path(): the overlap-aware projection prices the step on it."""
        self.profiles, self.num_profiles, self.device = profiles, len(profiles), device
        self.num_steps, self.step_s, self.tokens = 0, 0.0, 0
        self.projected: list[float] = []  # num_profiles values per pending step
        self.robust: list[float] = []  # per pending step: kind, compute, (d, h, other) each
        self.coupled: list[float] = []  # per pending step: 1 if it recorded training traffic
        self.sent: list[float] = []  # per pending step: logical bytes, wire bytes
        self.projection_s = 0.0  # this rank's seconds in add since the last settle
        self.pricer = StepPricer(profiles, rank, ranks_per_node, model, critical_path)
        """Prices each step on every profile (its link clocks live for the whole run)."""

    def add(self, step_s: float, stats: StepStats, step_records: list[CommRecord],
            samples: dict[str, list[float]] | None = None,
            compute_s: float | None = None) -> None:
        """One timed step: its seconds, its stats and its training-traffic ledger records.
        `compute_s`: its compute on the rank's work clock (the module docstring's Compute
        clock; None: step_s - stats.comm_s, the wall clock's). `samples`
        (LoopState.compute_samples) receives the step's compute under its kind. Its own
        seconds are harness time (`Settled.projection_s`)."""
        start = time.perf_counter()
        if compute_s is None:
            compute_s = step_s - stats.comm_s
        self.step_s += step_s
        self.tokens += stats.tokens
        recent = self.recent_compute_s

        def window(record: CommRecord) -> float:
            return span_window_s(record, compute_s, recent)

        priced = self.pricer.price(step_records, compute_s, stats.tokens > 0, window)
        if samples is not None:
            samples.setdefault(priced.kind, []).append(compute_s)
        self.projected += priced.values
        self.robust += [kind_id(priced.kind), compute_s, *priced.inputs]
        self.coupled.append(1.0 if step_records else 0.0)
        self.sent += [priced.nbytes, priced.wire_bytes]
        recent.append(compute_s)
        del recent[:-COMPUTE_HISTORY]
        self.num_steps += 1
        self.projection_s += time.perf_counter() - start

    def settle(self) -> Settled:
        """Reduce over ranks (a collective: every rank calls it at the same step). Its own
        work is harness time, with `add`'s (`Settled.projection_s`); its reductions are
        left out (they are mostly the wait for slower ranks, not the projection's cost)."""
        if self.num_steps == 0:  # the same on every rank
            zero = dict.fromkeys(self.profiles, 0.0)
            return Settled(0.0, 0, zero, dict(zero), dict(zero), dict(zero))
        (step_s,) = all_reduce_floats([self.step_s], self.device, dist.ReduceOp.MAX)
        (tokens,) = all_reduce_floats([float(self.tokens)], self.device)
        start = time.perf_counter()
        width, n = len(OVERLAP_MODES) * self.num_profiles, self.num_steps
        mine = torch.tensor([*self.coupled, *self.sent, *self.projected, *self.robust],
                            dtype=torch.float64, device=self.device)
        ranks = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        before_gather = time.perf_counter()
        dist.all_gather(ranks, mine)
        every = torch.stack(ranks).cpu()
        after_gather = time.perf_counter()
        coupled = every[:, :n].amax(dim=0) > 0
        sent = every[:, n:3 * n].reshape(len(ranks), n, 2).amax(dim=0)
        every = every[:, 3 * n:]  # then as without the bytes: projected, robust
        values = every[:, :n * width].reshape(len(ranks), n, width)
        robust = every[:, n * width:].reshape(len(ranks), n, 2 + 3 * width)
        totals, compute, found = price_window(values, robust, coupled, self.critical_path,
                                              self.num_profiles)
        overlap, no_overlap, compute_overlap, compute_no_overlap = (
            {name: column[offset + i] for i, name in enumerate(self.profiles)}
            for column in (totals, compute) for offset in (0, self.num_profiles))
        projection_s = self.projection_s + (before_gather - start
                                            + time.perf_counter() - after_gather)
        self.num_steps, self.step_s, self.tokens, self.projection_s = 0, 0.0, 0, 0.0
        self.projected, self.coupled, self.robust, self.sent = [], [], [], []
        return Settled(step_s, int(tokens), overlap, no_overlap, compute_overlap,
                       compute_no_overlap, found, sent[:, 0].tolist(), sent[:, 1].tolist(),
                       projection_s)


class MetricsWindow:
    """This rank's sums over the steps since the last metrics row; `flush` averages them."""

    def __init__(self):
        self.culprit: str | None = None
        """After a flush that saw a non-finite loss: the first rank(s) and step, in words."""
        self.reset()

    def reset(self) -> None:
        self.num_steps, self.loss, self.step_s, self.comm_s, self.bytes = 0, 0.0, 0.0, 0.0, 0
        self.compute_s = 0.0
        self.nonfinite, self.first_nonfinite = 0, None
        self.losses, self.idle_s = 0, 0.0
        self.extras: dict[str, float] = {}

    def state_dict(self) -> dict:
        """The sums so far: a checkpoint between two rows carries them, so the row after a
        resume averages the same steps, in the same order, as without the stop."""
        return {k: dict(v) if isinstance(v, dict) else v for k, v in vars(self).items()
                if k != "culprit"}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)

    def add(self, stats: StepStats, step_s: float, nbytes: int, step: int = 0,
            compute_s: float | None = None) -> None:
        """One step; `compute_s` as `StepClock.add` takes it (None: step_s - comm_s)."""
        self.num_steps += 1
        self.compute_s += step_s - stats.comm_s if compute_s is None else compute_s
        if stats.loss is not None:  # a pipeline's non-last stages report none
            self.losses += 1
            if math.isfinite(stats.loss):
                self.loss += stats.loss
            else:
                self.nonfinite += 1
                if self.first_nonfinite is None:
                    self.first_nonfinite = step
        self.step_s += step_s
        self.comm_s += stats.comm_s
        self.idle_s += stats.idle_s
        self.bytes += nbytes
        self.extras.update(stats.extras)  # latest value of each algorithm scalar

    def flush(self, device: torch.device, world: int) -> tuple[dict, bool]:
        """(means over ranks and steps, whether any rank saw a non-finite loss). The loss
        averages only the losses ranks reported; `bubble_fraction` is the ranks' idle
        (point-to-point wait) seconds over their step seconds."""
        sums = all_reduce_floats([self.loss, self.step_s, self.comm_s, self.bytes,
                                  self.nonfinite, self.losses, self.idle_s, self.compute_s],
                                 device)
        n = self.num_steps * world
        finite = sums[5] - sums[4]
        row = {
            "loss": sums[0] / finite if finite else float("nan"),
            "step_s": sums[1] / n,
            "compute_s": sums[7] / n,
            "comm_s": sums[2] / n,
            "comm_bytes": sums[3] / n,
            "idle_s": sums[6] / n,
            "bubble_fraction": sums[6] / sums[1] if sums[1] else 0.0,
            **self.extras,
        }
        if sums[4]:  # the same on every rank: which rank went non-finite first?
            self.culprit = self._culprit(device, world)
        self.reset()
        return row, bool(sums[4])

    def _culprit(self, device: torch.device, world: int) -> str:
        firsts = [0.0] * world  # rank -> 1 + its first non-finite step (0: none)
        if self.first_nonfinite is not None:
            firsts[dist.get_rank()] = 1.0 + self.first_nonfinite
        firsts = all_reduce_floats(firsts, device)
        seen = {r: int(s) - 1 for r, s in enumerate(firsts) if s}
        step = min(seen.values())
        first = [r for r, s in seen.items() if s == step]
        text = f"non-finite loss first on rank {', '.join(map(str, first))} at step {step}"
        later = [r for r in seen if r not in first]
        return text + (f" (then on rank {', '.join(map(str, later))})" if later else "")


@dataclass
class RunTotals:
    """End-of-run communication totals (bench/run/meter.py `run_totals`)."""

    logical_bytes: int
    """Logical payload bytes of training traffic, summed over ranks."""
    wire_bytes: int
    """Modelled bytes on the wire (network.model's algorithm), summed over ranks."""
    comm_rows: list[dict]
    """Every rank's ledger aggregates (comm.jsonl rows, tagged with the rank)."""


def run_totals(ledger: CommLedger, device: torch.device, model: str | None = None) -> RunTotals:
    """At the end of a run (a collective over all ranks), from the ledger's aggregates."""
    rows = ledger.aggregate()
    train = [row for row in rows if row["phase"] in TRAIN_PHASES]
    nbytes, wire = all_reduce_floats([sum(row["bytes"] for row in train),
                                      aggregate_wire_bytes(train, model)], device)
    aggregates = [None] * dist.get_world_size()
    dist.all_gather_object(aggregates, rows)
    rows = [{"rank": r, **row} for r, agg in enumerate(aggregates) for row in agg]
    return RunTotals(int(nbytes), int(wire), rows)

