"""The pricing engine of a timeline of steps: one rank's steps priced on every profile
(`StepPricer`), the ranks' steps cut into stretches (`coupled_max`, `stretches`), a
pipeline's replicas replayed (`pipeline_step_s`, `pipeline_values`), and the noise-robust
projection (`robust_projection`).

    pytest tests/test_loop_measures.py tests/test_projection_consistency.py

Used by the loop's clock (bench/run/meter.py `StepClock`) on a run's ledger records and by
the what-if (bench/study/whatif/engine.py) on a strategy's traffic description: one model.

Projected time: for every step, each rank's measured compute plus its modelled
communication on a profile (that step's ledger records priced by
`bench.network.model.pricer` with the collective algorithm of `network.model`). Ranks
wait for each other only where they communicate: the steps are cut into stretches that
end at a COUPLED step (one in which any rank recorded training traffic) or at the settle
point, each stretch takes the MAXIMUM over ranks of its summed seconds, and the projected
elapsed time is the sum over stretches (`coupled_max`). With traffic in every step (DDP)
that is the per-step maximum; with H local steps between outer steps (DiLoCo, GASLoC) it
is the slowest rank's H steps, as on the measured clock, not the sum of per-step maxima
(which over-states local-step methods' compute by the ranks' step-to-step jitter).
The rank that ends a stretch is the projection's timeline there: its compute is the
projection's compute (`LoopState.projected_compute_s`) and the rest of its seconds the
modelled communication, so every projected figure of a run (summary.json's total_s,
step_s, compute_s, comm_s, the rows' projected clock, time to target) prices one
timeline, not the max of each rank's own comm beside another rank's total.
Two projections are kept (`OVERLAP_MODES`): overlap-aware (the headline: a DDP bucket's
modelled all-reduce starts when the bucket was ready and only what runs past the end of
backward counts; an op launched in an earlier step, Streaming DiLoCo's overlapped
exchange, runs beside the measured compute of the steps since its launch,
`span_window_s`) and no-overlap (every modelled op added to compute). A strategy with a
`critical_path()` (the pipelines) is priced overlap-aware on its schedule instead
(bench/network/pipeline.py: the schedule replayed on the modelled link), each stage at
the compute its own rank measured in that step, gathered at the settle point
(`pipeline_values`); every rank of a replica then holds the replica's seconds, so the
timeline's compute is its first stage's.

Cost (harness time, bench/run/meter.py Projection cost). A step's pricing depends on its
records' content and, on a profile with TCP slow start, on how long each connection had
been idle; a step identical in both to an earlier one is priced once (`StepPricer`:
DDP's buckets are the same every step). A pipeline's replay runs as straight-line code
(bench/network/pipeline.py `compiled`), at settle every replica, step and profile of
the window at once; at `add` only on profiles whose link clocks can pay slow start (the
others' overlap-aware values are the settle point's replay).
"""

from __future__ import annotations

import functools
import hashlib
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from operator import attrgetter

import numpy as np
import torch

from algorithms.contract import CriticalPath
from algorithms.ledger import CommRecord
from bench.network.costs import wire_bytes
from bench.network.model import exposed_s, link_keys, pricer
from bench.network.pipeline import (
    critical_path_inputs,
    critical_path_time,
    critical_path_times,
)
from bench.network.profiles import Profile

OVERLAP_MODES = (True, False)
"""Projections kept per profile: overlap-aware (headline), then no-overlap."""


def step_kind(phase_ops: Iterable[tuple[str, str]], reads_batch: bool = True) -> str:
    """The kind of a step, for the robust compute estimate: its training traffic's
    phase:op pairs (a DiLoCo round's last step differs from its inner steps), and whether
    the rank consumed a batch (an idle GASLoC worker, a pipeline's later stages do not).
    bench/study/whatif names its modelled steps with the same words."""
    pairs = "+".join(sorted({f"{phase}:{op}" for phase, op in phase_ops})) or "no traffic"
    return pairs if reads_batch else f"no batch, {pairs}"


@functools.lru_cache(maxsize=1024)
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

    def use(self, keys: Sequence[tuple]) -> None:
        """A record on these connections (`link_keys`) has been priced: later records of
        this step find them warm."""
        self.ramped.update(keys)

    def advance(self, step_s: float) -> None:
        """The step took `step_s` on this profile; the connections it used are now warm."""
        self.now += step_s
        for key in self.ramped:
            self.last[key] = self.now
        self.ramped.clear()


