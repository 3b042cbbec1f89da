"""`commbench netprobe`: measure this cluster's links and fit a network profile to them.

    commbench netprobe --world-size 4 --out my-net.yaml [--ranks-per-node 2]
        [--sizes 4KiB 256KiB 4MiB] [--iters 5] [--backend gloo]
    commbench run CONFIG --set network.profiles=[my-net.yaml]

Exercised by `pytest tests/test_netprobe.py`. Launched like a run: torchrun on this machine
(`--nnodes N --rdzv-endpoint HOST:PORT` once per node for several nodes). Rank 0 measures,
per tier (`intra`: ranks of one node; `inter`: one rank per node, node = rank //
ranks_per_node):
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
It then fits, per tier, by least squares on relative errors with the SAME formulas the
projection uses for `--backend` (bench/network/costs.py):
- alpha and beta on the barrier-synchronised ops: linear least squares on (alpha, 1/beta),
  refined on the formulas themselves where they are not linear in them (gloo's
  segment-level all_reduce);
- the exchange is measured, not fitted: its time against the projection's formula at
  each size is the tier's `exchange_scale` ([bytes, ratio] pairs), which the projection
  multiplies gossip's exchanges by (interpolated between the sizes). On TCP links whose
  round trip is short and whose messages span several windows it is above 1: the
  congestion window stays below the bandwidth-delay product (1.2-2 at 1 Gbit/s + 1 ms
  in the shaped-link lab, docs/network-model.md), which the alpha-beta formula lacks;
- the drift: the latency every message of a step's op pays on top of alpha because the
  ranks come to it from compute (their communication threads wake, slower ranks are
  waited for) on the in-step points. The profile's latency is alpha + drift: what runs
  see; alpha and the drift are kept under `fit:`.
The fit's residuals are printed and stored under each tier's `fit:` in the YAML, which
`get_profile(path)` loads.
With one rank per node (the default locally) only `inter` is measured and `intra` is a copy.
With gloo the tiers also get TCP's initial window, the measured round trip (`tcp_rtt`) and
standing queue (`tcp_queue`): the ramp after an idle (bench/network/costs.py
`slow_start_extra_s`) runs on them, not on the fitted alpha, which holds the backend's
per-message cost as well (1.2-1.6 ms against a 1.05 ms one-way link at 1 Gbit/s + 1 ms
in the shaped-link lab, docs/network-model.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
import time
from pathlib import Path

import yaml

from bench import torchrun
from bench.network import costs
from bench.network.profiles import LINUX_TCP_INITIAL_WINDOW_B, Tier, parse_tier

DEFAULT_SIZES = ("4KiB", "64KiB", "1MiB", "4MiB")
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
_UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "kB": 10**3, "KB": 10**3,
          "MB": 10**6, "GB": 10**9}


def parse_size(text: str) -> int:
    """Bytes from '4096', '64KiB', '1MiB', '1MB' ..."""
    num = text.rstrip("".join(sorted({c for u in _UNITS for c in u})))
    unit = text[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1
    if unit not in _UNITS or not 0 < value < math.inf or value * _UNITS[unit] > MAX_SIZE:
        raise ValueError(f"netprobe --sizes entries must be a size like 4096, 64KiB, 1MiB "
                         f"(units {sorted(_UNITS)}; at most 4GiB), got {text!r}")
    size = int(value * _UNITS[unit])
    if size < ELEMENT:
        raise ValueError(f"netprobe --sizes {text!r} is {size} bytes, less than one element "
                         f"(the probe sends float32 tensors: valid sizes are >= {ELEMENT} "
                         "bytes)")
    return size


ELEMENT = 4
"""Bytes of one element of the probe's float32 tensors: the smallest message."""
MAX_SIZE = 4 * 2**30
"""The largest message netprobe sends (each rank holds a few of its buffers)."""


