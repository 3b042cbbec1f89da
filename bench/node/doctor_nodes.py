"""`commbench doctor` across nodes: its arguments, the network variables, the bandwidth.

    commbench doctor --nnodes 2 --node-rank R --rdzv-endpoint HEAD:29400   # on every node

With `--nnodes N` the collectives-and-p2p check runs on all ranks of all nodes: each node's
doctor starts a torchrun agent that joins the others through torchrun's c10d rendezvous
at `--rdzv-endpoint` (node rank `--node-rank`, or Slurm's SLURM_NODEID), and the ranks
check every op across the nodes, then time an all-reduce of a few sizes (`bandwidth`).
The short runs stay on each node. `validate_nodes` checks the arguments before anything
runs; `check_interfaces` reports the variables that choose the network interfaces and
warns about the settings that make two nodes hang (docs/cluster.md, doctor).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_DISABLE",
             "NCCL_NET", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_DEBUG", "MASTER_ADDR",
             "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_NNODES",
             "SLURM_NODEID")
"""The environment variables `check_interfaces` reports when set."""

JOIN_TIMEOUT_S = 240
"""Seconds a node's torchrun waits for the others at the rendezvous (then fails, naming
the rendezvous, within the collectives check's own 300 s)."""

SIZES_MIB = {"cuda": (1, 4, 16, 64), "cpu": (1, 4, 16)}
"""All-reduce sizes timed across nodes (gloo on CPU: the largest left out, it is slow)."""


# ---------------------------------------------------------------------------- arguments


def validate_nodes(nnodes: int, node_rank: int | None, endpoint: str | None,
                   env: dict[str, str]) -> tuple[int, int, str | None]:
    """(nnodes, node rank, endpoint) checked, the node rank from SLURM_NODEID when not
    given; a ValueError naming the flag, the value and what is valid."""
    if nnodes < 1:
        raise ValueError(f"doctor --nnodes must be >= 1, got {nnodes}")
    if nnodes == 1:
        for flag, value in (("--node-rank", node_rank), ("--rdzv-endpoint", endpoint)):
            if value is not None:
                raise ValueError(f"doctor {flag} {value} is for a run across nodes: give "
                                 "--nnodes N (N >= 2) too, or leave it out")
        return 1, 0, None
    if endpoint is None:
        raise ValueError(f"doctor --nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, the "
                         "same on every node (e.g. the first node's hostname and a free "
                         "port: $(scontrol show hostnames | head -n1):29400)")
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"doctor --rdzv-endpoint {endpoint!r} is not HOST:PORT with a port "
                         "in 1-65535 (e.g. node001:29400)")
    if node_rank is None:
        slurm = env.get("SLURM_NODEID")
        if slurm is None or not slurm.isdigit():
            raise ValueError(f"doctor --nnodes {nnodes} needs --node-rank R (0 to "
                             f"{nnodes - 1}, one per node), or SLURM_NODEID set (under srun)")
        node_rank = int(slurm)
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"doctor --node-rank {node_rank} must be in 0..{nnodes - 1} "
                         f"(--nnodes {nnodes})")
    return nnodes, node_rank, endpoint


def torchrun_args(nnodes: int, node_rank: int, endpoint: str | None, ranks: int,
                  env: dict[str, str]) -> list[str]:
    """torchrun's arguments for `ranks` ranks on this node: standalone on one node, else
    the c10d rendezvous at `endpoint` (its id from the Slurm job, the same on every node)."""
    if nnodes == 1:
        return ["--standalone", f"--nproc-per-node={ranks}"]
    return [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--nproc-per-node={ranks}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id=commbench-doctor-{env.get('SLURM_JOB_ID', '0')}",
            f"--rdzv-conf=join_timeout={JOIN_TIMEOUT_S}"]


# ---------------------------------------------------------------------------- interfaces


