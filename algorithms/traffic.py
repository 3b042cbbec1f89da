"""What a strategy sends, described without training: the input of `commbench whatif`.

Plain numbers, no torch, like the memory plan's `algorithms/memory.py`: the harness
measures the model on the meta device (`TrafficFacts`: every parameter's shape and FSDP
unit, the tied weight, the pipeline stages' layers) and hands the facts, with the run
config, to the strategy class's `traffic(cfg, facts)` (algorithms/base.py
`Strategy.traffic`), which returns a `Traffic`: for any rank and step, the `Transfer`s
the rank issues in that step, in order, as the strategy's own code records them in its
CommLedger (algorithms/comm.py: phase, op, group, logical bytes, and for DDP's buckets
how far backward still has to go when each is launched).
bench/study/whatif/engine.py prices them with the network model the run projections use
(bench/network/); tests/test_whatif.py holds every description against real runs'
ledgers and projections.

Each strategy class describes its traffic next to its `memory_terms`; the pieces they share
(DDP's buckets, FSDP2's collectives, the outer all-reduce) live here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # algorithms.contract imports torch; this module does not need it
    from algorithms.contract import CriticalPath


@dataclass(frozen=True)
class Transfer:
    """One op a rank issues in a step (or a train of them: DDP's buckets), as recorded."""

    phase: str
    """The ledger phase (train, inner, outer, gossip, dp, tied, clip)."""
    op: str
    """all_reduce, all_gather, reduce_scatter, send, recv, exchange."""
    sizes: tuple[int, ...]
    """Logical bytes of each record (`CommRecord.nbytes`), in launch order: one per DDP
    bucket of the train, else one."""
    group: tuple[int, ...] | None = None
    """A collective's ranks (sorted); None = the whole world."""
    peers: tuple[int, ...] | None = None
    """Point-to-point ops: the other ranks, sorted."""
    peer_nbytes: tuple[int, ...] | None = None
    """exchange: bytes sent to each peer (sums to the one size)."""
    ready: tuple[float, ...] | None = None
    """Ops that overlap backward (DDP buckets): per record, the fraction of the step's
    backward compute still to run when it is launched (the record's `lead_s` is this
    times the backward seconds; the last bucket launches when backward ends: 0). None:
    the op overlaps nothing and is priced in full."""
    overlap_steps: float = 0.0
    """Steps of compute the op may run under before the step that needs its result (a
    streaming outer all-reduce overlapped with the next inner steps): exposed =
    max(0, modelled - overlap_steps x step compute). 0: exposed where it is issued."""
    word_bytes: int = 4
    """Bytes per element of its payload as the code sends it: 4 for fp32 gradients and θ
    (and the pipelines' activations), the wire dtype's for an outer all-reduce sent
    narrower. A planner's exchange dtype rescales only fp32 payloads
    (bench/study/whatif/assume.py)."""


@dataclass(frozen=True)
class ParamFact:
    """One parameter tensor of the model (shared ones once), as `model.parameters()`."""

    shape: tuple[int, ...]
    unit: int
    """The transformer block holding it (its index), or -1: outside the blocks (the
    embedding, the head, the final norm: FSDP2's root unit)."""
    layer: int
    """Index into `model.as_layers()` ([embedding, blocks..., head]) of its module."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 4  # parameters and gradients are fp32


@dataclass(frozen=True)
class TrafficFacts:
    """The model's numbers a traffic description needs (measured on the meta device)."""

    params: tuple[ParamFact, ...]
    """Every parameter, in `model.parameters()` order (a tied weight once)."""
    tied_bytes: int
    """The token embedding's bytes when the head is that weight (pipelines sum its two
    copies' gradients), else 0."""
    tied_layers: tuple[int, ...] = ()
    """Layers holding the tied weight (the embedding and the head), for pipelines."""
    layer_bytes: tuple[int, ...] = ()
    """Parameter bytes of each of `as_layers()` (a tied weight counted in both layers)."""
    boundary_bytes: int = 0
    """One microbatch's hidden states crossing a pipeline stage boundary (B x T x C x 4)."""

    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)