def span_window_s(record: CommRecord, compute_s: float, recent: Sequence[float]) -> float:
    """The compute an op launched `record.launch_step` ran beside, waited for in the step of
    `compute_s` (`recent`: this rank's compute seconds of the steps before it, latest
    last): the whole compute of the steps between, and this step's compute before the
    wait (all of it but `record.tail_s`). Only compute: the other traffic of those steps
    is priced on its own, never as hiding this op (they may share its link)."""
    between = record.step - record.launch_step - 1
    earlier = sum(recent[len(recent) - between:]) if between > 0 else 0.0
    return earlier + max(0.0, compute_s - (record.tail_s or 0.0))


def step_time(compute_s: float, d: float, h: float, other: float,
              path: CriticalPath | None) -> float:
    """The overlap-aware step from its compute and its (d, h, other) (`StepPricer`): the
    exposed seconds added to compute, or the critical path replayed."""
    if path is None:
        return compute_s + other
    return critical_path_time(compute_s, d, h, other, path)


def has_slow_start(profile: Profile) -> bool:
    """Whether any tier of `profile` pays TCP slow start after idle (its link clocks
    matter); on the others a record's price does not depend on when it runs."""
    tiers = [profile.intra, profile.inter, *(t for _, t in profile.overrides),
             *(t for row in profile.links or () for t in row)]
    return any(t.tcp_initial_window_B is not None for t in tiers)


PRICED_FIELDS = ("phase", "op", "group_size", "peers", "nbytes", "lead_s", "peer_nbytes")
"""What a record's price depends on in a step without ops that span steps (`StepPricer`'s
cache key): not its `seconds` (measured), `tier` (the links are re-derived from the
ranks) nor `tail_s` (only with a `launch_step`); its `step` only through which records
share one (`_STEP`: one step, no `launch_step`)."""
assert {f.name for f in fields(CommRecord)} == {*PRICED_FIELDS, "step", "launch_step",
                                                "seconds", "tier", "tail_s"}, \
    "a CommRecord field StepPricer's cache key does not know: is it priced?"
_CONTENT, _STEP = attrgetter(*PRICED_FIELDS), attrgetter("step", "launch_step")
CACHE_LIMIT = 256
"""Distinct step contents (and idle states of one content) a StepPricer keeps."""


@dataclass
class PricedStep:
    """One step of one rank on every profile."""

    kind: str
    """`step_kind`."""
    values: list[float]
    """Modelled seconds per column (`OVERLAP_MODES` x profiles; a pipeline's overlap-aware
    ones NaN where `StepPricer` leaves them to the settle point's replay)."""
    inputs: list[float]
    """(d, h, other) per column, flat: what the step's time is beside its compute."""
    nbytes: float
    """Logical bytes of its records."""
    wire_bytes: float


@dataclass
class _Content:
    """What a step's records make of it on every profile, whatever its compute."""

    kind: str
    nbytes: float
    wire_bytes: float
    keys: list[list[tuple]]
    """Each record's connections (`link_keys`)."""
    used: tuple[tuple, ...]
    """Every connection the step uses, in order of first use."""
    priced: dict[tuple, tuple] = field(default_factory=dict)
    """(profile, each used connection's idle seconds) -> (sum of the records' seconds,
    the overlap-aware (d, h, other))."""


