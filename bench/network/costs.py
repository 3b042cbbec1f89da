"""Cost formulas per collective algorithm, and the bytes each op puts on the wire.

Exercised by `pytest tests/test_network.py -k formula`. Every formula is in
docs/network-model.md with its source. Notation: n ranks in the group, S = `nbytes` as the
CommLedger records it (the rank's logical payload), alpha = `Tier.latency_s`,
beta = `Tier.bandwidth_Bps`, L = ceil(log2 n).

Algorithms (`algorithm=` below; bench.network's `backend=` picks them):
- `naive`: the textbook alpha-beta ring/tree formulas (what every caller got before
  backends existed, and still the default):
    all_reduce 2(n-1)(a + S/(n b)); reduce_scatter (n-1)(a + S/(n b));
    all_gather (n-1)(a + S/b); broadcast L(a + S/b); p2p a + S/b.
- `gloo`: every gloo send waits for the receiver's ready-to-receive notification.
  all_reduce is gloo's ring (gloo/allreduce.cc) replayed segment by segment
  (`gloo_ring_all_reduce_s`): the buffer cut into at least 2n segments of at most 1 MiB,
  two in flight, each send leaving when the peer's notification (posted when the receive
  was, a one-way latency earlier) has arrived and the link is free; a buffer of one
  element per segment costs 4(n-1)a, one element (2n-1)a (gloo skips empty segments),
  the handshake of one segment hides under the other's transfer when the link is the
  bottleneck. reduce_scatter (n-1)(2a + S/(n b)); all_gather (n-1)(2a + S/b);
  broadcast L(2a + S/b) (a handshake per step; not measured separately). send/recv stay
  a + S/b (the receive is posted before the data arrives; ping-pong measured within 13%);
  a symmetric `exchange` (both peers post at once, gossip) pays the handshake:
  2a + S/b per link.
- `nccl-ring`: pipelined rings. all_reduce 2(n-1)(a + S/(n b)) (as naive);
  broadcast (n-1)a + S/b (chunks pipelined round the ring); others as naive.
- `nccl-tree`: double binary tree all_reduce (reduce up, broadcast down, pipelined):
  2 L a + 2 S/b. NCCL uses trees only for all_reduce; other ops as nccl-ring.
- `nccl`: what NCCL's tuner roughly does: the cheaper of ring and tree for all_reduce.
- every backend: `quantized_all_reduce` (the compressed outer exchange) = an all-to-all,
  h a + (n-1) S/(n b), then the all-gather of S/n per rank (that backend's formula).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

from bench.network.profiles import Tier

ALGORITHMS = ("naive", "gloo", "nccl-ring", "nccl-tree", "nccl")


def _check(n, nbytes):
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")


def _log2(n: int) -> int:
    return (n - 1).bit_length()  # ceil(log2 n) for n >= 1


def check_algorithm(algorithm: str) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"network model backend must be one of {list(ALGORITHMS)} "
                         f"(or None = naive), got {algorithm!r}")
    return algorithm


def handshakes(algorithm: str) -> int:
    """Latencies paid per ring step / tree round, and by a symmetric exchange (both peers
    post at once): 2 for gloo (ready-to-receive + data), else 1."""
    return 2 if algorithm == "gloo" else 1


def all_reduce_s(n: int, nbytes: float, tier: Tier, algorithm: str = "naive") -> float:
    """All-reduce of S bytes on n ranks (formulas in the module docstring)."""
    _check(n, nbytes)
    check_algorithm(algorithm)
    if n == 1:
        return 0.0
    a, b = tier.latency_s, tier.bandwidth_Bps
    if algorithm == "gloo":
        return gloo_ring_all_reduce_s(n, float(nbytes), a, b)
    ring = 2 * (n - 1) * (a + nbytes / (n * b))
    tree = 2 * _log2(n) * a + 2 * nbytes / b
    if algorithm == "nccl-tree":
        return tree
    if algorithm == "nccl":
        return min(ring, tree)
    return ring


GLOO_MAX_SEGMENT_B = 1 << 20
"""gloo's AllreduceOptionsImpl::kMaxSegmentSize (gloo/allreduce.h)."""
GLOO_ELEMENT_B = 4
"""Segments are rounded up to whole elements; the ledger records bytes, float32 assumed."""