StepTransfers = Callable[[int, int], list[Transfer]]
"""(rank, loop step) -> what the rank issues in that step."""


@dataclass
class Traffic:
    """A strategy's traffic over a run (`steps` loop steps, 0-based), for every rank.

    `transfers(rank, step)`; `compute_share(rank, step)`: the fraction of a full
    data-parallel step's compute the rank does in that step (0 for an idle worker, a
    stage's share for pipelines); `phases`: consecutive step ranges inside which the
    traffic repeats every `period` steps (the what-if prices one period of each in steady
    state); `critical_path`: a pipeline step's schedule (algorithms/contract.py
    `CriticalPath`), priced as bench/network/pipeline.py does (None: op by op).
    """

    steps: int
    transfers: StepTransfers
    period: int = 1
    phases: list[tuple[int, int]] = field(default_factory=list)
    compute_share: Callable[[int, int], float] = lambda rank, step: 1.0
    reads_batch: Callable[[int, int], bool] | None = None
    """Whether the rank consumes a batch in the step (its tokens count; bench/network/timeline.py
    `step_kind`); None: where it computes."""
    critical_path: Callable[[int], CriticalPath] | None = None
    """rank -> the step's schedule, or None."""
    notes: list[str] = field(default_factory=list)
    """What the description assumes, in words (printed with every what-if)."""

    def __post_init__(self):
        if not self.phases:
            self.phases = [(0, self.steps)]
        if self.reads_batch is None:
            self.reads_batch = lambda rank, step: self.compute_share(rank, step) > 0


def round_ends(step: int, inner_steps: int, total_steps: int) -> bool:
    """Whether loop step `step` (0-based) closes a round of `inner_steps` (and the last
    step closes the last, shorter round): the local-update strategies' grid."""
    return (step + 1) % inner_steps == 0 or step + 1 == total_steps


# ---------------------------------------------------------------------- DDP's buckets


def bucket_sizes(grad_bytes: Sequence[int], cap_bytes: int) -> list[int]:
    """torch DDP's buckets after its rebuild (DDPCommHook records one record per bucket):
    the gradients in ready order filled greedily, a bucket closing once it reaches
    `cap_bytes` (the C++ Reducer's rule, `dist._compute_bucket_assignment_by_size`; our
    wrappers pass bucket_cap_mb, so the first bucket has the same cap)."""
    buckets, size = [], 0
    for nbytes in grad_bytes:
        size += nbytes
        if size >= cap_bytes:
            buckets.append(size)
            size = 0
    if size:
        buckets.append(size)
    return buckets


def ddp_buckets(facts: TrafficFacts, bucket_cap_mb: float, phase: str,
                group: tuple[int, ...] | None, microbatches: int = 1) -> Transfer:
    """The bucket train of a step (the last microbatch's backward: the others skip the
    sync): gradients ready in reverse registration order (backward runs from the head
    down), bucket i launched once backward has produced it. Backward is taken to produce
    gradient bytes at a constant rate, so the share of the step's backward left at
    bucket i's launch is the share of bytes in the buckets after it, over `microbatches`."""
    sizes = bucket_sizes([p.nbytes for p in reversed(facts.params)],
                         int(bucket_cap_mb * (1 << 20)))
    total, done, ready = sum(sizes), 0, []
    for size in sizes:
        done += size
        ready.append((total - done) / total / microbatches)
    return Transfer(phase, "all_reduce", tuple(sizes), group, ready=tuple(ready))


DDP_ASSUMPTION = ("DDP buckets: gradients in reverse registration order, produced at a "
                  "constant rate over backward (2/3 of a step's compute); bucket i starts "
                  "when it is full and the link has carried bucket i-1")


# ---------------------------------------------------------------------- FSDP2


