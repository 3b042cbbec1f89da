"""`commbench netprobe`: measure this cluster's links and fit a network profile to them.

    commbench netprobe --world-size 4 --out my-net.yaml [--ranks-per-node 2]
        [--sizes 4KiB 256KiB 4MiB] [--iters 5] [--backend gloo]
    commbench run CONFIG --set network.profiles=[my-net.yaml]

Exercised by `pytest tests/test_netprobe.py`. Launched like a run: torchrun on this machine
(`--nnodes N --rdzv-endpoint HOST:PORT` once per node for several nodes); each rank runs
this module (`_worker`): it measures its links (bench/node/netprobe_measure.py: p2p, the
collectives, gossip's two-way exchange, an all_reduce inside a step, TCP's round trip and
standing queue) and rank 0 fits a profile to them with the projection's own formulas and
writes it (bench/node/netprobe_fit.py). This module holds the command: its options, their
checks (before torchrun starts), the launch and the ranks' entry point.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

from bench.launch import torchrun
from bench.network import costs
from bench.node.netprobe_fit import fit_profile, format_fit, write_profile
from bench.node.netprobe_measure import (
    DEFAULT_EXCHANGE_GAP_S,
    DEFAULT_STEP_COMPUTE_S,
    ELEMENT,
    probe,
    probe_device,
)
from bench.run.stop import announce_start

DEFAULT_SIZES = ("4KiB", "64KiB", "1MiB", "4MiB")
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
        "bench.node.netprobe", ["--out", str(Path(args.out).resolve()), "--ranks-per-node",
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

    p = argparse.ArgumentParser(prog="python -m bench.node.netprobe")
    add_arguments(p)
    args = p.parse_args(argv)
    announce_start()
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