def check_args(args) -> None:
    """The `commbench netprobe` arguments, before torchrun starts (ValueError naming the
    option, the value and what is valid)."""
    if not 0 <= args.step_compute <= 60:
        raise ValueError(f"netprobe --step-compute must be from 0 to 60 seconds, got "
                         f"{args.step_compute}")
    if not 0 <= args.exchange_gap < costs.TCP_MIN_RTO_S:
        raise ValueError(f"netprobe --exchange-gap must be from 0 to under "
                         f"{costs.TCP_MIN_RTO_S:g} seconds (TCP's minimum RTO: the exchange is "
                         f"measured warm, the projection adds the ramp after longer idles), got "
                         f"{args.exchange_gap}")
    for option, value, low in (("--world-size", args.world_size, 2), ("--iters", args.iters, 1),
                               ("--nnodes", args.nnodes, 1),
                               ("--ranks-per-node", args.ranks_per_node, 1)):
        if value < low:
            raise ValueError(f"netprobe {option} must be >= {low}, got {value}"
                             + (" (a link needs two ranks)" if option == "--world-size" else ""))
    if args.world_size % args.ranks_per_node or args.world_size % args.nnodes:
        raise ValueError(f"netprobe --world-size ({args.world_size}) must be divisible by "
                         f"--ranks-per-node ({args.ranks_per_node}) and --nnodes "
                         f"({args.nnodes})")
    for option in ("timeout", "rdzv_timeout"):
        value = getattr(args, option)
        if not 0 < value < math.inf:
            raise ValueError(f"netprobe --{option.replace('_', '-')} must be a finite number "
                             f"of seconds > 0, got {value}")
    sizes = {parse_size(size) for size in args.sizes}
    if len(sizes) < 2:
        raise ValueError(f"netprobe --sizes {' '.join(args.sizes)}: give at least two "
                         "different sizes (latency and bandwidth are fitted from how the time "
                         "grows with the size), e.g. --sizes 4KiB 4MiB")
    _check_out(args.out)


def _check_out(out: str) -> None:
    """--out must be a file path whose existing parents are directories (else the ranks
    measure for minutes, then fail writing)."""
    path = Path(out).expanduser().absolute()
    if path.is_dir():
        raise ValueError(f"netprobe --out {out!r} is a directory; give a file path, e.g. "
                         f"{str(Path(out) / 'netprobe-profile.yaml')!r}")
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"netprobe --out {out!r}: {str(parent)!r} is a file, not a "
                             "directory (give a path whose parents are directories)")


# ---------------------------------------------------------------------- measuring (per rank)


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


# ---------------------------------------------------------------------- fitting


def model_s(op: str, n: int, nbytes: float, tier: Tier, algorithm: str) -> float:
    """The projection's seconds for one measured point (p2p: one message; the exchange on
    a warm connection: a gossip round is shorter than TCP's idle restart)."""
    if op == "p2p":
        return costs.p2p_s(nbytes, tier, algorithm)
    if op == EXCHANGE:
        return costs.exchange_s([nbytes], tier, algorithm)
    return costs.COLLECTIVES["all_reduce" if op == IN_STEP else op](n, nbytes, tier, algorithm)


def coefficients(op: str, n: int, nbytes: float, algorithm: str) -> tuple[float, float]:
    """(k_a, k_b): the formula's seconds for `nbytes` at (alpha = 1, beta = inf) and, per
    byte, at (alpha = 0, beta = 1). For a formula k_a * alpha + k_b * S / beta these are
    exact; for gloo's all_reduce (a max-plus recurrence) they are its two limits (its
    latencies depend on the size: a one-element buffer skips empty segments)."""
    k_a = model_s(op, n, nbytes, Tier(1.0, 1e300), algorithm)
    k_b = model_s(op, n, nbytes, Tier(0.0, 1.0), algorithm) / nbytes if nbytes else 0.0
    return k_a, k_b


def _residuals(rows: list[dict], tier: Tier, algorithm: str) -> list[dict]:
    out = []
    for r in rows:
        m = model_s(r["op"], r["n"], r["nbytes"], tier, algorithm)
        out.append(dict(op=r["op"], n=r["n"], nbytes=int(r["nbytes"]),
                        measured_s=float(r["seconds"]), model_s=float(m),
                        rel_residual=float((r["seconds"] - m) / r["seconds"])))
    return out