def interface_report(env: dict[str, str], interfaces: list[str]) -> str:
    """The set variables of VARIABLES and the host's interfaces, with warnings for: a named
    interface this host lacks (NCCL_SOCKET_IFNAME's entries are prefixes unless `=`-led,
    `^` excludes; GLOO_SOCKET_IFNAME's are names), and NCCL_SOCKET_IFNAME without
    GLOO_SOCKET_IFNAME (gloo then binds to the interface of the hostname's address: ranks
    on two nodes can wait for each other on a network that does not join them)."""
    found = [f"{name}={env[name]}" for name in VARIABLES if env.get(name)]
    parts = ["; ".join(found) if found else "no network variables set",
             f"interfaces: {', '.join(interfaces) or 'none'}"]
    warnings = []
    nccl, gloo = env.get("NCCL_SOCKET_IFNAME", ""), env.get("GLOO_SOCKET_IFNAME", "")
    if nccl and not nccl.startswith("^"):
        for entry in filter(None, nccl.split(",")):
            exact = entry.startswith("=")
            name = entry.lstrip("=")
            if not any(i == name if exact else i.startswith(name) for i in interfaces):
                warnings.append(f"NCCL_SOCKET_IFNAME names {entry!r}, which no interface of "
                                "this host " + ("is" if exact else "starts with"))
    for name in filter(None, gloo.split(",")):
        if name not in interfaces:
            warnings.append(f"GLOO_SOCKET_IFNAME names {name!r}, not an interface of this host")
    if nccl and not gloo:
        warnings.append("NCCL_SOCKET_IFNAME is set but GLOO_SOCKET_IFNAME is not: gloo "
                        "(CPU collectives) binds to the hostname's interface, a classic "
                        "two-node hang; set GLOO_SOCKET_IFNAME to the same interface")
    return "; ".join(parts + [f"WARNING: {w}" for w in warnings])


def check_interfaces(ctx) -> str:
    return interface_report(dict(os.environ), [name for _, name in socket.if_nameindex()])


# ---------------------------------------------------------------------------- the ranks


def collectives_worker(out: str) -> int:
    """One rank under torchrun: every op the strategies use, checked against its result."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    writes = int(os.environ["LOCAL_RANK"]) == 0  # every node's first rank writes its file
    nodes = world // int(os.environ["LOCAL_WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    try:
        t = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(t)
        assert t[0].item() == world * (world + 1) / 2, f"all_reduce gave {t[0].item()}"
        b = torch.full((8,), float(rank), device=device)
        dist.broadcast(b, src=world - 1)
        assert b[0].item() == world - 1, f"broadcast gave {b[0].item()}"
        parts = [torch.empty(4, device=device) for _ in range(world)]
        dist.all_gather(parts, torch.full((4,), float(rank), device=device))
        assert [p[0].item() for p in parts] == list(range(world)), "all_gather order"
        if world == 1:  # no peer to send to
            dist.barrier()
            Path(out).write_text(f"{backend}, 1 rank: all_reduce, broadcast, all_gather "
                                 "correct; send/recv not checked (needs 2 ranks)")
            return 0
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        got = torch.empty(16, device=device)
        if rank % 2 == 0:
            dist.send(torch.full((16,), float(rank), device=device), nxt)
            dist.recv(got, prev)
        else:
            dist.recv(got, prev)
            dist.send(torch.full((16,), float(rank), device=device), nxt)
        assert got[0].item() == prev, f"send/recv gave {got[0].item()}"
        got2 = torch.empty(16, device=device)
        ops = [dist.P2POp(dist.isend, torch.full((16,), float(rank), device=device), nxt),
               dist.P2POp(dist.irecv, got2, prev)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if cuda:
            torch.cuda.synchronize(device)
        assert got2[0].item() == prev, f"batched exchange gave {got2[0].item()}"
        dist.barrier()
        seen = (f"{backend}, {world} ranks" + (f" on {nodes} nodes" if nodes > 1 else "")
                + ": all_reduce, broadcast, all_gather, send/recv, batch_isend_irecv correct")
        if nodes > 1:
            seen += "; " + bandwidth(device, world)
        if writes:
            Path(out).write_text(seen)
    finally:
        dist.destroy_process_group()
    return 0


def bandwidth(device, world: int, repeats: int = 5) -> str:
    """All-reduce of each size in SIZES_MIB across the ranks (after one warm-up), timed on
    the host after a synchronise: the bus bandwidth 2 (n-1)/n x bytes / seconds of the
    fastest repeat, as nccl-tests reports it. Every rank calls it together."""
    import torch
    import torch.distributed as dist

    from bench.env import synchronize

    cells = []
    for mib in SIZES_MIB[device.type]:
        t = torch.ones(mib * 2**20 // 4, device=device)
        best = float("inf")
        for i in range(repeats + 1):
            synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            synchronize(device)
            if i:  # the first is the warm-up
                best = min(best, time.perf_counter() - start)
        bus = 2 * (world - 1) / world * mib * 2**20 / best
        cells.append(f"{mib} MiB {bus / 1e9:.2f} GB/s")
    return "all_reduce bus bandwidth " + ", ".join(cells)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: (torchrun ...) -m bench.node.doctor_nodes OUT: commbench doctor's "
                 "collectives worker")
    sys.exit(collectives_worker(sys.argv[1]))
