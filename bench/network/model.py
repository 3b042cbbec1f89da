"""CommRecords -> modelled seconds: per record, summed, on the backward timeline, emulated.

Exercised by `pytest tests/test_network.py`. bench/run/train.py calls `project` for the
projected step times in summary.json and `delay_policy` for `network.emulate=PROFILE`.
`backend=` (None = "naive", "gloo", "nccl-ring", "nccl-tree", "nccl") picks the collective
algorithm's formulas (bench/network/costs.py, docs/network-model.md).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from bench.network.costs import (
    COLLECTIVES,
    canonical_op,
    check_algorithm,
    first_message_bytes,
    handshakes,
    p2p_s,
    resolve,
    slow_start_extra_s,
)
from bench.network.profiles import Profile, Tier

if TYPE_CHECKING:  # torch stays out of `commbench --help`
    from algorithms.ledger import CommRecord


def group_tiers(profile: Profile, ranks: Iterable[int], ranks_per_node: int = 1) -> set[Tier]:
    """Every distinct Tier joining two of `ranks` (empty for a single rank)."""
    ranks = set(ranks)
    nodes = {r // ranks_per_node for r in ranks}
    tiers = {profile.intra} if len(nodes) < len(ranks) else set()
    tiers.update(profile.node_link(a, b) for a in nodes for b in nodes if a != b)
    return tiers


def shared_tier(tier: Tier, flows: int) -> Tier:
    """The share of `tier` one of `flows` concurrent flows out of a node gets: the flows
    spread over the tier's `nics` links, ceil(flows / nics) share each one."""
    share = math.ceil(flows / tier.nics)
    return tier if share <= 1 else dataclasses.replace(tier, bandwidth_Bps=tier.bandwidth_Bps
                                                       / share, nics=1)


def record_seconds(record: CommRecord, profile: Profile, rank: int = 0,
                   ranks_per_node: int = 1, *, backend: str | None = None) -> float:
    """Modelled seconds of one ledger record made by `rank`.

    Links are re-derived from the ranks (record.tier is only what the run measured on):
    - collectives run on the group `record.peers` (None: ranks 0..group_size-1) and go at
      the pace of the group's SLOWEST link (a ring's every step waits for its slowest hop):
      the max of the formula over the group's tiers.
    - contention (hierarchical outer steps): a group spanning nodes with m < ranks_per_node
      of its members on a node has ranks_per_node / m sibling groups (the other local
      ranks' cross groups, docs/algorithms.md) running the same collective at the same
      time out of that node; each gets `shared_tier` of the inter-node tiers.
    - send/recv: one message over the link between `rank` and the peer.
    - exchange: nbytes is the total sent and peers all peers; each peer gets
      nbytes/len(peers) (symmetric exchange, as in gossip). Peers reached over the rank's
      node link (other nodes) share it: those messages leave one after the other,
      h max(alpha) + sum(S_p / beta_p), h = 2 on gloo (every send waits for the peer's
      ready-to-receive, posted at the same moment), else 1; peers inside the node
      likewise share the intra link;
      the two classes run concurrently. Each peer's link is the slower of both directions.
      A tier netprobe measured the exchange on (`Tier.exchange_scale`) scales its class's
      time by the measured ratio at the per-peer size (TCP's window; docs/network-model.md).
    """
    return _Model(profile, rank, ranks_per_node, backend)(record)


IdleOf = Callable[[tuple], float]
"""Seconds a connection has been idle, by `link_keys` key (math.inf: never used)."""


def group_of(record: CommRecord) -> tuple[int, ...]:
    """A collective's ranks: its subgroup's (`peers`), else the world's."""
    return tuple(record.peers) if record.peers is not None else tuple(range(record.group_size))


def link_keys(record: CommRecord) -> list[tuple]:
    """The connections an op uses: one per peer for point-to-point ops, the group's for a
    collective (its ring or tree neighbours)."""
    if canonical_op(record.op) in COLLECTIVES:
        return [("group", group_of(record))]
    return [("peer", p) for p in (record.peers or ())]