class StepPricer:
    """One rank's steps, one after the other, priced on every profile overlap-aware and
    not (the module docstring); the link clocks carry slow start from step to step."""

    def __init__(self, profiles: dict[str, Profile], rank: int, ranks_per_node: int,
                 backend: str | None = None, critical_path: CriticalPath | None = None):
        self.names, self.backend, self.critical_path = list(profiles), backend, critical_path
        self.links = {name: LinkClock() for name, profile in profiles.items()
                      if has_slow_start(profile)}
        """Per profile that can pay slow start: when each connection was last used."""
        self.pricers = {name: pricer(profile, rank, ranks_per_node, backend=backend,
                                     idle=self.links[name].idle if name in self.links else 0.0)
                        for name, profile in profiles.items()}
        """Per profile: record -> modelled seconds (caches each group's tiers)."""
        self.warm = {name: pricer(profile, rank, ranks_per_node, backend=backend)
                     for name, profile in profiles.items()} if critical_path else {}
        """Per profile, a pipeline's: its critical path's prices, on warm connections."""
        self.cache: dict[tuple, _Content] = {}

    def price(self, records: list[CommRecord], compute_s: float, reads_batch: bool,
              window: Callable[[CommRecord], float]) -> PricedStep:
        """The step of `records` beside `compute_s`; `window`: the compute an op that spans
        steps ran beside (`span_window_s`). Advances the link clocks."""
        key = self._key(records, reads_batch)
        content = self.cache.get(key) if key is not None else None
        if content is None:
            content = self._content(records, reads_batch)
            if key is not None:
                if len(self.cache) >= CACHE_LIMIT:
                    self.cache.clear()
                self.cache[key] = content
        path, values = self.critical_path, {}
        inputs: dict[tuple[bool, str], tuple[float, float, float]] = {}
        for name in self.names:
            link = self.links.get(name)
            idle = (name, *(link.idle(k) for k in content.used)) if link else (name,)
            priced = content.priced.get(idle) if key is not None else None
            if priced is None:
                priced = self._price(records, content, name, window)
                if key is not None:
                    if len(content.priced) >= CACHE_LIMIT:
                        content.priced.clear()
                    content.priced[idle] = priced
            elif link:
                link.use(content.used)
            inputs[True, name], inputs[False, name] = priced[1], (0.0, 0.0, priced[0])
            values[False, name] = compute_s + priced[0]
            if path is not None and link is None:  # the settle point replays it
                values[True, name] = math.nan
            else:
                values[True, name] = step_time(compute_s, *priced[1], path)
            if link:
                link.advance(values[True, name])
        columns = [(overlap, name) for overlap in OVERLAP_MODES for name in self.names]
        return PricedStep(content.kind, [values[c] for c in columns],
                          [x for c in columns for x in inputs[c]],
                          content.nbytes, content.wire_bytes)

    @staticmethod
    def _key(records: list[CommRecord], reads_batch: bool) -> tuple | None:
        """The step's content, or None when it is priced from more than its records (an op
        that spans steps runs beside earlier steps' compute; records of several steps)."""
        if not records:
            return (reads_batch,)
        steps = set(map(_STEP, records))
        if len(steps) > 1 or next(iter(steps))[1] is not None:
            return None
        return (reads_batch, tuple(map(_CONTENT, records)))

    def _content(self, records: list[CommRecord], reads_batch: bool) -> _Content:
        keys = [link_keys(r) for r in records]
        return _Content(step_kind(((r.phase, r.op) for r in records), reads_batch),
                        float(sum(r.nbytes for r in records)),
                        float(sum(wire_bytes(r, backend=self.backend) for r in records)),
                        keys, tuple(dict.fromkeys(k for ks in keys for k in ks)))

    def _price(self, records: list[CommRecord], content: _Content, name: str,
               window: Callable[[CommRecord], float]) -> tuple[float, tuple]:
        """(sum of the records' seconds, overlap-aware (d, h, other)) on profile `name`,
        each record priced once, in order: slow start once per connection."""
        price, link, costs = self.pricers[name], self.links.get(name), []
        for r, k in zip(records, content.keys, strict=True):
            costs.append(price(r))
            if link:
                link.use(k)
        if self.critical_path is not None:
            return sum(costs), critical_path_inputs(records, self.warm[name])
        return sum(costs), (0.0, 0.0, exposed_s(records, costs, window))


def stretches(robust: torch.Tensor, coupled: torch.Tensor, width: int) -> dict:
    """The window's stretches (cut as `coupled_max` cuts them) by content -> count.

    `robust` [ranks, steps, 2 + 3 * width]: per step the kind id, the compute, then
    (d, h, other) per projection column. A stretch's content, per rank: its kinds with
    their counts, and per column the link of the largest transfer, (d, h) (critical-path
    columns: bench/network/pipeline.py), and the summed other, the modelled seconds that
    are not compute (rounded to 1 ns, so that equal stretches meet)."""
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


