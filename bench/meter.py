"""What the training loop measures: the step-synchronised clock and the metrics window.

Exercised by every `commbench run`: bench/train.py keeps a `LoopState`, calls the
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

Projected time: for every step, each rank's measured compute plus its
modelled communication on a profile (`bench.network.project` of that step's ledger
records, priced with the collective algorithm of `network.model`). Ranks wait for each
other only where they communicate: the steps are cut into stretches that end at a
COUPLED step (one in which any rank recorded training traffic) or at the settle point,
each stretch takes the MAXIMUM over ranks of its summed seconds, and the projected elapsed
time is the sum over stretches (`coupled_max`). With traffic in every step (DDP) that is
the per-step maximum; with H local steps between outer steps (DiLoCo, GASLoC) it is the
slowest rank's H steps, as on the measured clock, not the sum of per-step maxima (which
over-states local-step methods' compute by the ranks' step-to-step jitter).
The rank that ends a stretch is the projection's timeline there: its compute is the
projection's compute (`LoopState.projected_compute_s`) and the rest of its seconds the
modelled communication, so every projected figure of a run (summary.json's total_s,
step_s, compute_s, comm_s, the rows' projected clock, time to target) prices one
timeline, not the max of each rank's own comm beside another rank's total.
Two projections are kept: overlap-aware (the headline: a DDP bucket's modelled all-reduce
starts when the bucket was ready and only what runs past the end of backward counts; an
op launched in an earlier step, Streaming DiLoCo's overlapped exchange, runs beside the
measured compute of the steps since its launch, `span_window_s`) and no-overlap (every
modelled op added to compute). A strategy with a `critical_path()` (the
pipelines) is priced overlap-aware on its schedule instead (bench/network/pipeline.py:
the schedule replayed on the modelled link), each stage at the compute its own rank
measured in that step, gathered at the settle point (`pipeline_values`); every rank of a
replica then holds the replica's seconds, so the timeline's compute is its first stage's.
Per-step values are buffered and reduced at settle points, so measuring adds no
synchronisation to the steps.

Projection cost. Pricing every step's records on every profile and overlap mode
(`StepClock.add`) and reducing them (`settle`) runs on the host after each step, outside
the timed step and off the clock. It is measured as harness time instead: each rank's
seconds in `add` and in `settle`'s own work (perf_counter; settle's reductions left out,
being mostly the wait for slower ranks), summed over the run (`LoopState.projection_s`);
summary.json's `projection_s_total` is the maximum over ranks and
`projection_s_per_step` that over the steps. It grows with records x profiles
(tests/benchmarks/test_bench_hot_paths.py times `add` at 10^3 and 10^5 records).

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

import hashlib
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist

from algorithms.base import CriticalPath, StepStats
from algorithms.comm import CommLedger, CommRecord
from bench.network import Profile, link_keys, wire_bytes
from bench.network.model import exposed_s, pricer
from bench.network.pipeline import critical_path_inputs, critical_path_time

OVERLAP_MODES = (True, False)
"""Projections kept per profile: overlap-aware (headline), then no-overlap."""

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
        if self.robust_stretches and len(self.robust_stretches) * _stretch_size(
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


def _stretch_size(stretch: tuple) -> int:
    """Numbers in one stretch's content (`stretches`): per rank its kinds, links, others."""
    return sum(2 * len(kinds) + 2 * len(links) + len(others)
               for kinds, links, others in stretch)


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
    """The window's stretches between coupled steps (`coupled_max`'s), each as what every
    rank did in it: per rank its step kinds (id, count) and, per projection column, the
    modelled seconds that are not compute (`other`) and the link of its largest transfer
    (`(d, h)`, critical-path columns: bench/network/pipeline.py) -> how many such
    stretches (`robust_projection` prices them)."""
    step_bytes: list[float] = field(default_factory=list)
    """Per step of the window: the max over ranks of its training traffic's logical bytes."""
    step_wire_bytes: list[float] = field(default_factory=list)
    """The same in modelled wire bytes."""
    projection_s: float = 0.0
    """THIS rank's seconds spent projecting the window (not reduced over ranks):
    `StepClock.add` of its steps and `settle`'s own work, its collectives left out."""