def _gloo_ring_segments(n: int, nbytes: float) -> tuple[int, int, int]:
    """(segments, bytes per segment, bytes in all) of gloo's ring all-reduce of `nbytes`
    on n ranks: max(ceil(S / 1 MiB), 2n) segments rounded up to a multiple of n, each of
    ceil(S / segments) bytes rounded up to whole elements (gloo/allreduce.cc, `ring`)."""
    total = math.ceil(nbytes / GLOO_ELEMENT_B) * GLOO_ELEMENT_B
    segments = math.ceil(max(math.ceil(total / GLOO_MAX_SEGMENT_B), 2 * n) / n) * n
    seg_b = math.ceil(math.ceil(total / segments) / GLOO_ELEMENT_B) * GLOO_ELEMENT_B
    return segments, seg_b, total


@functools.lru_cache(maxsize=4096)
def gloo_ring_all_reduce_s(n: int, nbytes: float, alpha: float, beta: float) -> float:
    """gloo's ring all_reduce (gloo/allreduce.cc, `ring`), replayed segment by segment.

    The buffer is cut into `segments` = max(ceil(S / 1 MiB), 2n), rounded up to a multiple
    of n, of ceil(S / segments) bytes. Each of the two phases (reduce-scatter, then
    all-gather) issues segments - segments/n sends to the previous rank and as many
    receives from the next, two in flight: iteration i posts receive and send i, and from
    i = 2 on first waits for receive i - 2. A receive notifies the sender
    (ready-to-receive, one latency); a send leaves when that notification has arrived and
    the rank's link is free, takes seg / beta on it and arrives a latency later.
    With n = 2 both neighbours are one peer and gloo has one TCP connection per pair:
    the ready-to-receive then queues behind the data this rank has already written to it
    (measured, 2 ranks, 8 MiB at 100 Mbit/s + 10 ms: 791 ms; this 782, without the queue
    742). Every rank runs the same timeline (symmetric ring, one tier), so one rank's is
    replayed, segments counted full. A buffer with an empty segment (fewer than about 2n
    elements) is not symmetric: gloo skips the empty segments' sends and receives, and
    every rank is replayed (`_gloo_sparse_ring_s`).
    """
    if n <= 1 or nbytes <= 0:
        return 0.0  # gloo returns at once for 0 elements
    segments, seg_b, total = _gloo_ring_segments(n, nbytes)
    if (segments - 1) * seg_b >= total:
        return _gloo_sparse_ring_s(n, segments, seg_b, total, alpha, beta)
    seg_s = seg_b / beta
    sends = segments - segments // n
    now = link_free = 0.0
    written: list[tuple[float, float]] = []  # this rank's data: (leaves, off the link)
    queued = 0  # how many of them were written by `now`
    for _phase in ("reduce-scatter", "all-gather"):
        arrivals: list[float] = []
        for i in range(sends + 2):
            if i >= 2:
                now = max(now, arrivals[i - 2])  # waitRecv(i - 2); its send left earlier
            if i < sends:
                ready_leaves = now  # the ready-to-receive for receive i
                if n == 2:  # same connection as this rank's data: behind what is written
                    while queued < len(written) and written[queued][0] <= now:
                        queued += 1
                    if queued:
                        ready_leaves = max(now, written[queued - 1][1])
                leaves = max(ready_leaves + alpha, link_free)  # the peer's is in
                link_free = leaves + seg_s
                written.append((leaves, link_free))
                arrivals.append(link_free + alpha)
    return now