def _fit_alpha_beta(rows: list[dict], algorithm: str) -> Tier:
    """alpha, beta minimising the relative squared error of the synchronised ops' points:
    linear least squares on (alpha, 1/beta) with `coefficients`, then (formulas that are
    not linear in them: gloo's all_reduce) refined by bounded least squares on the model
    itself, from there."""
    import numpy as np
    from scipy.optimize import least_squares

    a = np.array([coefficients(r["op"], r["n"], r["nbytes"], algorithm) for r in rows])
    design = np.stack([a[:, 0], a[:, 1] * [r["nbytes"] for r in rows]], axis=1)
    t = np.array([r["seconds"] for r in rows])
    weighted = design / t[:, None]
    ones = np.ones_like(t)
    (alpha, inv_beta), *_ = np.linalg.lstsq(weighted, ones, rcond=None)
    if alpha < 0 or inv_beta <= 0:
        # Non-negative least squares over 2 unknowns: the optimum lies on a boundary. beta
        # must stay finite, so the boundary is alpha = 0 (latency below the noise).
        alpha = 0.0
        inv_beta = float(np.linalg.lstsq(weighted[:, 1:], ones, rcond=None)[0][0])
    if not inv_beta > 0:
        raise ValueError(f"netprobe could not fit a positive bandwidth (1/beta = {inv_beta:.3g}); "
                         "use larger --sizes so that transfer time dominates")

    def model(x):
        tier = Tier(float(x[0]), 1.0 / float(x[1]))
        return np.array([model_s(r["op"], r["n"], r["nbytes"], tier, algorithm) for r in rows])

    scale = np.array([max(alpha, 1e-3 * float(np.min(t))), inv_beta])
    refined = least_squares(lambda x: (t - model(x * scale)) / t, [alpha / scale[0], 1.0],
                            bounds=([0.0, 1e-9], [np.inf, np.inf]), diff_step=1e-4)
    alpha, inv_beta = (float(v) for v in refined.x * scale)
    return Tier(alpha, 1.0 / inv_beta)


def _fit_drift(rows: list[dict], base: Tier, algorithm: str) -> float:
    """The drift d >= 0 minimising the relative squared error of the in-step points priced
    at latency alpha + d (bounded least squares, as `_fit_alpha_beta` refines)."""
    import numpy as np
    from scipy.optimize import least_squares

    t = np.array([r["seconds"] for r in rows])

    def rel(x):
        tier = dataclasses.replace(base, latency_s=base.latency_s + float(x[0]))
        return (t - np.array([model_s(r["op"], r["n"], r["nbytes"], tier, algorithm)
                              for r in rows])) / t

    scale = max(base.latency_s, 1e-6)  # the step least_squares takes is relative to this
    fit = least_squares(lambda x: rel(x * scale), [0.1], bounds=([0.0], [np.inf]),
                        diff_step=1e-3)
    return float(fit.x[0] * scale)


def exchange_scale(rows: list[dict], tier: Tier, algorithm: str
                   ) -> tuple[tuple[float, float], ...]:
    """The measured exchange against the projection's, per size: ((bytes, ratio), ...).

    The ratio is (measured - TCP's ramp after the probe's idle) / the warm formula on
    `tier` (alpha + drift, as the projection prices it), so that the projection, which
    scales the warm formula by it and adds the ramp of its own idle, gives back what was
    measured. TCP's congestion window is what the formula lacks: on short round trips it
    stays below the bandwidth-delay product (docs/network-model.md)."""
    plain = dataclasses.replace(tier, exchange_scale=())
    by_size: dict[int, list[float]] = {}
    for r in rows:
        ramp = costs.slow_start_extra_s(r["nbytes"], tier, r.get("idle_s", 0.0))
        warm = model_s(EXCHANGE, r["n"], r["nbytes"], plain, algorithm)
        by_size.setdefault(int(r["nbytes"]), []).append(max(r["seconds"] - ramp, 1e-9) / warm)
    return tuple((float(s), statistics.median(v)) for s, v in sorted(by_size.items()))