def step_kind(phase_ops: Iterable[tuple[str, str]], reads_batch: bool = True) -> str:
    """The kind of a step, for the robust compute estimate: its training traffic's
    phase:op pairs (a DiLoCo round's last step differs from its inner steps), and whether
    the rank consumed a batch (an idle GASLoC worker, a pipeline's later stages do not).
    bench/whatif names its modelled steps with the same words."""
    pairs = "+".join(sorted({f"{phase}:{op}" for phase, op in phase_ops})) or "no traffic"
    return pairs if reads_batch else f"no batch, {pairs}"


def kind_id(kind: str) -> float:
    """A step kind as a float every rank computes alike (48 bits of its sha256: exact in
    float64), to gather kinds with the projected values."""
    return float(int(hashlib.sha256(kind.encode()).hexdigest()[:12], 16))


class LinkClock:
    """When this rank last used each connection, on one profile's projected clock (for TCP
    slow start after idle: bench/network/costs.py `slow_start_extra_s`)."""

    def __init__(self):
        self.now = 0.0
        self.last: dict[tuple, float] = {}
        self.ramped: set[tuple] = set()
        """Connections an earlier record of the current step has already used."""

    def idle(self, key: tuple) -> float:
        """Seconds since the connection was last used at the end of a step (inf: never);
        0 once a record of this step has used it (its window has ramped up)."""
        if key in self.ramped:
            return 0.0
        return self.now - self.last.get(key, -math.inf)

    def use(self, keys: list[tuple]) -> None:
        """A record on these connections (`link_keys`) has been priced: later records of
        this step find them warm."""
        self.ramped.update(keys)

    def advance(self, step_s: float) -> None:
        """The step took `step_s` on this profile; the connections it used are now warm."""
        self.now += step_s
        for key in self.ramped:
            self.last[key] = self.now
        self.ramped.clear()


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


