"""The what-if's model: a strategy's traffic description priced on a network profile.

    pytest tests/test_whatif.py

One model with the run projections (the pricing engine, bench/network/timeline.py, that
the loop's `StepClock` prices a run's steps with): each rank's step is its compute plus
its records priced by `bench.network.model.pricer` (TCP slow start on connections idle
past the RTO, through the same `LinkClock`), DDP buckets on the backward timeline
(`exposed_s`), pipelines on their critical path (`step_time`, `pipeline_step_s`); ranks
wait for each other only at steps where one of them communicates (stretches, as
`coupled_max` cuts them). What differs is where the records come from:
here the strategy's own description (`Strategy.traffic`, algorithms/traffic.py)
instead of a run's ledger, and compute from the scenario (bench/study/whatif/scenario.py).

Steady state. A run's steps fall into phases (Pier's lazy start, then rounds) inside
which the traffic repeats every `period` steps (H for local-update methods). A long
phase is priced over two periods aligned on the round grid: the first warms the link
clocks, the second, scaled to the phase's length, is the phase (a phase of L steps
counts L / period periods: a last, shorter round is priced as that fraction of a full
one; the run's last step, where a streaming run syncs every fragment, is not in the
priced period, so those final syncs are left out). A phase of at most two periods after
alignment is priced step by step, as is every step with `exact=True` (a measured run's).
Consecutive identical steps are priced twice (the first may pay slow start) and the second
repeated; ranks whose steps are the same up to the network's symmetry (same ops on
groups of the same shape, on a profile without per-node links) are priced once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from algorithms.contract import CriticalPath
from algorithms.ledger import CommRecord
from algorithms.traffic import ParamFact, Traffic, TrafficFacts, Transfer
from bench.network.costs import COLLECTIVES, canonical_op
from bench.network.model import exposed_s, link_keys, pricer
from bench.network.pipeline import critical_path_inputs
from bench.network.profiles import Profile, Tier
from bench.network.timeline import LinkClock, pipeline_step_s, step_kind, step_time

BACKWARD_SHARE = 2 / 3
"""Share of a step's compute in backward (6N FLOPs per token: 2N forward, 4N backward):
how long DDP's buckets can overlap."""


# ---------------------------------------------------------------------- the model's facts