def fit_tier(rows: list[dict], algorithm: str, tcp_window: float | None = None
             ) -> tuple[Tier, dict]:
    """A tier fitted to one tier's measured points (`probe`'s rows) and its fit record.

    alpha, beta from the synchronised ops (`_fit_alpha_beta`); the drift from the in-step
    points; the exchange's measured ratio to its formula (`exchange_scale`). The tier's
    latency is alpha + drift (what an op inside a step sees)."""
    if algorithm == "nccl":
        algorithm = "nccl-ring"  # the fit needs one formula, not the cheaper of two
    synced = [r for r in rows if r["op"] in SYNCED_OPS]
    if not synced:
        raise ValueError("netprobe has no synchronised points to fit alpha and beta to")
    base = _fit_alpha_beta(synced, algorithm)
    base = dataclasses.replace(base, tcp_initial_window_B=tcp_window)
    if tcp_window is not None:  # the link under TCP's slow start, as measured (gloo)
        link = {r["op"]: r["seconds"] for r in rows if r["op"] in (ROUND_TRIP, QUEUE)}
        base = dataclasses.replace(base, tcp_rtt_s=link.get(ROUND_TRIP),
                                   tcp_queue_s=link.get(QUEUE, 0.0))
    in_step = [r for r in rows if r["op"] == IN_STEP]
    drift = _fit_drift(in_step, base, algorithm) if in_step else 0.0
    tier = dataclasses.replace(base, latency_s=base.latency_s + drift)
    exchanges = [r for r in rows if r["op"] == EXCHANGE]
    tier = dataclasses.replace(tier, exchange_scale=exchange_scale(exchanges, tier, algorithm))
    residuals = (_residuals(synced + exchanges, base, algorithm)
                 + _residuals(in_step, tier, algorithm))
    rel = [r["rel_residual"] for r in residuals if r["op"] != EXCHANGE]  # the fitted points
    fit = dict(points=sum(r["op"] in OPS for r in rows), algorithm=algorithm,
               link_latency_s=base.latency_s,
               drift_s=drift,
               rms_rel_residual=math.sqrt(sum(e * e for e in rel) / len(rel)),
               max_abs_rel_residual=max(abs(e) for e in rel), residuals=residuals)
    return tier, fit


def fit_profile(rows: list[dict], backend: str, name: str, description: str) -> dict:
    """The profile YAML document (tiers + profiles) for `rows` measured by `probe`."""
    costs.check_algorithm(backend)
    # gloo runs over TCP: slow start on idle connections (the probe itself times warm
    # ones, after a warm-up round)
    window = LINUX_TCP_INITIAL_WINDOW_B if backend == "gloo" else None
    tiers, fits = {}, {}
    for tier in ("intra", "inter"):
        mine = [r for r in rows if r["tier"] == tier]
        if mine:
            tiers[tier], fits[tier] = fit_tier(mine, backend, window)
    if not tiers:
        raise ValueError("netprobe measured nothing: it needs at least 2 ranks")
    doc_tiers = {}
    for tier in ("intra", "inter"):
        source = tier if tier in tiers else next(iter(tiers))
        t = tiers[source]
        doc_tiers[f"{name}-{tier}"] = dict(
            latency_s=t.latency_s, bandwidth_Bps=t.bandwidth_Bps,
            **({"tcp_initial_window": t.tcp_initial_window_B} if window else {}),
            **({"tcp_rtt": t.tcp_rtt_s} if t.tcp_rtt_s is not None else {}),
            **({"tcp_queue": t.tcp_queue_s} if window and t.tcp_rtt_s is not None else {}),
            **({"exchange_scale": [[int(b), round(r, 4)] for b, r in t.exchange_scale]}
               if t.exchange_scale else {}),
            fit=fits[source] if source == tier else f"not measured: copy of {source}")
    profile = dict(description=description, intra=f"{name}-intra", inter=f"{name}-inter")
    return dict(tiers=doc_tiers, profiles={name: profile})