def span_window_s(record: CommRecord, compute_s: float, recent: Sequence[float]) -> float:
    """The compute an op launched `record.launch_step` ran beside, waited for in the step of
    `compute_s` (`recent`: this rank's compute seconds of the steps before it, latest
    last): the whole compute of the steps between, and this step's compute before the
    wait (all of it but `record.tail_s`). Only compute: the other traffic of those steps
    is priced on its own, never as hiding this op (they may share its link)."""
    between = record.step - record.launch_step - 1
    earlier = sum(recent[len(recent) - between:]) if between > 0 else 0.0
    return earlier + max(0.0, compute_s - (record.tail_s or 0.0))


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
        self.profiles, self.rank, self.ranks_per_node = profiles, rank, ranks_per_node
        self.num_profiles, self.device, self.model = len(profiles), device, model
        self.num_steps, self.step_s, self.tokens = 0, 0.0, 0
        self.projected: list[float] = []  # num_profiles values per pending step
        self.robust: list[float] = []  # per pending step: kind, compute, (d, h, other) each
        self.coupled: list[float] = []  # per pending step: 1 if it recorded training traffic
        self.sent: list[float] = []  # per pending step: logical bytes, wire bytes
        self.projection_s = 0.0  # this rank's seconds in add since the last settle
        self.links = {name: LinkClock() for name in profiles}
        """Per profile: when each connection was last used (lives for the whole run)."""
        self.pricers = {name: pricer(profile, rank, ranks_per_node, backend=model,
                                     idle=self.links[name].idle)
                        for name, profile in profiles.items()}
        """Per profile: record -> modelled seconds (caches each group's tiers)."""
        self.warm = {name: pricer(profile, rank, ranks_per_node, backend=model)
                     for name, profile in profiles.items()} if critical_path else {}
        """Per profile, a pipeline's: its critical path's prices, on warm connections."""

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

        kind = step_kind(((r.phase, r.op) for r in step_records), stats.tokens > 0)
        if samples is not None:
            samples.setdefault(kind, []).append(compute_s)
        keys = [link_keys(r) for r in step_records]
        modelled: dict[bool, dict[str, float]] = {True: {}, False: {}}  # overlap -> name ->
        inputs = {}  # (overlap, name) -> (d, h, other): the step's pricing beside compute
        for name in self.profiles:  # this rank's modelled step seconds
            costs = []  # each record priced once, in order: slow start once per connection
            for r, k in zip(step_records, keys, strict=True):
                costs.append(self.pricers[name](r))
                self.links[name].use(k)
            inputs[True, name] = self.overlap_inputs(step_records, costs, name, window)
            inputs[False, name] = (0.0, 0.0, sum(costs))
            modelled[True][name] = self.step_time(compute_s, *inputs[True, name])
            modelled[False][name] = compute_s + sum(costs)
        columns = [(overlap, name) for overlap in OVERLAP_MODES for name in self.profiles]
        self.projected.extend(modelled[overlap][name] for overlap, name in columns)
        self.robust.extend([kind_id(kind), compute_s,
                            *(x for column in columns for x in inputs[column])])
        for name, links in self.links.items():
            links.advance(modelled[True][name])
        self.coupled.append(1.0 if step_records else 0.0)
        self.sent += [float(sum(r.nbytes for r in step_records)),
                      float(sum(wire_bytes(r, backend=self.model) for r in step_records))]
        recent.append(compute_s)
        del recent[:-COMPUTE_HISTORY]
        self.num_steps += 1
        self.projection_s += time.perf_counter() - start

    def overlap_inputs(self, records: list[CommRecord], costs: list[float], name: str,
                       window: Callable[[CommRecord], float] | None = None
                       ) -> tuple[float, float, float]:
        """(d, h, other) of this rank's overlap-aware step on profile `name`: the exposed part
        of the records' modelled seconds `costs` (d = h = 0; `window`: an op that spans
        steps ran beside that much compute), or, with a critical path, the link of its
        largest transfer and the rest (bench/network/pipeline.py)."""
        if self.critical_path is not None:
            return critical_path_inputs(records, self.warm[name])
        return 0.0, 0.0, exposed_s(records, costs, window)

    def step_time(self, compute_s: float, d: float, h: float, other: float) -> float:
        """The overlap-aware step from its compute and `overlap_inputs`."""
        if self.critical_path is None:
            return compute_s + other
        return critical_path_time(compute_s, d, h, other, self.critical_path)

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
        if self.critical_path is not None:  # each stage at its own rank's compute
            values = pipeline_values(values, robust, self.critical_path, self.num_profiles)
        totals, compute = (x.tolist() for x in coupled_max(values, coupled, robust[:, :, 1]))
        overlap, no_overlap, compute_overlap, compute_no_overlap = (
            {name: column[offset + i] for i, name in enumerate(self.profiles)}
            for column in (totals, compute) for offset in (0, self.num_profiles))
        found = stretches(robust, coupled, width)
        projection_s = self.projection_s + (before_gather - start
                                            + time.perf_counter() - after_gather)
        self.num_steps, self.step_s, self.tokens, self.projection_s = 0, 0.0, 0, 0.0
        self.projected, self.coupled, self.robust, self.sent = [], [], [], []
        return Settled(step_s, int(tokens), overlap, no_overlap, compute_overlap,
                       compute_no_overlap, found, sent[:, 0].tolist(), sent[:, 1].tolist(),
                       projection_s)