def _gloo_sparse_ring_s(n: int, segments: int, seg_b: int, total: int, alpha: float,
                        beta: float) -> float:
    """gloo's ring all-reduce of a buffer with empty segments, every rank replayed: the
    time the last rank finishes, all starting at 0.

    Rank r's iteration i of a phase sends segment k_s = ((r + 1) P + i) mod segments in
    the reduce-scatter (r P + i in the all-gather; P = segments / n) to rank r - 1, and
    receives k_s of rank r + 1's; a segment past the buffer's end is empty, and gloo posts
    and waits for nothing of it. The loop of `gloo_ring_all_reduce_s` otherwise: receive
    and send i posted, then from i = 2 the waits for receive and send i - 2. A send leaves
    when it is posted, the receiver's ready-to-receive has arrived (a latency after the
    receive was posted) and the sender's link is free; it is done once off the link, and
    arrives a latency later. One element on 2 ranks: rank 1's element leaves at alpha and
    reaches rank 0 at 2 alpha, whose reduced element reaches rank 1 at 3 alpha (3 alpha,
    where the symmetric replay charges 4); on n ranks (2n - 1) alpha.
    Tiny messages: the n = 2 queue of a notice behind this rank's data is not modelled."""
    per_rank = segments // n
    posts = segments - per_rank

    def length(k: int) -> int:
        return max(0, min(seg_b, total - (k % segments) * seg_b))

    def plan(r: int, phase: int, i: int) -> tuple[int, int]:
        """Bytes sent to r - 1 and received from r + 1 at iteration i (0: empty)."""
        first = (r + 1) * per_rank if phase == 0 else r * per_rank
        return length(first + i), length(first + per_rank + i)

    now = [0.0] * n
    link_free = [0.0] * n
    for phase in (0, 1):
        # A message is (i, sender r); its receiver r - 1 posts the receive at the same i.
        recv_posted: dict[tuple[int, int], float] = {}
        sends: list[list[tuple[int, float]]] = [[] for _ in range(n)]  # posted, in order
        off: dict[tuple[int, int], float] = {}  # the message's last byte off the link
        step = [0] * n  # each rank's next action: iteration i's waits (2i), posts (2i + 1)
        last = 2 * (posts + 2)
        while min(step) < last:
            progressed = False
            for r in range(n):
                while step[r] < last:
                    i, post = divmod(step[r], 2)
                    if not post and i >= 2:  # wait for receive and send i - 2
                        sent, received = plan(r, phase, i - 2)
                        src = (i - 2, (r + 1) % n)
                        if (received and src not in off) or (sent and (i - 2, r) not in off):
                            break
                        if received:
                            now[r] = max(now[r], off[src] + alpha)
                        if sent:
                            now[r] = max(now[r], off[(i - 2, r)])
                    elif post and i < posts:
                        sent, received = plan(r, phase, i)
                        if received:
                            recv_posted[(i, (r + 1) % n)] = now[r]
                        if sent:
                            sends[r].append((i, now[r]))
                    step[r] += 1
                    progressed = True
                for i, posted in sends[r]:  # onto r's link in order, once notified
                    if (i, r) in off:
                        continue
                    if (i, r) not in recv_posted:
                        break
                    leaves = max(posted, recv_posted[(i, r)] + alpha, link_free[r])
                    link_free[r] = off[(i, r)] = leaves + plan(r, phase, i)[0] / beta
                    progressed = True
            if not progressed:  # cannot happen in gloo's ring; guard against a hang
                raise RuntimeError("gloo ring replay made no progress")
    return max(now)


def reduce_scatter_s(n: int, nbytes: float, tier: Tier, algorithm: str = "naive") -> float:
    """Ring reduce-scatter of an S-byte input: (n-1)(h a + S/(n b)), h = 2 on gloo else 1."""
    _check(n, nbytes)
    h = handshakes(check_algorithm(algorithm))
    return (n - 1) * (h * tier.latency_s + nbytes / (n * tier.bandwidth_Bps))


def all_gather_s(n: int, nbytes: float, tier: Tier, algorithm: str = "naive") -> float:
    """Ring all-gather, S = per-rank bytes: (n-1)(h a + S/b), h = 2 on gloo else 1."""
    _check(n, nbytes)
    h = handshakes(check_algorithm(algorithm))
    return (n - 1) * (h * tier.latency_s + nbytes / tier.bandwidth_Bps)


def all_to_all_s(n: int, nbytes: float, tier: Tier, algorithm: str = "naive") -> float:
    """All-to-all of an S-byte buffer (S/n to each rank): the n-1 messages leave over the
    rank's one link together, h a + (n-1) S/(n b) (h = 2 on gloo: each waits for its
    peer's ready-to-receive, all posted at once; as a symmetric exchange)."""
    _check(n, nbytes)
    if n == 1:
        return 0.0
    h = handshakes(check_algorithm(algorithm))
    return h * tier.latency_s + (n - 1) * nbytes / (n * tier.bandwidth_Bps)