def format_fit(doc: dict) -> str:
    """A human-readable table of the fitted tiers and their residuals."""
    lines = []
    for tname, spec in doc["tiers"].items():
        fit = spec["fit"]
        head = (f"{tname}: latency = {spec['latency_s'] * 1e6:.1f} us, beta = "
                f"{spec['bandwidth_Bps'] / 1e6:.1f} MB/s")
        if isinstance(fit, str):
            lines.append(f"{head} ({fit})")
            continue
        exchange = ("; exchange x " + ", x ".join(f"{r:.2f} at {b} B" for b, r in
                                                  spec["exchange_scale"])
                    if spec.get("exchange_scale") else "")
        tcp = (f"; TCP round trip {spec['tcp_rtt'] * 1e3:.2f} ms, standing queue "
               f"{spec.get('tcp_queue', 0) * 1e3:.2f} ms" if "tcp_rtt" in spec else "")
        lines.append(f"{head} (alpha {fit['link_latency_s'] * 1e6:.1f} us + drift "
                     f"{fit['drift_s'] * 1e6:.1f} us{exchange}{tcp}); {fit['algorithm']} formulas, "
                     f"{fit['points']} points, rms relative residual "
                     f"{fit['rms_rel_residual']:.1%}")
        for r in fit["residuals"]:
            lines.append(f"    {r['op']:<11} n={r['n']} {r['nbytes']:>10} B  measured "
                         f"{r['measured_s'] * 1e3:9.3f} ms  model {r['model_s'] * 1e3:9.3f} ms  "
                         f"{r['rel_residual']:+.1%}")
    return "\n".join(lines)


def write_profile(doc: dict, out: Path) -> None:
    for spec in doc["tiers"].values():  # what get_profile will read back must parse
        parse_tier({k: v for k, v in spec.items()}, str(out), {})
    out.parent.mkdir(parents=True, exist_ok=True)
    header = "# network profile written by `commbench netprobe` (docs/network-model.md)\n"
    out.write_text(header + yaml.safe_dump(doc, sort_keys=False))


# ---------------------------------------------------------------------- entry points


def add_arguments(p) -> None:
    """The `commbench netprobe` options (bench/cli.py adds the subparser)."""
    p.add_argument("--out", default="netprobe-profile.yaml", help="profile YAML to write")
    p.add_argument("--world-size", type=int, default=2, help="ranks (on this node unless "
                   "--nnodes); default 2")
    p.add_argument("--ranks-per-node", type=int, default=1,
                   help="ranks sharing a node (intra tier); 1 = every rank is a node")
    p.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), help="message sizes")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions per point")
    p.add_argument("--step-compute", type=float, default=DEFAULT_STEP_COMPUTE_S,
                   help="seconds of compute before each in-step all_reduce (about your "
                        "run's compute per step; default %(default)s)")
    p.add_argument("--exchange-gap", type=float, default=DEFAULT_EXCHANGE_GAP_S,
                   help="seconds of compute before each exchange, under 0.2 (TCP's "
                        "minimum RTO: measured warm; default %(default)s)")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"],
                   help="torch.distributed backend; also picks the fitted formulas")
    p.add_argument("--name", default="netprobe", help="profile name inside the YAML")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--rdzv-endpoint", help="host:port of the first node (multi-node)")
    p.add_argument("--rdzv-timeout", type=float, default=120,
                   help="seconds to wait for the ranks to start (every node joined)")
    p.add_argument("--timeout", type=float, default=600, help="seconds before giving up")


def torchrun_command(args) -> list[str]:
    if args.nnodes > 1 and args.rdzv_endpoint is None:
        raise ValueError("--rdzv-endpoint HOST:PORT is required with --nnodes > 1")
    return torchrun.command(
        "bench.netprobe", ["--out", str(Path(args.out).resolve()), "--ranks-per-node",
                           str(args.ranks_per_node), "--iters", str(args.iters),
                           "--step-compute", str(args.step_compute), "--exchange-gap",
                           str(args.exchange_gap), "--backend",
                           args.backend, "--name", args.name, "--timeout", str(args.timeout),
                           "--sizes", *args.sizes],
        args.world_size // args.nnodes, args.nnodes, args.rdzv_endpoint, "netprobe",
        args.rdzv_timeout)