def stretches(robust: torch.Tensor, coupled: torch.Tensor, width: int) -> dict:
    """The window's stretches (cut as `coupled_max` cuts them) by content -> count.

    `robust` [ranks, steps, 2 + 3 * width]: per step the kind id, the compute, then
    (d, h, other) per projection column. A stretch's content, per rank: its kinds with
    their counts, and per column the link of the largest transfer, (d, h), and the summed
    other (rounded to 1 ns, so that equal stretches meet)."""
    out: dict = {}
    ranks, steps = robust.shape[0], robust.shape[1]
    start = 0
    for step in range(steps):
        if not (bool(coupled[step]) or step == steps - 1):
            continue
        part = robust[:, start:step + 1]
        content = []
        for r in range(ranks):
            kinds: dict[float, int] = {}
            for kid in part[r, :, 0].tolist():
                kinds[kid] = kinds.get(kid, 0) + 1
            triples = part[r, :, 2:].reshape(part.shape[1], width, 3)  # width 0: no profiles
            largest = triples[:, :, 0].argmax(dim=0)  # per column: the step of largest d
            links = triples[largest, torch.arange(width), :2].tolist()
            others = triples[:, :, 2].sum(dim=0).tolist()
            content.append((tuple(sorted(kinds.items())),
                            tuple((round(d, 9), round(h, 9)) for d, h in links),
                            tuple(round(o, 9) for o in others)))
        key = tuple(content)
        out[key] = out.get(key, 0) + 1
        start = step + 1
    return out