def quantized_all_reduce_s(n: int, nbytes: float, tier: Tier,
                           algorithm: str = "naive") -> float:
    """A compressed mean of S coded bytes (algorithms/collectives.py `quantized_average`): the
    all-to-all of the coded shards, then the ring all-gather of each rank's coded mean
    (S/n bytes), every backend's own formulas; the local decode and reduce are compute."""
    return (all_to_all_s(n, nbytes, tier, algorithm)
            + all_gather_s(n, nbytes / n, tier, algorithm))


def broadcast_s(n: int, nbytes: float, tier: Tier, algorithm: str = "naive") -> float:
    """Binomial tree L(h a + S/b) (naive, gloo); pipelined ring (n-1)a + S/b (nccl*).

    The binomial tree is the textbook MPICH short-message model; for large messages it
    over-estimates (rare here: initial weight syncs).
    """
    _check(n, nbytes)
    check_algorithm(algorithm)
    if n == 1:
        return 0.0
    if algorithm.startswith("nccl"):
        return (n - 1) * tier.latency_s + nbytes / tier.bandwidth_Bps
    h = handshakes(algorithm)
    return _log2(n) * (h * tier.latency_s + nbytes / tier.bandwidth_Bps)


TCP_MIN_RTO_S = 0.2
"""Linux's minimum retransmission timeout (tcp_rto_min); RTO ~ this + one round trip."""


def slow_start_extra_s(nbytes: float, tier: Tier, idle_s: float = math.inf) -> float:
    """Extra seconds to send one `nbytes` message over a TCP connection of `tier` that has
    been idle for `idle_s` (math.inf: never used).

    r = `tier.round_trip_s` (netprobe's measured round trip, else 2 alpha), b = beta.
    Linux restarts the congestion window after an idle longer than the RTO (RTO =
    TCP_MIN_RTO_S + r; `tcp_slow_start_after_idle`, on by default): it halves the window
    once for every further RTO idle, down to the initial window w0 =
    `tcp_initial_window_B`. The window before the idle is taken to be what the message
    needs, S, unless losses cap it first, at the bandwidth-delay product plus the queue
    the bottleneck holds (`tcp_queue_s`): min(S, b * (r + queue)). Measured on the shaped
    links (docs/network-model.md, "TCP slow start after idle"): a connection carrying one
    499 kB exchange per 0.25 s of idle paid about a round trip of ramp at 1 Gbit/s +
    10 ms; at 100 Mbit/s + 10 ms behind a 20 ms queue none, behind a 2 ms one a ramp and
    losses. From there the window doubles every round trip until it covers the message or
    the bandwidth-delay product; each such round costs a round trip instead of w / b.
    Extra = sum over those rounds of (r - w_i / b). 0 for a tier without TCP slow start
    (window None), an idle shorter than the RTO, or a message inside the window.
    """
    w0 = tier.tcp_initial_window_B
    rtt, beta = tier.round_trip_s, tier.bandwidth_Bps
    if w0 is None or nbytes <= w0 or not idle_s > TCP_MIN_RTO_S + rtt:
        return 0.0
    bdp = beta * rtt
    halvings = min(64, math.ceil(min(idle_s, 1e9) / (TCP_MIN_RTO_S + rtt)) - 1)
    window = max(w0, min(nbytes, beta * (rtt + tier.tcp_queue_s)) / 2**halvings)
    sent = extra = 0.0
    while sent + window < nbytes and window < bdp:
        sent += window
        extra += rtt - window / beta
        window *= 2
    return extra


def exchange_s(peer_nbytes: list[float], tier: Tier, algorithm: str = "naive",
               idle_s: float = 0.0) -> float:
    """A symmetric exchange with peers over one link of `tier`: h a + sum(S_p) / b (h = 2
    on gloo: each send waits for the peer's ready-to-receive, posted at the same moment),
    times the ratio netprobe measured on the tier (`Tier.exchange_factor`, 1 without), plus
    the slowest peer's TCP ramp after `idle_s` (the projection's exchange, for one link:
    bench/network/model.py)."""
    h = handshakes(check_algorithm(algorithm))
    ramp = max((slow_start_extra_s(s, tier, idle_s) for s in peer_nbytes), default=0.0)
    scale = max((tier.exchange_factor(s) for s in peer_nbytes), default=1.0)
    return scale * (h * tier.latency_s + sum(peer_nbytes) / tier.bandwidth_Bps) + ramp


