"""`commbench netprobe`'s measurement: what each rank times on its links (rows for the fit).

    pytest tests/test_netprobe.py   (real gloo ranks: `probe` on 2 and 4 ranks)

Run on every rank under torchrun by bench/node/netprobe.py; the rows it returns on rank 0 are
fitted by bench/node/netprobe_fit.py. Per tier (`intra`: ranks of one node; `inter`: one rank
per node, node = rank // ranks_per_node), rank 0 measures:
- p2p ping-pong between two ranks (one-way time = round trip / 2);
- all_reduce, all_gather and broadcast on a group of that tier (the ops the ledger records);
- a two-way exchange between two ranks as gossip runs it: both compute for
  `--exchange-gap` seconds, then send S to each other at once over one connection, no
  barrier. The gap stays under TCP's minimum RTO (0.2 s), so the exchange is measured on
  a warm connection: the projection adds the ramp after a longer idle (a gossip round)
  itself (bench/network/costs.py `slow_start_extra_s`). First, untimed,
  `EXCHANGE_WARMUPS` exchanges back to back open the window whatever the earlier ops
  left; it is timed over at least `EXCHANGE_ROUNDS` rounds (the window a connection
  settles to when it exchanges every gap, as gossip's does over a run);
- all_reduce inside a step: every rank computes `--step-compute` seconds, then runs it,
  no barrier between, as training does; the op's time is the last rank to arrive's;
- with gloo (TCP), what slow start after an idle depends on (`_tcp_link`): the round trip
  (the smallest of `RTT_PINGS` one-element ping-pongs on an idle connection of their own)
  and the queue one bulk flow keeps standing at the bottleneck (the median ping-pong
  while a `BURST_S` transfer runs over the ranks' main connection, minus that round trip);
at each message size, the median of `--iters` timed repetitions (the exchange: at least
`EXCHANGE_ROUNDS`) after one warm-up.
Torch is imported inside the functions that run on the ranks.
"""

from __future__ import annotations

import math
import os
import statistics
import time

SYNCED_OPS = ("p2p", "all_reduce", "all_gather", "broadcast")
"""Timed between barriers: the alpha-beta fit."""
EXCHANGE = "exchange"
"""Two ranks send S to each other at once over one connection, after `--exchange-gap` of
compute (a gossip round), no barrier."""
IN_STEP = "all_reduce_in_step"
"""all_reduce right after `--step-compute` seconds of compute, no barrier: the drift fit."""
OPS = (*SYNCED_OPS, EXCHANGE, IN_STEP)
ROUND_TRIP = "round_trip"
"""gloo only: the idle link's round trip (the smallest one-element ping-pong)."""
QUEUE = "tcp_queue"
"""gloo only: the median ping-pong under one bulk flow, minus the round trip."""
RTT_PINGS = 20
"""One-element ping-pongs on the idle connection; the round trip is the smallest."""
BURST_S = 0.5
"""The bulk flow of the queue measurement lasts about this long (or `FLOW_RTTS` round
trips, if longer) at the best rate p2p measured over `--sizes` (its size held to
`BURST_BYTES`), and the ping-pongs run over its first half (`flow_plan`): a few round
trips of slow start take the window past the bandwidth-delay product into the queue. On
the lab's links (20 ms tbf queues; run y, 3 probes each) the standing queue was 4.1-5.2
ms at 1 Gbit/s + 1 ms, 3.1-3.8 ms at 1 Gbit/s + 10 ms, 10.3-11.6 ms at 100 Mbit/s + 1 ms
and 5.0-5.2 ms at 100 Mbit/s + 10 ms: one CUBIC flow backs off at each loss, so it keeps
less than the whole buffer standing."""
FLOW_RTTS = 24
"""The flow's least length in idle round trips: on long round trips slow start alone
takes log2(bandwidth-delay product / initial window) of them (9 at 1 Gbit/s + 50 ms).
Pings while the window still ramps read below the queue: a low `tcp_queue` charges more
ramp after idles, which costs gossip and DiLoCo more than DDP."""
MAX_FLOW_S = 10.0
"""The flow's longest planned length (a link far slower than p2p measured ends later)."""
BURST_BYTES = (4 * 2**20, 256 * 2**20)
EXCHANGE_WARMUPS = 3
"""Back-to-back exchanges before the timed ones, so that the window they find is the one
a connection sending S keeps, not what the earlier ops (other sizes) left it."""
EXCHANGE_ROUNDS = 15
"""Timed exchanges per size, at least (more with a larger `--iters`): on a short round trip
the window keeps growing over a connection's first gap-separated exchanges. In the lab at
1 Gbit/s + 1 ms, 512 KiB each way, 5 rounds read 7.7-11.5 ms over 3 probes and 15 rounds
6.8-8.1 ms over 4; GASLoC's 19 exchanges of 487 kB read 8.2-8.3 ms in each replicate of
one lab run and 9.2-9.8 ms in the next, when netprobe's 15 rounds read 8.2-9.6 ms
(docs/network-model.md, Results)."""
DEFAULT_STEP_COMPUTE_S = 0.05
DEFAULT_EXCHANGE_GAP_S = 0.1
"""Under TCP's minimum RTO, with room: with a gap of 0.2 s (a gossip round of the lab's)
the kernel's RTO (0.2 s + the smoothed round trip) decided from one replicate to the next
whether the probe's exchanges restarted slow start: at 1 Gbit/s + 10 ms x0.91 or x1.54."""
ELEMENT = 4
"""Bytes of one element of the probe's float32 tensors: the smallest message."""