def coupled_max(values: torch.Tensor, coupled: torch.Tensor,
                compute: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Projected seconds of a settle window, and the compute inside them: `values`
    [ranks, steps, k] per-step seconds (compute + modelled comm), `compute` [ranks, steps]
    the measured compute in them, `coupled` [steps] bool (the ranks wait for each other in
    that step). The steps are cut into stretches ending at each coupled step and at the
    last step; the rank whose summed seconds are largest ends the stretch (the lowest
    rank on a tie) and is the projection's timeline there. Returns ([k] totals, [k]
    compute): the sum over stretches of that rank's summed seconds, and of its compute,
    so that total - compute is the same timeline's modelled communication (not another
    rank's, whose compute differs: a pipeline's stages, a straggler)."""
    ranks, k = values.shape[0], values.shape[2]
    total = torch.zeros(k, dtype=values.dtype)
    timeline = torch.zeros(k, dtype=values.dtype)
    stretch = torch.zeros(ranks, k, dtype=values.dtype)
    own = torch.zeros(ranks, dtype=values.dtype)
    last = values.shape[1] - 1
    for step in range(values.shape[1]):
        stretch += values[:, step]
        own += compute[:, step]
        if bool(coupled[step]) or step == last:
            slowest, ends = stretch.max(dim=0)  # [k]: the first maximal rank on a tie
            total += slowest
            timeline += own[ends]
            stretch.zero_()
            own.zero_()
    return total, timeline


def pipeline_step_s(compute: Sequence[float], links: Sequence[tuple[float, float]],
                    others: Sequence[float], path: CriticalPath) -> list[float]:
    """Every rank's projected seconds of a pipeline step (`bench/network/pipeline.py`):
    each replica's schedule replayed with each stage's own compute (`compute[rank]`), the
    link (d, h) of its ranks' largest transfer and the largest of their `others`, the
    replica's seconds given to each of its ranks. Ranks are laid out replica-major,
    rank = replica * num_stages + stage (algorithms/pipeline_base.py `make_grid`; the
    DeepSpeed engine's topology is built to match)."""
    ranks, stages = len(compute), path.num_stages
    if ranks % stages:
        raise ValueError(f"pipeline projection: {ranks} ranks is not a whole number of "
                         f"{stages}-stage replicas")
    out: list[float] = []
    for first in range(0, ranks, stages):
        replica = range(first, first + stages)
        d, h = max((links[r] for r in replica), key=lambda link: link[0])
        seconds = critical_path_time([compute[r] for r in replica], d, h,
                                     max(others[r] for r in replica), path)
        out += [seconds] * stages
    return out


def pipeline_values(values: torch.Tensor, robust: torch.Tensor, path: CriticalPath,
                    columns: int) -> torch.Tensor:
    """`values` [ranks, steps, k] with its first `columns` columns (the overlap-aware ones)
    priced by `pipeline_step_s` from `robust` [ranks, steps, 2 + 3 * width] (per step:
    kind, compute, then (d, h, other) per column)."""
    values = values.clone()
    for step in range(values.shape[1]):
        compute = robust[:, step, 1].tolist()
        for c in range(columns):
            triples = robust[:, step, 2 + 3 * c:5 + 3 * c].tolist()
            values[:, step, c] = torch.tensor(pipeline_step_s(
                compute, [(d, h) for d, h, _ in triples], [o for _, _, o in triples], path),
                dtype=values.dtype)
    return values


def compute_stats(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per step kind: how many steps, and the median, 10th and 90th percentile and mean of
    their compute seconds (one rank's `LoopState.compute_samples`)."""
    out = {}
    for kind, values in samples.items():
        deciles = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
        out[kind] = {"steps": len(values), "median_s": statistics.median(values),
                     "p10_s": deciles[0], "p90_s": deciles[-1],
                     "mean_s": statistics.fmean(values)}
    return out


def robust_projection(stretches: dict, medians: list[dict[str, float]], width: int,
                      critical_path: CriticalPath | None = None,
                      path_columns: int = 0) -> tuple[list[float], list[float]]:
    """(seconds, compute seconds) per projection column of the run with every rank's
    compute replaced by its median for the step's kind (`medians[rank][kind]`): the same
    stretches, ranks and modelled communication as the projection, so a load spike on a
    shared machine moves the median, not the total. As in `coupled_max`, a column's
    compute is that of the rank ending each stretch (the lowest rank on a tie). The first
    `path_columns` columns price a pipeline step on its critical path."""
    by_id = [{kind_id(k): m for k, m in rank.items()} for rank in medians]
    totals, compute = [0.0] * width, [0.0] * width
    for content, count in stretches.items():
        own = [sum(n * by_id[r][kid] for kid, n in kinds)
               for r, (kinds, _, _) in enumerate(content)]
        for c in range(width):
            if critical_path is not None and c < path_columns:
                seconds = pipeline_step_s(own, [links[c] for _, links, _ in content],
                                          [others[c] for _, _, others in content],
                                          critical_path)
            else:
                seconds = [own[r] + others[c] for r, (_, _, others) in enumerate(content)]
            ends = seconds.index(max(seconds))
            totals[c] += count * seconds[ends]
            compute[c] += count * own[ends]
    return totals, compute


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
    """End-of-run communication totals (bench/meter.py `run_totals`)."""

    logical_bytes: int
    """Logical payload bytes of training traffic, summed over ranks."""
    wire_bytes: int
    """Modelled bytes on the wire (network.model's algorithm), summed over ranks."""
    comm_rows: list[dict]
    """Every rank's ledger aggregates (comm.jsonl rows, tagged with the rank)."""


def run_totals(ledger: CommLedger, device: torch.device, model: str | None = None) -> RunTotals:
    """At the end of a run (a collective over all ranks), from the ledger's aggregates (a
    row's wire bytes are its bytes times its op's factor: `wire_bytes` is linear in them)."""
    rows = ledger.aggregate()
    train = [row for row in rows if row["phase"] in TRAIN_PHASES]
    nbytes, wire = all_reduce_floats([
        sum(row["bytes"] for row in train),
        sum(wire_bytes(_as_record(row), backend=model) for row in train)], device)
    aggregates = [None] * dist.get_world_size()
    dist.all_gather_object(aggregates, rows)
    rows = [{"rank": r, **row} for r, agg in enumerate(aggregates) for row in agg]
    return RunTotals(int(nbytes), int(wire), rows)


def _as_record(row: dict) -> CommRecord:
    """An aggregate row as one record carrying all its bytes (for `wire_bytes`)."""
    return CommRecord(step=0, phase=row["phase"], op=row["op"], group_size=row["group_size"],
                      peers=None, nbytes=row["bytes"], seconds=row["seconds"], tier=row["tier"])