def traffic_facts(cfg, model=None) -> TrafficFacts:
    """The model of run config `cfg`, measured on the meta device (nothing allocated);
    `model`: that meta model, when the caller has built it."""
    from bench.memory import _meta_model
    from bench.model import TransformerBlock

    model = model if model is not None else _meta_model(cfg)
    layers = model.as_layers()
    layer_of: dict[int, int] = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            layer_of.setdefault(id(p), i)
    params = tuple(ParamFact(tuple(p.shape), i - 1 if isinstance(layers[i], TransformerBlock)
                             else -1, i)
                   for p in model.parameters() for i in [layer_of[id(p)]])
    tied = model.head.tied_parameter() if hasattr(model.head, "tied_parameter") else None
    micro = max(1, cfg.data.batch_size // cfg.parallel.num_microbatches)
    return TrafficFacts(
        params=params, tied_bytes=tied.numel() * 4 if tied is not None else 0,
        tied_layers=(0, len(layers) - 1) if tied is not None else (),
        layer_bytes=tuple(sum(p.numel() * 4 for p in layer.parameters()) for layer in layers),
        boundary_bytes=micro * cfg.model.seq_len * model.cfg.n_embd * 4)


def synthetic_facts(num_params: int, n_layer: int) -> TrafficFacts:
    """A model known only by its size: `n_layer` equal blocks (no root unit, untied)."""
    block = num_params // n_layer
    params = tuple(ParamFact((block,), i, i + 1) for i in range(n_layer))
    return TrafficFacts(params=params, tied_bytes=0,
                        layer_bytes=(0, *(block * 4 for _ in range(n_layer)), 0))


# ---------------------------------------------------------------------- compute


@dataclass(frozen=True)
class Compute:
    """Each rank's compute seconds per step."""

    step_s: float = 0.0
    """A full data-parallel step of one rank (a pipeline stage does its share of it)."""
    measured: list[dict[str, float]] | None = None
    """A measured run's own: per rank, step kind (bench.network.timeline `step_kind`) -> its
    median compute seconds (summary.json `compute_per_step`)."""
    backward_share: float = BACKWARD_SHARE
    speed: Callable[[int], float] | None = None
    """rank -> its speed relative to `step_s` (a straggler: < 1); None: all 1."""

    def seconds(self, rank: int, kind: str, share: float) -> float:
        if self.measured is None:
            return self.step_s * share / (1.0 if self.speed is None else self.speed(rank))
        mine = self.measured[rank]
        if kind not in mine:
            raise ValueError(f"rank {rank}: the run recorded no step of kind {kind!r} "
                             f"(it has {sorted(mine)}): the what-if describes another run")
        return mine[kind]


# ---------------------------------------------------------------------- the plan


@dataclass
class _Run:
    """`count` consecutive steps identical on every rank, from step `first`."""

    first: int
    count: int
    weight: float
    """How many real steps each priced step of this run stands for (steady state)."""
    closes: bool = False
    """Whether ranks meet after its last step whatever the traffic (`plan`'s `cuts`)."""


@dataclass
class Plan:
    """What is priced, whatever the network: per rank class, its steps' records."""

    runs: list[list[_Run]]
    """Per window (a fresh set of link clocks each), its runs of identical steps."""
    classes: list[int]
    """One representative rank per class of ranks priced alike."""
    class_of: list[int]
    """Every rank's representative (a pipeline replica's stages are priced together)."""
    records: dict[tuple[int, int], list[CommRecord]]
    """(rank, step) -> the step's records (for the representatives' priced steps)."""
    overlapped: dict[tuple[int, int], list[float]]
    """(rank, step) -> each record's `overlap_steps` (streaming), 0 for none."""
    compute: dict[tuple[int, int], float]
    critical_path: Callable[[int], CriticalPath] | None
    ranks_per_node: int
    steps: int
    notes: list[str] = field(default_factory=list)


MAX_RANK_STEPS = 500_000
"""The most rank-steps a scenario's `plan` walks (ranks x steps priced: two periods of each
phase): about 10 s. Beyond, a ValueError naming the bound; the world itself is bounded
first (bench/study/whatif/scenario.py MAX_GPUS). A measured run's (`exact`) walks its own steps."""


def plan(traffic: Traffic, compute: Compute, world: int, ranks_per_node: int,
         profile: Profile, exact: bool = False, cuts: frozenset[int] = frozenset()) -> Plan:
    """Which steps and ranks to price (module docstring); `profile` only says whether the
    network is symmetric (its tiers may be swapped later: `with_tier`). `cuts`: step
    counts after which the ranks meet whatever the traffic (a measured run's harness
    settles its clocks there: `measured_whatif`)."""
    windows = []
    for start, stop in traffic.phases:
        if stop <= start:
            continue
        period = max(1, traffic.period)
        first = -(-start // period) * period
        # the scaled period must not hold the phase's last step (its final syncs, e.g. every
        # fragment's, happen once, not once a period): a phase that short is priced whole
        if exact or first + 2 * period >= stop:
            windows.append([(start, stop, 1.0)])
        else:
            windows.append([(first, first + period, 0.0),
                            (first + period, first + 2 * period, (stop - start) / period)])
    rank_steps = world * sum(b - a for window in windows for a, b, _ in window)
    if not exact and rank_steps > MAX_RANK_STEPS:  # a measured run: its own steps
        raise ValueError(f"pricing it walks {world:,} ranks x {rank_steps // world:,} steps "
                         f"(two periods of each phase) = {rank_steps:,} rank-steps; the "
                         f"what-if's bound is {MAX_RANK_STEPS:,} (bench/study/whatif/engine.py "
                         "MAX_RANK_STEPS): fewer GPUs, or a shorter period (inner_steps)")
    runs_per_window, sigs = [], {rank: [] for rank in range(world)}
    step_info: dict[tuple[int, int], tuple] = {}
    for window in windows:
        runs: list[_Run] = []
        for a, b, weight in window:
            previous = None
            for step in range(a, b):
                now = []
                for rank in range(world):
                    transfers = traffic.transfers(rank, step)
                    kind = step_kind(((t.phase, t.op) for t in transfers),
                                     traffic.reads_batch(rank, step))
                    seconds = compute.seconds(rank, kind, traffic.compute_share(rank, step))
                    now.append((tuple(transfers), seconds))
                if (now == previous and runs and runs[-1].weight == weight
                        and not runs[-1].closes):
                    runs[-1].count += 1
                    runs[-1].closes = step + 1 in cuts
                    continue
                previous = now
                runs.append(_Run(step, 1, weight, step + 1 in cuts))
                for rank, info in enumerate(now):
                    step_info[rank, step] = info
        runs_per_window.append(runs)
    symmetric = profile.links is None and not profile.overrides
    for rank in range(world):
        links: dict[tuple, int] = {}
        for runs in runs_per_window:
            for run in runs:
                transfers, seconds = step_info[rank, run.first]
                sigs[rank].append((run.count, seconds, tuple(
                    _shape(t, rank, ranks_per_node, symmetric, links) for t in transfers)))
    classes: dict[tuple, int] = {}
    for rank in range(world):
        classes.setdefault(tuple(sigs[rank]), rank)
    reps = sorted(classes.values())
    class_of = [classes[tuple(sigs[rank])] for rank in range(world)]
    records, overlapped, seconds_of = {}, {}, {}
    for rank in reps:
        for runs in runs_per_window:
            for run in runs:
                transfers, seconds = step_info[rank, run.first]
                records[rank, run.first] = [
                    r for t in transfers for r in as_records(t, rank, run.first, world,
                                                             ranks_per_node, seconds *
                                                             compute.backward_share)]
                overlapped[rank, run.first] = [t.overlap_steps for t in transfers
                                               for _ in t.sizes]
                seconds_of[rank, run.first] = seconds
    return Plan(runs_per_window, reps, class_of, records, overlapped, seconds_of,
                traffic.critical_path, ranks_per_node, traffic.steps, list(traffic.notes))


def _shape(t: Transfer, rank: int, rpn: int, symmetric: bool, links: dict) -> tuple:
    """What pricing `t` for `rank` depends on: on a symmetric network the group's shape
    (members per node) and the peers' sides, else the nodes themselves; the connections
    named in order of first use (their idle times)."""
    keys = ([("group", t.group)] if t.peers is None else [("peer", p) for p in t.peers])
    names = tuple(links.setdefault(k, len(links)) for k in keys)
    node = rank // rpn
    if t.peers is not None:
        where = tuple((p // rpn == node) if symmetric else (node, p // rpn) for p in t.peers)
    else:
        members = t.group if t.group is not None else None
        where = ("world",) if members is None else _group_shape(members, rpn, symmetric)
    return (t.phase, t.op, t.sizes, t.ready, t.peer_nbytes, t.overlap_steps, where, names)


def _group_shape(members: tuple[int, ...], rpn: int, symmetric: bool) -> tuple:
    per_node: dict[int, int] = {}
    for r in members:
        per_node[r // rpn] = per_node.get(r // rpn, 0) + 1
    if not symmetric:
        return tuple(sorted(per_node.items()))
    return (len(members), tuple(sorted(per_node.values())))


def as_records(t: Transfer, rank: int, step: int, world: int, ranks_per_node: int,
               backward_s: float = 0.0) -> list[CommRecord]:
    """The ledger records `t` stands for (what the strategy's code records on `rank`)."""
    if t.peers is not None:
        involved, size, peers = t.peers, len(t.peers) + 1, t.peers
    else:
        involved = t.group if t.group is not None else tuple(range(world))
        size, peers = len(involved), t.group
    node = rank // ranks_per_node
    tier = "intra" if all(r // ranks_per_node == node for r in involved) else "inter"
    leads = t.ready if t.ready is not None else (None,) * len(t.sizes)
    return [CommRecord(step=step, phase=t.phase, op=t.op, group_size=size, peers=peers,
                       nbytes=n, seconds=0.0, tier=tier,
                       lead_s=None if ready is None else ready * backward_s,
                       peer_nbytes=t.peer_nbytes)
            for n, ready in zip(t.sizes, leads, strict=True)]


# ---------------------------------------------------------------------- pricing


@dataclass(frozen=True)
class Priced:
    """One method on one network."""

    total_s: float
    """Overlap-aware (the run projections' headline)."""
    no_overlap_s: float
    """Every modelled op added to compute."""
    compute_s: float
    """The same steps on an infinitely fast network (ranks still wait for the slowest)."""
    steps: int

    @property
    def step_s(self) -> float:
        return self.total_s / self.steps

    @property
    def comm_s(self) -> float:
        """Exposed communication per step."""
        return (self.total_s - self.compute_s) / self.steps

    @property
    def utilisation(self) -> float:
        return self.compute_s / self.total_s if self.total_s > 0 else 1.0


def price(p: Plan, profile: Profile, backend: str | None) -> Priced:
    """The plan's totals on `profile` (module docstring)."""
    totals = [0.0, 0.0, 0.0]  # overlap-aware, no-overlap, compute only
    memo: dict[tuple, float] = {}
    # without TCP tiers no price depends on idle time: a step's is the same every time
    steps: dict[tuple[int, int], tuple] | None = None if _has_tcp(profile) else {}
    for runs in p.runs:
        clocks = {rank: LinkClock() for rank in p.classes}
        pricers = {rank: pricer(profile, rank, p.ranks_per_node, backend=backend,
                                idle=clocks[rank].idle) for rank in p.classes}
        warm = {rank: pricer(profile, rank, p.ranks_per_node, backend=backend)
                for rank in p.classes}
        stretch = {rank: [0.0, 0.0, 0.0] for rank in p.classes}
        for run in runs:
            coupled = any(p.records[rank, run.first] for rank in p.classes)
            repeats = [1] if run.count == 1 else [1, run.count - 1]
            # each stage at its own compute, on warm links: the same for every repeat
            replayed = None if p.critical_path is None else _replicas_s(p, run.first, warm)
            for n in repeats:  # the first step (it may pay slow start), then the others
                values = {rank: _step(p, rank, run.first, clocks[rank], pricers[rank],
                                      warm[rank], memo, n, steps)
                          for rank in p.classes}
                if replayed is not None:
                    values = {rank: (replayed, *v[1:]) for rank, v in values.items()}
                w = run.weight
                for i in range(3):
                    if not coupled:  # ranks run on until the next coupled step
                        for rank in p.classes:
                            stretch[rank][i] += w * n * values[rank][i]
                        continue
                    # a coupled step closes the stretch; each of its repeats is one
                    totals[i] += max(stretch[r][i] + w * values[r][i] for r in p.classes)
                    totals[i] += w * (n - 1) * max(values[r][i] for r in p.classes)
                if coupled:
                    stretch = {rank: [0.0, 0.0, 0.0] for rank in p.classes}
            if run.closes and not coupled:
                for i in range(3):
                    totals[i] += max(stretch[r][i] for r in p.classes)
                stretch = {rank: [0.0, 0.0, 0.0] for rank in p.classes}
        for i in range(3):
            totals[i] += max(stretch[r][i] for r in p.classes)
    return Priced(*totals, p.steps)


def _replicas_s(p: Plan, step: int, warm: dict) -> float:
    """A pipeline step's overlap-aware seconds: each replica's schedule replayed with each
    stage at its own rank's compute, the largest transfer's link and the largest other of
    its stages; the slowest replica (bench.network.timeline `pipeline_step_s`, which prices a
    measured run the same way)."""
    inputs = {rep: critical_path_inputs(p.records[rep, step], warm[rep]) for rep in p.classes}
    return max(pipeline_step_s([p.compute[rep, step] for rep in p.class_of],
                               [inputs[rep][:2] for rep in p.class_of],
                               [inputs[rep][2] for rep in p.class_of],
                               p.critical_path(p.classes[0])))


def _has_tcp(profile: Profile) -> bool:
    """Whether any tier of `profile` is TCP (slow start after idle: prices depend on the
    link clocks)."""
    tiers = [profile.intra, profile.inter, *(t for _, t in profile.overrides),
             *(t for row in profile.links or () for t in row)]
    return any(t.tcp_initial_window_B is not None for t in tiers)


def _step(p: Plan, rank: int, step: int, clock: LinkClock, price_one, price_warm,
          memo: dict, repeat: int, steps: dict | None = None) -> tuple[float, float, float]:
    """(overlap-aware, no-overlap, compute) seconds of one step of `rank`; the link clock
    then advances by `repeat` such steps. `steps`: a memo of whole steps, for networks on
    which no price depends on the link clocks (no TCP tier)."""
    if steps is not None and (rank, step) in steps:
        return steps[rank, step]
    records, compute = p.records[rank, step], p.compute[rank, step]
    costs = []
    for r in records:
        keys = link_keys(r)
        idle = tuple(clock.idle(k) for k in keys)
        collective = canonical_op(r.op) in COLLECTIVES
        key = (r.op, r.nbytes, r.group_size, r.peers, r.peer_nbytes, idle,
               None if collective else rank)
        if key not in memo:
            memo[key] = price_one(r)
        costs.append(memo[key])
        clock.use(keys)
    if p.critical_path is not None:
        overlap = step_time(compute, *critical_path_inputs(records, price_warm),
                            p.critical_path(rank))
    else:
        held = [(r, c) for r, c, s in zip(records, costs, p.overlapped[rank, step],
                                           strict=True) if not s]
        overlap = compute + exposed_s([r for r, _ in held], [c for _, c in held]) + sum(
            max(0.0, c - s * compute) for c, s in zip(costs, p.overlapped[rank, step],
                                                      strict=True) if s)
    no_overlap = compute + sum(costs)
    clock.advance(overlap * repeat)
    if steps is not None:
        steps[rank, step] = overlap, no_overlap, compute
    return overlap, no_overlap, compute


# ---------------------------------------------------------------------- the network


def with_tier(profile: Profile, old: Tier, new: Tier) -> Profile:
    """`profile` with tier `old` (the object: the swept link) replaced by `new` wherever
    it joins two nodes (inter, per-node-pair links, overrides)."""
    links = None if profile.links is None else tuple(
        tuple(new if t is old else t for t in row) for row in profile.links)
    overrides = tuple((pair, new if t is old else t) for pair, t in profile.overrides)
    return replace(profile, inter=new if profile.inter is old else profile.inter, links=links,
                   overrides=overrides)


def bandwidth_for(target: float, utilisation: Callable[[float], float], low: float,
                  high: float, rel: float = 1e-3) -> float:
    """The smallest bandwidth (bytes/s) in [low, high] at which `utilisation` reaches
    `target` (utilisation rises with bandwidth), by bisection on log(bandwidth) to
    `rel`; math.inf when even `high` falls short, `low` when `low` already reaches it."""
    if utilisation(high) < target:
        return math.inf
    if utilisation(low) >= target:
        return low
    while high / low > 1 + rel:
        middle = math.sqrt(low * high)
        if utilisation(middle) >= target:
            high = middle
        else:
            low = middle
    return high