def resolve(op: str, n: int, nbytes: float, tier: Tier, algorithm: str) -> str:
    """The algorithm that runs: `nccl` is the cheaper of nccl-ring and nccl-tree for
    all_reduce (as `all_reduce_s` prices it) and nccl-ring otherwise; others are themselves."""
    if algorithm != "nccl":
        return algorithm
    if op == "all_reduce" and (all_reduce_s(n, nbytes, tier, "nccl-tree")
                               < all_reduce_s(n, nbytes, tier, "nccl-ring")):
        return "nccl-tree"
    return "nccl-ring"


def first_message_bytes(op: str, n: int, nbytes: float, algorithm: str) -> float:
    """The bytes of the first message an op sends on each link (what slow start ramps up
    for): a ring step's chunk S/n (all_reduce, reduce_scatter), the whole S for
    all_gather, broadcast, the tree all_reduce and point-to-point."""
    if op == "barrier" or n <= 1:
        return 0.0
    if op in ("all_reduce", "reduce_scatter", "quantized_all_reduce") \
            and algorithm != "nccl-tree":
        return nbytes / n
    return float(nbytes)


def p2p_s(nbytes: float, tier: Tier, algorithm: str = "naive") -> float:
    """One message: a + S/b (every backend)."""
    _check(1, nbytes)
    check_algorithm(algorithm)
    return tier.latency_s + nbytes / tier.bandwidth_Bps


def barrier_s(n: int, nbytes: float, tier: Tier, algorithm: str = "naive") -> float:
    """An all-reduce of nothing: its latency terms. On gloo 4(n-1) a, the ring's two
    handshakes per step (gloo's barrier is its own algorithm; not measured here)."""
    _check(n, nbytes)
    if check_algorithm(algorithm) == "gloo":
        return 4 * (n - 1) * tier.latency_s
    return all_reduce_s(n, 0, tier, algorithm)


COLLECTIVES: dict[str, Callable[..., float]] = {
    "all_reduce": all_reduce_s,
    "reduce_scatter": reduce_scatter_s,
    "broadcast": broadcast_s,
    "all_gather": all_gather_s,
    "barrier": barrier_s,
    "quantized_all_reduce": quantized_all_reduce_s,
}
P2P = ("send", "recv", "exchange")
# Names DeepSpeed's comms logger uses for the same collectives (algorithms/zero.py copies
# them into the ledger).
ALIASES = {
    "inference_all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_fn": "reduce_scatter",
    "reduce_scatter_base": "reduce_scatter",
    "all_gather_into_tensor": "all_gather",
    "allgather_fn": "all_gather",
    "all_gather_base": "all_gather",
}


def canonical_op(op: str) -> str:
    op = ALIASES.get(op, op)
    if op not in COLLECTIVES and op not in P2P:
        known = sorted([*COLLECTIVES, *P2P, *ALIASES])
        raise ValueError(f"cannot model comm op {op!r}; known ops: {known}")
    return op


def wire_bytes(record, backend: str | None = None) -> float:
    """Modelled bytes this rank SENDS on the wire for one CommRecord.

    all_reduce: ring 2(n-1)/n S, tree (nccl-tree) 2S; reduce_scatter (n-1)/n S;
    all_gather (n-1) S (S = this rank's contribution; ring forwarding); broadcast
    (n-1)/n S (the n-1 copies of S that cross the network, averaged over the ranks);
    quantized_all_reduce 2(n-1)/n S (the all-to-all's (n-1)/n S, the all-gather's
    (n-1) S/n); send S; recv 0 (received, not sent); exchange S (nbytes is already the sum
    sent to all peers); barrier 0. A group of one sends nothing.
    """
    algorithm = check_algorithm(backend or "naive")
    op = canonical_op(record.op)
    n, s = record.group_size, float(record.nbytes)
    if op in P2P:
        return 0.0 if op == "recv" else s
    if n <= 1 or op == "barrier":
        return 0.0
    if op == "all_reduce":
        return 2 * s if algorithm == "nccl-tree" else 2 * (n - 1) / n * s
    if op == "quantized_all_reduce":
        return 2 * (n - 1) / n * s
    if op == "reduce_scatter" or op == "broadcast":
        return (n - 1) / n * s
    return (n - 1) * s  # all_gather
