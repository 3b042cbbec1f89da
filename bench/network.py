"""Network profiles and the alpha-beta cost model that turns CommRecords into seconds.

Exercised by `pytest tests/test_network.py`. bench/train.py uses `project` for the
projected step times in summary.json and `delay_policy` for `network.emulate=PROFILE`.

The model: a message of S bytes over a link with latency alpha (s) and bandwidth beta
(bytes/s) takes `alpha + S/beta`; collectives use the standard ring/tree formulas below.
A link is a `Tier`; a `Profile` says which Tier joins two ranks: `intra` inside a node
(node = rank // ranks_per_node), `inter` across nodes, or, for heterogeneous networks, a
node x node matrix `links`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from algorithms.comm import CommRecord


@dataclass(frozen=True)
class Tier:
    """One kind of link: latency alpha in seconds, bandwidth beta in bytes per second."""

    latency_s: float
    bandwidth_Bps: float

    def __post_init__(self):
        if self.latency_s < 0:
            raise ValueError(f"Tier.latency_s must be >= 0, got {self.latency_s!r}")
        if self.bandwidth_Bps <= 0:
            raise ValueError(f"Tier.bandwidth_Bps must be > 0, got {self.bandwidth_Bps!r}")


@dataclass(frozen=True)
class Profile:
    """A network: the Tier inside a node, across nodes, and optionally per node pair."""

    name: str
    intra: Tier
    inter: Tier
    links: tuple[tuple[Tier, ...], ...] | None = None
    """Heterogeneous networks: links[a][b] joins node a to node b (a != b); None = `inter`."""
    description: str = ""

    def __post_init__(self):
        if self.links is not None and any(len(row) != len(self.links) for row in self.links):
            raise ValueError(f"network profile {self.name!r}: links must be a square matrix")

    def link(self, src_rank: int, dst_rank: int, ranks_per_node: int = 1) -> Tier:
        """The Tier that carries traffic from `src_rank` to `dst_rank`."""
        return self.node_link(src_rank // ranks_per_node, dst_rank // ranks_per_node)

    def node_link(self, src_node: int, dst_node: int) -> Tier:
        if src_node == dst_node:
            return self.intra
        if self.links is None:
            return self.inter
        if max(src_node, dst_node) >= len(self.links):
            raise ValueError(
                f"network profile {self.name!r} describes {len(self.links)} nodes, got node "
                f"{max(src_node, dst_node)}; lower the world size, raise network.ranks_per_node "
                f"or build a larger profile with bench.network.sites_profile"
            )
        return self.links[src_node][dst_node]


def sites_profile(name: str, site_of_node: Sequence[int], intra: Tier, within_site: Tier,
                  across_sites: Tier, description: str = "") -> Profile:
    """A heterogeneous Profile from a node -> site map: `within_site` links nodes of one
    site, `across_sites` links nodes of different sites, `intra` ranks of one node."""
    links = tuple(
        tuple(within_site if a == b else across_sites for b in site_of_node) for a in site_of_node
    )
    return Profile(name, intra, across_sites, links, description)


# Nominal per-direction line rates, no protocol-efficiency factor (NCCL typically reaches
# 80-90% of these), so projected communication is optimistic. Latencies are rough
# per-message costs through the software stack, not wire latencies.
NVLINK = Tier(5e-6, 450e9)  # H100 SXM NVLink 4: 900 GB/s bidirectional (NVIDIA datasheet)
IB_400G = Tier(5e-6, 50e9)  # InfiniBand NDR, 400 Gb/s per GPU NIC; ~1 us wire, ~5 us NCCL
ETH_100G = Tier(20e-6, 12.5e9)  # 100 GbE with RoCE/TCP: tens of microseconds per message
ETH_10G = Tier(50e-6, 1.25e9)  # 10 GbE, kernel TCP
WAN_1G = Tier(10e-3, 125e6)  # 1 Gb/s between sites; ~10 ms one-way (same continent)

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("nvlink", NVLINK, NVLINK, description="every rank in one NVLink domain"),
        Profile("ib-400g", NVLINK, IB_400G, description="NVLink in a node, 400G InfiniBand"),
        Profile("eth-100g", NVLINK, ETH_100G, description="NVLink in a node, 100 Gb Ethernet"),
        Profile("eth-10g", NVLINK, ETH_10G, description="NVLink in a node, 10 Gb Ethernet"),
        Profile("wan-1g", NVLINK, WAN_1G, description="NVLink in a node, 1 Gb/s WAN"),
        sites_profile(
            "two-sites", (0, 0, 1, 1), NVLINK, IB_400G, WAN_1G,
            description="4 nodes in 2 sites (nodes 0-1, 2-3): 400G InfiniBand inside a site, "
            "1 Gb/s WAN between them",
        ),
    )
}


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"network profile must be one of {sorted(PROFILES)}, got {name!r}")
    return PROFILES[name]


# ---------------------------------------------------------------------- cost formulas
# n: ranks in the group; nbytes: S, the per-rank payload as the CommLedger records it.


def all_reduce_s(n: int, nbytes: float, tier: Tier) -> float:
    """Ring all-reduce (reduce-scatter + all-gather): 2(n-1)(alpha + S/(n beta))."""
    _check(n, nbytes)
    return 2 * (n - 1) * (tier.latency_s + nbytes / (n * tier.bandwidth_Bps))


def reduce_scatter_s(n: int, nbytes: float, tier: Tier) -> float:
    """Ring reduce-scatter of an S-byte input: (n-1)(alpha + S/(n beta))."""
    _check(n, nbytes)
    return (n - 1) * (tier.latency_s + nbytes / (n * tier.bandwidth_Bps))


def broadcast_s(n: int, nbytes: float, tier: Tier) -> float:
    """Binomial tree: ceil(log2 n)(alpha + S/beta).

    The textbook MPICH short-message model; for large messages pipelined rings approach
    S/beta, so this over-estimates big broadcasts (rare here: initial weight syncs).
    """
    _check(n, nbytes)
    return (n - 1).bit_length() * (tier.latency_s + nbytes / tier.bandwidth_Bps)


def all_gather_s(n: int, nbytes: float, tier: Tier) -> float:
    """Ring all-gather, S = per-rank bytes: (n-1)(alpha + S/beta)."""
    _check(n, nbytes)
    return (n - 1) * (tier.latency_s + nbytes / tier.bandwidth_Bps)


def p2p_s(nbytes: float, tier: Tier) -> float:
    """One message: alpha + S/beta."""
    _check(1, nbytes)
    return tier.latency_s + nbytes / tier.bandwidth_Bps


def _check(n, nbytes):
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")


def _barrier_s(n: int, nbytes: float, tier: Tier) -> float:
    return all_reduce_s(n, 0, tier)


_COLLECTIVES: dict[str, Callable[[int, float, Tier], float]] = {
    "all_reduce": all_reduce_s,
    "reduce_scatter": reduce_scatter_s,
    "broadcast": broadcast_s,
    "all_gather": all_gather_s,
    "barrier": _barrier_s,
}
_P2P = ("send", "recv", "exchange")
# Names DeepSpeed's comms logger uses for the same collectives (algorithms/zero.py copies
# them into the ledger).
_ALIASES = {
    "inference_all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_fn": "reduce_scatter",
    "reduce_scatter_base": "reduce_scatter",
    "all_gather_into_tensor": "all_gather",
    "allgather_fn": "all_gather",
    "all_gather_base": "all_gather",
}


# ---------------------------------------------------------------------- records -> seconds


def group_tiers(profile: Profile, ranks: Iterable[int], ranks_per_node: int = 1) -> set[Tier]:
    """Every distinct Tier joining two of `ranks` (empty for a single rank)."""
    ranks = set(ranks)
    nodes = {r // ranks_per_node for r in ranks}
    tiers = {profile.intra} if len(nodes) < len(ranks) else set()
    tiers.update(profile.node_link(a, b) for a in nodes for b in nodes if a != b)
    return tiers


def record_seconds(record: CommRecord, profile: Profile, rank: int = 0,
                   ranks_per_node: int = 1) -> float:
    """Modelled seconds of one ledger record made by `rank`.

    Links are re-derived from the ranks (record.tier is only what the run measured on):
    - collectives run on the group `record.peers` (None: ranks 0..group_size-1) and go at
      the pace of the group's SLOWEST link: a ring's every step waits for its slowest
      hop, which is why one cross-site pair slows a whole all-reduce. We take the max of
      the formula over the group's tiers.
    - send/recv: one message over the link between `rank` and the peer.
    - exchange: the sends and receives to all peers run concurrently, so it takes the max
      over peers (and both directions) of one message of nbytes/len(peers) bytes: the
      exchange is assumed symmetric (the same payload to and from every peer, as in
      gossip), since the record holds only the total bytes sent.
    """
    return _Model(profile, rank, ranks_per_node)(record)


class _Model:
    """record_seconds for one (profile, rank), caching each group's set of tiers."""

    def __init__(self, profile: Profile, rank: int, ranks_per_node: int):
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node!r}")
        self.profile, self.rank, self.ranks_per_node = profile, rank, ranks_per_node
        self.tiers: dict[tuple[int, ...], set[Tier]] = {}

    def __call__(self, record: CommRecord) -> float:
        op = _ALIASES.get(record.op, record.op)
        if op in _COLLECTIVES:
            ranks = record.peers if record.peers is not None else tuple(range(record.group_size))
            if ranks not in self.tiers:
                self.tiers[ranks] = group_tiers(self.profile, ranks, self.ranks_per_node)
            formula = _COLLECTIVES[op]
            n = len(ranks)
            return max((formula(n, record.nbytes, t) for t in self.tiers[ranks]), default=0.0)
        if op in _P2P:
            if not record.peers:
                raise ValueError(f"{op} record needs peers, got {record.peers!r}")
            per_peer = record.nbytes / len(record.peers) if op == "exchange" else record.nbytes
            link = self.profile.link
            return max(
                p2p_s(per_peer, tier)
                for peer in record.peers
                for tier in (link(self.rank, peer, self.ranks_per_node),
                             link(peer, self.rank, self.ranks_per_node))
            )
        known = sorted([*_COLLECTIVES, *_P2P, *_ALIASES])
        raise ValueError(f"cannot model comm op {record.op!r}; known ops: {known}")


def delay_policy(profile: Profile, rank: int, ranks_per_node: int = 1
                 ) -> Callable[[CommRecord], float]:
    """The Communicator's emulation hook: record -> modelled seconds on `profile`."""
    return _Model(profile, rank, ranks_per_node)


def project(records: Iterable[CommRecord], profile: Profile, rank: int = 0,
            ranks_per_node: int = 1) -> float:
    """Modelled communication seconds of `records` (one rank's) on `profile`, summed.

    A plain sum: it assumes no overlap of communication with compute or with other ops.
    """
    model = _Model(profile, rank, ranks_per_node)
    return sum(model(r) for r in records)