def shard_rows(rows: int, ranks: int, index: int) -> int:
    """Rows of a dim-0 shard (torch.chunk: ceil(rows / ranks) each, the last ones short
    or empty): what rank `index` of the replica holds."""
    chunk = -(-rows // ranks)
    return max(0, min(chunk, rows - index * chunk))


def fsdp_transfers(facts: TrafficFacts, ranks: int, group: tuple[int, ...] | None,
                   phase: str, microbatches: int) -> list[Transfer]:
    """One step of a sharded replica (algorithms/shard.py: every block its own unit, the
    rest the root): per microbatch the root's all-gather, every block's in forward and
    again in backward, then (last microbatch only: gradient sync is skipped before) the
    reduce-scatters, blocks from the last down, then the root. All-gather bytes = this
    rank's shard of the unit, padded as FSDP2 pads dim 0 to a multiple of the ranks;
    reduce-scatter bytes = the unit's padded gradient."""
    units: dict[int, int] = {}
    for p in facts.params:
        rows = p.shape[0] if p.shape else 1
        padded = -(-rows // ranks) * ranks * (p.nbytes // max(1, rows * 4)) * 4
        units[p.unit] = units.get(p.unit, 0) + padded
    blocks = sorted(u for u in units if u >= 0)
    gather = [units[-1] // ranks] if -1 in units else []
    forward = [*gather, *(units[b] // ranks for b in blocks)]
    backward = [units[b] // ranks for b in reversed(blocks)]
    scatter = [units[b] for b in reversed(blocks)] + ([units[-1]] if -1 in units else [])
    out = []
    for _ in range(microbatches):
        out.append(Transfer(phase, "all_gather", tuple(forward + backward), group))
    out.append(Transfer(phase, "reduce_scatter", tuple(scatter), group))
    return out


def fsdp_step(facts: TrafficFacts, ranks: int, group: tuple[int, ...] | None, phase: str,
              microbatches: int, grad_clip: float) -> list[Transfer]:
    """`fsdp_transfers`, then gradient clipping's global norm: one fp32 scalar
    all-reduced over the replica (phase "clip") when optim.grad_clip > 0."""
    out = fsdp_transfers(facts, ranks, group, phase, microbatches)
    if grad_clip > 0:
        out.append(Transfer("clip", "all_reduce", (4,), group))
    return out


def local_shard_bytes(facts: TrafficFacts, ranks: int, index: int) -> int:
    """Bytes of rank `index`'s shards of every parameter (unpadded, torch.chunk rows):
    what a sharded replica's outer step all-reduces."""
    total = 0
    for p in facts.params:
        rows = p.shape[0] if p.shape else 1
        total += shard_rows(rows, ranks, index) * (p.nbytes // max(1, rows))
    return total


FSDP_ASSUMPTION = ("FSDP2: every block's and the root's all-gathers and reduce-scatters "
                   "priced in full, not overlapped with compute (as the run projections "
                   "price them; on a GPU FSDP2 overlaps them: an upper bound)")


# ---------------------------------------------------------------------- groups


def replica_of(rank: int, group_size: int, world: int) -> tuple[int, ...] | None:
    """The ranks of `rank`'s replica (algorithms/outer.py `replica_groups`); None when the
    replica is the whole world."""
    if group_size >= world:
        return None
    start = rank // group_size * group_size
    return tuple(range(start, start + group_size))


def cross_of(rank: int, group_size: int, world: int) -> tuple[int, ...] | None:
    """The ranks holding `rank`'s position in every replica (the outer all-reduce's
    group); None when that is the whole world (one rank per replica)."""
    if group_size == 1:
        return None
    return tuple(range(rank % group_size, world, group_size))


# ---------------------------------------------------------------------- local updates


def replica_inner(cfg, facts: TrafficFacts, bucket_cap_mb: float, phase: str = "inner"
                  ) -> Callable[[int], list[Transfer]]:
    """rank -> its inner step's traffic inside its replica (DiLoCo, Pier after the lazy
    start): the sharded replica's FSDP2 collectives, or DDP's buckets over the replica
    (none with one rank per replica). One list per rank, built once."""
    p = cfg.parallel
    world, g, M = p.world_size, p.group_size, p.num_microbatches
    if p.shard == "fsdp":
        template = fsdp_step(facts, g, None, phase, M, cfg.optim.grad_clip)
    elif g > 1:
        template = [ddp_buckets(facts, bucket_cap_mb, phase, None, M)]
    else:
        template = []
    cache: dict[int, list[Transfer]] = {}

    def inner(rank: int) -> list[Transfer]:
        if rank not in cache:
            group = replica_of(rank, g, world)
            cache[rank] = [t if t.group == group else _with_group(t, group) for t in template]
        return cache[rank]
    return inner


def outer_all_reduce(cfg, facts: TrafficFacts, rank: int, wire_bytes: int) -> list[Transfer]:
    """DiLoCo's outer round (algorithms/outer.py): one flat all-reduce of this rank's θ
    (its shards' when sharded) in the wire dtype, across the ranks holding its position
    in every replica (phase "outer"); nothing with one replica."""
    p = cfg.parallel
    world, g = p.world_size, p.group_size
    if world // g == 1:
        return []
    theta = local_shard_bytes(facts, g, rank % g) if p.shard == "fsdp" else facts.param_bytes
    return [Transfer("outer", "all_reduce", (theta // 4 * wire_bytes,), cross_of(rank, g, world),
                     word_bytes=wire_bytes)]


def local_update_traffic(cfg, inner_steps: int, inner: Callable[[int], list[Transfer]],
                         outer: Callable[[int], list[Transfer]], warmup_steps: int = 0,
                         warm_inner: Callable[[int], list[Transfer]] | None = None,
                         notes: list[str] | None = None) -> Traffic:
    """Rounds of `inner_steps` on the absolute grid (and the last step): every step the
    rank's `inner` traffic, the round's last step then its `outer` traffic. The first
    `warmup_steps` run `warm_inner` instead and close their rounds without outer traffic
    (Pier's lazy start)."""
    steps = cfg.run.steps

    def transfers(rank: int, step: int) -> list[Transfer]:
        out = warm_inner(rank) if step < warmup_steps else inner(rank)
        if round_ends(step, inner_steps, steps) and step + 1 > warmup_steps:
            out = [*out, *outer(rank)]
        return out

    phases = [(0, warmup_steps), (warmup_steps, steps)] if 0 < warmup_steps < steps else []
    return Traffic(steps, transfers, period=inner_steps, phases=phases, notes=notes or [])


def _with_group(transfer: Transfer, group: tuple[int, ...] | None) -> Transfer:
    return replace(transfer, group=group)


def outer_notes(cfg) -> list[str]:
    """What an outer all-reduce's description assumes, in words."""
    p = cfg.parallel
    notes = [DDP_ASSUMPTION] if p.group_size > 1 and p.shard != "fsdp" else []
    if p.shard == "fsdp":
        notes.append(FSDP_ASSUMPTION)
    elif p.group_size > 1:
        notes.append(f"outer exchange: each of a replica's {p.group_size} ranks sends the "
                     "whole θ's round to its position's ranks in the other replicas "
                     f"(algorithms/outer.py), {p.group_size} concurrent exchanges out of each "
                     "replica (DiLoCo's all-reduce, or the rule's all-gather or peer "
                     "exchange); parallel.shard=fsdp sends 1/group_size of it each")
    return notes


# ---------------------------------------------------------------------- pipelines


def pipeline_traffic(config, cfg, facts: TrafficFacts) -> Traffic:
    """A pipeline config's traffic (algorithms/pipeline_base.py `sync_gradients` and the
    schedules' point-to-point batches). Rank = replica * S + stage. Its compute share is
    its stage's share of the model's matmul parameters (the embedding lookup computes
    nothing, the head's matmul counts; attention's score matmuls are not counted)."""
    from algorithms.partition import bounds_of

    p = cfg.parallel
    S, world, M = p.num_stages, p.world_size, p.num_microbatches
    V = getattr(config, "stages_per_rank", 1)
    replicas = world // S
    numels = [b // 4 for b in facts.layer_bytes]
    bounds = bounds_of(numels, S * V, p.partition)
    layers_of = [{i for a, b in bounds[s::S] for i in range(a, b)} for s in range(S)]
    work = [sum(facts.layer_bytes[i] for i in layers if i != 0) for layers in layers_of]
    tied_twice = [set(facts.tied_layers) <= layers for layers in layers_of]
    stage_bytes = [sum(facts.layer_bytes[i] for i in layers)
                   - (facts.tied_bytes if tied_twice[s] else 0)
                   for s, layers in enumerate(layers_of)]
    path = config.critical_path(S, M)
    gpipe = getattr(config, "schedule", "1f1b") == "gpipe"
    interleaved = V > 1
    no_flush = bool(getattr(config, "delay", 0))
    boundary = facts.boundary_bytes
    cache: dict[tuple[int, bool], list[Transfer]] = {}

    def crossings(first: str, last: str, steady: bool) -> list[str]:
        """One neighbour's records in a step: GPipe's M of one kind then M of the other;
        1F1B's first crossing alone, M - 1 batched exchanges, the last alone; without a
        flush (2BW, delay 1) the first step's M (the drain is the next step's) and then
        M exchanges. Checked against runs with two stages (tests/test_whatif.py)."""
        if gpipe:
            return [first] * M + [last] * M
        if no_flush:
            return ["exchange"] * M if steady else [first] + ["exchange"] * (M - 1)
        return [first] + ["exchange"] * (M - 1) + [last] if M > 1 else [first, last]

    def chunk_crossings(replica: int, stage: int) -> list[Transfer]:
        """Interleaved 1F1B (V chunks a rank, chunk c on stage c mod S): per microbatch a
        send forward for each of the stage's chunks but the model's last, a receive for
        each but the first, and the same backward the other way; every one its own
        record, to the next stage (mod S) forward and the previous one backward, never
        batched into an exchange (checked against runs of S = 2 and S = 4, V = 2)."""
        nxt, prv = replica * S + (stage + 1) % S, replica * S + (stage - 1) % S
        ahead, behind = V - (stage == S - 1), V - (stage == 0)
        return [t for peer, kind, count in ((nxt, "send", ahead), (prv, "recv", behind),
                                            (prv, "send", behind), (nxt, "recv", ahead))
                for t in [Transfer("train", kind, (boundary,), peers=(peer,))] * (M * count)]

    def transfers(rank: int, step: int) -> list[Transfer]:
        key = (rank, step > 0)
        if key in cache:
            return cache[key]
        replica, stage = divmod(rank, S)
        out = chunk_crossings(replica, stage) if interleaved else []
        for peer, first, last in ((rank + 1 if stage < S - 1 else None, "send", "recv"),
                                  (rank - 1 if stage > 0 else None, "recv", "send")):
            if peer is None or interleaved:
                continue
            out += [Transfer("train", kind, (boundary,), peers=(peer,),
                             peer_nbytes=(boundary,) if kind == "exchange" else None)
                    for kind in crossings(first, last, step > 0)]
        first, last = replica * S, replica * S + S - 1
        if no_flush and step == 0:  # its backwards run in step 1: no gradients yet
            cache[key] = out
            return out
        if replicas > 1:
            out.append(Transfer("dp", "all_reduce", (stage_bytes[stage],),
                                tuple(range(stage, world, S))))
        if S > 1 and facts.tied_bytes and stage in (0, S - 1):
            out.append(Transfer("tied", "all_reduce", (facts.tied_bytes,), (first, last)))
        if S > 1 and cfg.optim.grad_clip > 0:
            out.append(Transfer("clip", "all_reduce", (4,), tuple(range(first, last + 1))))
        cache[key] = out
        return out

    return Traffic(cfg.run.steps, transfers, phases=[(0, 1), (1, cfg.run.steps)]
                   if no_flush and cfg.run.steps > 1 else [],
                   compute_share=lambda rank, step: work[rank % S] / sum(work),
                   reads_batch=lambda rank, step: rank % S == 0,
                   critical_path=lambda rank: path,
                   notes=["pipeline stages: each stage's compute its share of the model's "
                          "matmul parameters (attention's score matmuls not counted); "
                          "activations fp32, one message per microbatch and boundary "
                          "(a stage with two neighbours: their records not checked against "
                          "a run); "
                          "priced on the schedule's critical path "
                          "(bench/network/pipeline.py)"])