def flow_plan(rate_Bps: float, rtt_s: float) -> tuple[int, float]:
    """(bytes, seconds of ping-pongs) of `_tcp_link`'s bulk flow on a link p2p measured at
    `rate_Bps` with round trip `rtt_s`: the flow lasts D = max(`BURST_S`, `FLOW_RTTS`
    round trips), at most `MAX_FLOW_S`, at that rate, its bytes held to `BURST_BYTES` (whole
    float32 elements); the pings run over the first half of the flow as planned, and never
    past D, whatever the rate (a rate measured far too low would otherwise ping for
    hours, on an idle link once the flow is done)."""
    duration = min(max(BURST_S, FLOW_RTTS * rtt_s), MAX_FLOW_S)
    rate = max(rate_Bps, 1.0)
    lo, hi = BURST_BYTES
    nbytes = int(min(max(rate * duration, lo), hi)) // ELEMENT * ELEMENT
    return nbytes, min(nbytes / rate / 2, duration)


def standing_queue(idle_s: list[float], loaded_s: list[float]) -> tuple[float, float]:
    """(round trip, standing queue) from ping-pongs on the idle link and under the flow:
    the smallest idle one, and the median loaded one minus it (0 if below)."""
    rtt = min(idle_s)
    return rtt, max(0.0, statistics.median(loaded_s) - rtt)