def stretch_size(stretch: tuple) -> int:
    """Numbers in one stretch's content (`stretches`): per rank its kinds, links, others."""
    return sum(2 * len(kinds) + 2 * len(links) + len(others)
               for kinds, links, others in stretch)


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


def price_window(values: torch.Tensor, robust: torch.Tensor, coupled: torch.Tensor,
                 path: CriticalPath | None, columns: int) -> tuple[list, list, dict]:
    """A settle window of every rank's priced steps (`StepPricer`'s values [ranks, steps,
    2 x columns], inputs `robust` [ranks, steps, 2 + 3 x 2 x columns], `coupled` [steps]):
    (totals, compute) per column (`coupled_max`, a pipeline's `pipeline_values` first: each
    stage at its own rank's compute) and the window's `stretches`."""
    if path is not None:
        values = pipeline_values(values, robust, path, columns)
    totals, compute = (x.tolist() for x in coupled_max(values, coupled, robust[:, :, 1]))
    return totals, compute, stretches(robust, coupled, len(OVERLAP_MODES) * columns)


def _replicas(ranks: int, path: CriticalPath) -> int:
    if ranks % path.num_stages:
        raise ValueError(f"pipeline projection: {ranks} ranks is not a whole number of "
                         f"{path.num_stages}-stage replicas")
    return ranks // path.num_stages


def pipeline_step_s(compute: Sequence[float], links: Sequence[tuple[float, float]],
                    others: Sequence[float], path: CriticalPath) -> list[float]:
    """Every rank's projected seconds of a pipeline step (`bench/network/pipeline.py`):
    each replica's schedule replayed with each stage's own compute (`compute[rank]`), the
    link (d, h) of its ranks' largest transfer and the largest of their `others`, the
    replica's seconds given to each of its ranks. Ranks are laid out replica-major,
    rank = replica * num_stages + stage (algorithms/pipeline_base.py `make_grid`; the
    DeepSpeed engine's topology is built to match)."""
    ranks, stages = len(compute), path.num_stages
    _replicas(ranks, path)
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
    priced as `pipeline_step_s` prices each step, from `robust` [ranks, steps, 2 + 3 *
    width] (per step: kind, compute, then (d, h, other) per column): every replica, step
    and column replayed at once (`critical_path_times`)."""
    values = values.clone()
    ranks, steps = robust.shape[0], robust.shape[1]
    replicas, stages = _replicas(ranks, path), path.num_stages
    if not steps or not columns:
        return values
    grid = robust.numpy().reshape(replicas, stages, steps, -1)
    computes = grid[:, :, :, 1].transpose(0, 2, 1)  # [replica, step, stage]
    d = grid[:, :, :, 2:2 + 3 * columns:3]  # [replica, stage, step, column]
    largest = d.argmax(axis=1)[:, None]  # the first stage of the largest d
    links = [_pick(grid[:, :, :, 2 + i:2 + 3 * columns:3], largest) for i in (0, 1)]
    other = grid[:, :, :, 4:2 + 3 * columns:3].max(axis=1)  # [replica, step, column]
    lanes = [np.moveaxis(x, -1, 0).reshape(-1) for x in (*links, other)]
    seconds = critical_path_times(
        np.broadcast_to(computes, (columns, *computes.shape)).reshape(-1, stages),
        *lanes, path).reshape(columns, replicas, steps)
    per_rank = torch.from_numpy(np.repeat(seconds, stages, axis=1).transpose(1, 2, 0).copy())
    values[:, :, :columns] = per_rank.to(values.dtype)
    return values


def _pick(x, index):
    """x [replica, stage, step, column] at each replica's, step's, column's stage `index`."""
    return np.take_along_axis(x, index, axis=1)[:, 0]


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


def aggregate_wire_bytes(rows: list[dict], backend: str | None = None) -> float:
    """Modelled wire bytes of ledger aggregate rows (`CommLedger.aggregate`): each row as
    one record carrying all its bytes (`wire_bytes` is linear in them)."""
    return sum(wire_bytes(CommRecord(step=0, phase=row["phase"], op=row["op"],
                                     group_size=row["group_size"], peers=None,
                                     nbytes=row["bytes"], seconds=row["seconds"],
                                     tier=row["tier"]), backend=backend) for row in rows)