def run_cli(args) -> int:
    """`commbench netprobe`: start torchrun with this module as the ranks' program."""
    check_args(args)
    if args.backend == "nccl":
        import torch

        local = args.world_size // max(1, args.nnodes)
        if torch.cuda.device_count() < local:
            raise ValueError(f"netprobe --backend nccl starts {local} ranks on this node, one "
                             f"per GPU, but it has {torch.cuda.device_count()} CUDA devices; "
                             "lower --world-size (or raise --nnodes), or use --backend gloo")
    if args.nnodes == 1 and args.rdzv_endpoint is None:
        torchrun.check_loopback()
    else:
        print(f"netprobe: waiting for the rendezvous of --nnodes {args.nnodes} at "
              f"{args.rdzv_endpoint} (at most --rdzv-timeout {args.rdzv_timeout:g} s)",
              file=sys.stderr)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    rc, stopped = torchrun.run(torchrun_command(args), env, lambda line: print(line, end=""),
                               args.rdzv_timeout, args.timeout)
    if stopped == torchrun.NOT_STARTED:
        print(f"netprobe: the ranks did not start within --rdzv-timeout {args.rdzv_timeout:g} "
              "s: " + (f"the rendezvous at {args.rdzv_endpoint} did not complete (the "
                       "endpoint did not answer, or not every node started netprobe)"
                       if args.rdzv_endpoint else "torchrun's standalone rendezvous on "
                       "this machine did not complete"), file=sys.stderr)
        return 1
    if stopped == torchrun.TIMED_OUT:
        print(f"netprobe: no result after --timeout {args.timeout:g} s", file=sys.stderr)
        return 1
    return rc


def caveats(local_ranks: int, cores: int, nodes: int) -> list[str]:
    """What makes this machine's measurement a poor stand-in for links (printed and kept
    in the profile's description)."""
    notes = []
    if nodes == 1 and local_ranks > 1:
        notes.append("all ranks on one host: the links measured are this host's loopback "
                     "or bridge, not a network; run netprobe across the nodes you mean to "
                     "project onto")
    if local_ranks > cores:
        notes.append(f"{local_ranks} ranks share {cores} CPU cores: the ops wait for CPU, and "
                     "a run that computes between them waits longer than measured here "
                     "(docs/network-model.md, Calibration)")
    return notes


def _worker(argv: list[str] | None = None) -> int:
    """One rank under torchrun: probe, and on rank 0 fit and write the profile."""
    import argparse
    from datetime import timedelta

    import torch.distributed as dist

    p = argparse.ArgumentParser(prog="python -m bench.netprobe")
    add_arguments(p)
    args = p.parse_args(argv)
    torchrun.announce_start()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = probe_device(args.backend)  # before the group: NCCL binds the current GPU
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    try:
        rows = probe(rank, world, args.ranks_per_node, [parse_size(s) for s in args.sizes],
                     args.iters, device, args.step_compute, args.exchange_gap,
                     tcp=args.backend == "gloo")
    finally:
        dist.destroy_process_group()
    if rank == 0:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        notes = caveats(local, len(os.sched_getaffinity(0)), max(1, world // local))
        desc = (f"measured by commbench netprobe {time.strftime('%Y-%m-%d %H:%M')}: {world} "
                f"ranks, {args.ranks_per_node} per node, {args.backend}"
                + "".join(f"; caveat: {n}" for n in notes))
        doc = fit_profile(rows, args.backend, args.name, desc)
        write_profile(doc, Path(args.out))
        print(format_fit(doc))
        for note in notes:
            print(f"netprobe caveat: {note}", file=sys.stderr)
        print(f"wrote {args.out}; project onto it with network.profiles=[{args.out}]")
    return 0


if __name__ == "__main__":
    sys.exit(_worker())