def probe_device(backend: str):
    """The device the probe's tensors live on: NCCL moves CUDA tensors only, so with
    --backend nccl each rank takes its local GPU (LOCAL_RANK), set as current before the
    process group's first op; gloo: the CPU."""
    import torch

    if backend != "nccl":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("netprobe --backend nccl needs a CUDA device on every rank (none "
                         "here); use --backend gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device


def probe(rank: int, world_size: int, ranks_per_node: int, sizes, iters: int,
          device=None, step_compute_s: float = DEFAULT_STEP_COMPUTE_S,
          exchange_gap_s: float = DEFAULT_EXCHANGE_GAP_S, tcp: bool = False) -> list[dict]:
    """Measure every (tier, op, size) on the initialised default group; rows on rank 0 only.
    Tensors live on `device` (default CPU); on CUDA each op is timed to its completion
    (NCCL returns to the host before it). `tcp` (gloo): also each tier's round trip and
    standing queue (`_tcp_link`)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu") if device is None else device

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if world_size < 2 or world_size % ranks_per_node:
        raise ValueError(f"netprobe needs world_size >= 2 divisible by ranks_per_node, got "
                         f"{world_size} and {ranks_per_node}")
    nodes = world_size // ranks_per_node
    groups = {}  # tier -> (ranks, process group); created on every rank in the same order
    if ranks_per_node > 1:
        for node in range(nodes):
            ranks = list(range(node * ranks_per_node, (node + 1) * ranks_per_node))
            pg = dist.new_group(ranks)
            if node == 0:
                groups["intra"] = (ranks, pg)
    if nodes > 1:
        for local in range(ranks_per_node):
            ranks = list(range(local, world_size, ranks_per_node))
            pg = dist.new_group(ranks)
            if local == 0:
                groups["inter"] = (ranks, pg)
    # the ping-pongs of `_tcp_link` on a connection of their own (a group of the pair)
    pings = {tier: dist.new_group(ranks[:2]) for tier, (ranks, _) in groups.items()} if tcp else {}
    work = torch.randn(64, 64, device=device)

    def compute(seconds):  # CPU- (or GPU-) bound work, as a training step's
        sync()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            torch.mm(work, work)
            sync()

    def run_op(op, buf, ranks, pg):
        peer = ranks[1]
        if op == "p2p":
            if rank == ranks[0]:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            elif rank == peer:
                dist.recv(buf, ranks[0])
                dist.send(buf, ranks[0])
        elif op == EXCHANGE:
            if rank in (ranks[0], peer):
                other = peer if rank == ranks[0] else ranks[0]
                back = torch.empty_like(buf)
                # the receive first, as Communicator.exchange posts it (gloo's notice
                # must not queue behind this rank's payload: docs/network-model.md)
                for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, back, other),
                                                 dist.P2POp(dist.isend, buf, other)]):
                    w.wait()
        elif rank in ranks:
            if op in ("all_reduce", IN_STEP):
                dist.all_reduce(buf, group=pg)
            elif op == "broadcast":
                dist.broadcast(buf, src=ranks[0], group=pg)
            else:
                dist.all_gather([torch.empty_like(buf) for _ in ranks], buf, group=pg)
        sync()

    rows = []
    for tier, (ranks, pg) in groups.items():
        p2p_Bps = 0.0  # the best one-way rate p2p measured: sizes the bulk flow of `_tcp_link`
        for size in sizes:
            buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
            for op in OPS:
                if op in (IN_STEP, EXCHANGE):  # no barrier: the ranks arrive from compute
                    mine = []
                    dist.barrier()
                    for _ in range(EXCHANGE_WARMUPS if op == EXCHANGE else 0):
                        run_op(op, buf, ranks, pg)
                    rounds = iters if op == IN_STEP else max(iters, EXCHANGE_ROUNDS)
                    for _ in range(rounds + 1):
                        compute(step_compute_s if op == IN_STEP else exchange_gap_s)
                        t0 = time.perf_counter()
                        run_op(op, buf, ranks, pg)
                        mine.append(time.perf_counter() - t0)
                    # the op from the moment every rank is in: the last to arrive's time
                    # (ranks outside the op's group or pair: inf)
                    inside = ranks if op == IN_STEP else ranks[:2]
                    every = torch.tensor(mine if rank in inside else [math.inf] * len(mine),
                                         dtype=torch.float64, device=device)
                    dist.all_reduce(every, op=dist.ReduceOp.MIN)
                    times = every.tolist()[1:]  # the first round is a warm-up
                else:
                    times = []
                    for i in range(iters + 1):
                        dist.barrier()
                        sync()
                        t0 = time.perf_counter()
                        run_op(op, buf, ranks, pg)
                        # the op's time is the slowest rank's (a root's broadcast returns early)
                        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64,
                                               device=device)
                        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                        if i:  # the first round is a warm-up (connection set-up)
                            times.append(elapsed.item() / 2 if op == "p2p" else elapsed.item())
                    if op == "p2p":
                        p2p_Bps = max(p2p_Bps, buf.numel() * 4 / statistics.median(times))
                if rank == 0:
                    n = 2 if op in ("p2p", EXCHANGE) else len(ranks)
                    rows.append(dict(tier=tier, op=op, n=n, nbytes=buf.numel() * 4,
                                     seconds=statistics.median(times),
                                     **({"idle_s": exchange_gap_s} if op == EXCHANGE else {})))
        if tier in pings:
            link = _tcp_link(rank, ranks[:2], pings[tier], p2p_Bps)
            if rank == 0:
                rows += [dict(tier=tier, op=op, n=2, **row) for op, row in link.items()]
    dist.barrier()
    return rows


def _tcp_link(rank: int, pair: list[int], pings, rate_Bps: float) -> dict[str, dict]:
    """The pair's round trip and standing queue ({ROUND_TRIP: row, QUEUE: row} on its first
    rank, {} elsewhere). The first rank drives: `RTT_PINGS` one-element ping-pongs on the
    `pings` group's connection, idle; then a bulk transfer (`flow_plan`) over the world
    group's connection to the second rank, ping-ponging through its first half. A
    ping-pong's packets queue behind the bulk flow's at the sender's bottleneck (a FIFO;
    a fair-queueing qdisc or a path the ping's connection hashes onto apart shows less):
    the median loaded ping-pong minus the idle round trip is the queue (`standing_queue`)."""
    import torch
    import torch.distributed as dist

    first, second = pair
    if rank not in pair:
        return {}
    one = torch.zeros(1)

    def ping(value: float) -> float:  # the first rank's ping-pong; 0 ends the answering
        one.fill_(value)
        t0 = time.perf_counter()
        dist.send(one, second, group=pings)
        dist.recv(one, second, group=pings)
        return time.perf_counter() - t0

    def answer() -> None:  # the second rank's side, until a ping of 0
        while True:
            dist.recv(one, first, group=pings)
            dist.send(one, first, group=pings)
            if one.item() == 0:
                return

    size = torch.tensor([0], dtype=torch.float64)
    if rank == first:
        idle = [ping(1) for _ in range(RTT_PINGS)]
        ping(0)
        nbytes, ping_s = flow_plan(rate_Bps, min(idle))
        size.fill_(nbytes // ELEMENT)
        dist.send(size, second, group=pings)
    else:
        answer()
        dist.recv(size, first, group=pings)
    bulk = torch.zeros(int(size.item()))
    if rank == first:
        flow = dist.isend(bulk, second)
        loaded = []
        end = time.perf_counter() + ping_s
        while time.perf_counter() < end or not loaded:
            loaded.append(ping(1))
        ping(0)
    else:
        flow = dist.irecv(bulk, first)
        answer()
    flow.wait()
    if rank != first:
        return {}
    rtt, queue = standing_queue(idle, loaded)
    return {ROUND_TRIP: dict(nbytes=ELEMENT, seconds=rtt),
            QUEUE: dict(nbytes=bulk.numel() * ELEMENT, seconds=queue,
                        loaded_s=statistics.median(loaded), pings=len(loaded))}