class _Model:
    """record_seconds for one (profile, rank, backend), caching each group's tiers.

    `idle`: how long each connection the records use has been idle; TCP tiers
    (`tcp_initial_window_B`) then pay slow start on the op's first message
    (`slow_start_extra_s`; the slowest of the op's links, or of an exchange's peers, whose
    ramps run at the same time). A number applies to every connection; 0 = warm.
    """

    def __init__(self, profile: Profile, rank: int, ranks_per_node: int,
                 backend: str | None = None, idle: IdleOf | float = 0.0):
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node!r}")
        self.profile, self.rank, self.ranks_per_node = profile, rank, ranks_per_node
        self.algorithm = check_algorithm(backend or "naive")
        self.idle = idle if callable(idle) else lambda key, seconds=float(idle): seconds
        self.tiers: dict[tuple[int, ...], list[Tier]] = {}

    def __call__(self, record: CommRecord) -> float:
        op = canonical_op(record.op)
        if op in COLLECTIVES:
            ranks = group_of(record)
            if ranks not in self.tiers:
                self.tiers[ranks] = self._group_tiers(ranks)
            formula, tiers, n = COLLECTIVES[op], self.tiers[ranks], len(ranks)
            idle = self.idle(("group", ranks))
            cost = 0.0
            for t in tiers:  # the group goes at its slowest link's pace
                alg = resolve(op, n, record.nbytes, t, self.algorithm)
                first = first_message_bytes(op, n, record.nbytes, alg)
                cost = max(cost, formula(n, record.nbytes, t, alg)
                           + slow_start_extra_s(first, t, idle))
            return cost
        if not record.peers:
            raise ValueError(f"{op} record needs peers, got {record.peers!r}")
        if op != "exchange":
            peer = record.peers[0]
            idle = self.idle(("peer", peer))
            return max(p2p_s(record.nbytes, t, self.algorithm)
                       + slow_start_extra_s(record.nbytes, t, idle) for t in self._both(peer))
        per_peer = record.nbytes / len(record.peers)
        node = self.rank // self.ranks_per_node
        classes: dict[bool, list[tuple[float, float, float]]] = {}
        ramp = 0.0
        for peer in record.peers:
            tiers = self._both(peer)
            classes.setdefault(peer // self.ranks_per_node == node, []).append(
                (max(t.latency_s for t in tiers), max(per_peer / t.bandwidth_Bps for t in tiers),
                 max(t.exchange_factor(per_peer) for t in tiers)))
            idle = self.idle(("peer", peer))
            ramp = max(ramp, *(slow_start_extra_s(per_peer, t, idle) for t in tiers))
        h = handshakes(self.algorithm)
        return ramp + max(max(f for _, _, f in msgs)
                          * (h * max(a for a, _, _ in msgs) + sum(s for _, s, _ in msgs))
                          for msgs in classes.values())

    def _both(self, peer: int) -> tuple[Tier, Tier]:
        link = self.profile.link
        return (link(self.rank, peer, self.ranks_per_node),
                link(peer, self.rank, self.ranks_per_node))

    def _group_tiers(self, ranks: tuple[int, ...]) -> list[Tier]:
        rpn = self.ranks_per_node
        per_node: dict[int, int] = {}
        for r in ranks:
            per_node[r // rpn] = per_node.get(r // rpn, 0) + 1
        tiers = group_tiers(self.profile, ranks, rpn)
        if len(per_node) < 2:
            return list(tiers)
        flows = max(1, rpn // min(per_node.values()))
        inter = {self.profile.node_link(a, b) for a in per_node for b in per_node if a != b}
        return [shared_tier(t, flows) if t in inter else t for t in tiers]


def pricer(profile: Profile, rank: int = 0, ranks_per_node: int = 1, *,
           backend: str | None = None,
           idle: IdleOf | float = 0.0) -> Callable[[CommRecord], float]:
    """record -> modelled seconds on `profile` for this rank (`record_seconds`), keeping
    its groups' tiers between calls: build one per profile and reuse it. `idle`: seconds
    each connection has been idle before the record (a number for all of them, or a
    function of the `link_keys` key; math.inf = never used): TCP slow start. 0 = warm."""
    return _Model(profile, rank, ranks_per_node, backend, idle)


def project(records: Iterable[CommRecord], profile: Profile, rank: int = 0,
            ranks_per_node: int = 1, *, backend: str | None = None,
            overlap: bool = False, idle: IdleOf | float = 0.0) -> float:
    """Modelled communication seconds of `records` (one rank's) on `profile`, summed.

    overlap=False: a plain sum, no overlap with compute or other ops (the naive
    projection). overlap=True: `project_overlap`. `idle`: as `pricer`'s.
    """
    records = list(records)
    price = pricer(profile, rank, ranks_per_node, backend=backend, idle=idle)
    costs = [price(r) for r in records]
    return exposed_s(records, costs) if overlap else sum(costs)


def bucket_timeline(buckets: Iterable[tuple[float, float]]) -> float:
    """End time, relative to the end of backward (t = 0), of ops queued on one link.

    `buckets`: (lead_s, cost_s) per op in launch order; op i is ready at -lead_s and starts
    when both it is ready and the previous op has finished. Returns the last end (may be
    negative: everything hidden under backward), or -inf for no ops.
    """
    end = -math.inf
    for lead, cost in buckets:
        end = max(-lead, end) + cost
    return end


def project_overlap(records: Iterable[CommRecord], profile: Profile, rank: int = 0,
                    ranks_per_node: int = 1, *, backend: str | None = None,
                    idle: IdleOf | float = 0.0) -> float:
    """Exposed communication seconds of `records` on `profile`, overlap-aware (torch DDP):
    `exposed_s` of their modelled seconds."""
    return project(records, profile, rank, ranks_per_node, backend=backend, overlap=True,
                   idle=idle)


def exposed_s(records: list[CommRecord], costs: list[float],
              window: Callable[[CommRecord], float] | None = None) -> float:
    """The exposed part of `records`' modelled seconds `costs` (one per record).

    Per step, the records carrying `lead_s` (seconds from the bucket's launch to the end of
    backward; set by the DDP hook) are queued in order on the link by `bucket_timeline`:
    exposed = max(0, end of the last one). A record of an op that spans steps
    (`launch_step`) exposes max(0, cost - window(record)), its window being the compute it
    ran beside (bench/network/timeline.py `span_window_s`; without `window`, none: all
    exposed).
    Other records do not overlap: their modelled seconds are added in full.
    """
    steps: dict[int, list[tuple[float, float]]] = {}
    exposed = 0.0
    for r, cost in zip(records, costs, strict=True):
        if r.launch_step is not None:
            exposed += max(0.0, cost - (window(r) if window is not None else 0.0))
        elif r.lead_s is None:
            exposed += cost
        else:
            steps.setdefault(r.step, []).append((r.lead_s, cost))
    for buckets in steps.values():
        exposed += max(0.0, bucket_timeline(sorted(buckets, key=lambda b: -b[0])))
    return exposed


class _Emulator:
    """delay_policy's callable: modelled seconds, queued per link on a busy-until timeline;
    TCP tiers pay slow start on connections idle (in wall time) past the RTO."""

    def __init__(self, profile: Profile, rank: int, ranks_per_node: int,
                 backend: str | None, clock: Callable[[], float]):
        self.model = _Model(profile, rank, ranks_per_node, backend, idle=self._idle)
        self.clock = clock
        self.busy_until: dict[object, float] = {}
        self.last_used: dict[tuple, float] = {}  # link_keys key -> emulated end of its last op
        self.lock = threading.Lock()
        self.start = 0.0

    def _idle(self, key: tuple) -> float:
        return self.start - self.last_used.get(key, -math.inf)

    def __call__(self, record: CommRecord) -> float:
        with self.lock:
            self.start = start = self.clock() - record.seconds  # the op's launch time
            cost = self.model(record)
            key = record.peers if record.peers is not None else ("world", record.group_size)
            end = max(start, self.busy_until.get(key, -math.inf)) + cost
            self.busy_until[key] = end
            for link in link_keys(record):
                self.last_used[link] = end
        return end - start


def delay_policy(profile: Profile, rank: int, ranks_per_node: int = 1, *,
                 backend: str | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> Callable[[CommRecord], float]:
    """The Communicator's emulation hook: record -> seconds the op must take from launch.

    Called when an op completes (`clock()` then; launch = clock() - record.seconds). A TCP
    tier's connection idle past the RTO since its last emulated op pays slow start. Ops on
    one link (the same peers / group) are queued: an op launched while an earlier one is
    still busy on the modelled link starts when that one ends, so two DDP buckets whose
    completion callbacks run in parallel (gloo) are charged one after the other, not at
    once. Returns (modelled end - launch); the Communicator sleeps off the rest.
    """
    return _Emulator(profile, rank, ranks_per_node, backend, clock)
