"""Communicator and CommLedger on real gloo process groups (2 and 4 ranks), and the helper.

Rank functions live at module level (they are pickled into spawned processes) and
return plain data; the assertions run in the parent.
"""

import time

import pytest
import torch
import torch.distributed as dist

from algorithms.comm import CommLedger, CommRecord, Communicator
from bench.network import Profile, Tier, delay_policy
from tests.distributed import run_distributed


def _summary(records):
    return [(r.phase, r.op, r.group_size, r.peers, r.nbytes, r.tier) for r in records]


def two_rank_ops(rank, world_size):
    comm = Communicator(rank, world_size, "cpu")
    comm.step = 7
    out = {}
    t = torch.full((3,), float(rank + 1))  # rank 0: 1, rank 1: 2
    out["avg"] = comm.all_reduce(t.clone(), op="avg").tolist()
    out["sum"] = comm.all_reduce(t.clone(), op="sum").tolist()
    with comm.phase("outer"):
        comm.all_reduce(torch.ones(5, dtype=torch.float64))  # 5 * 8 bytes
        with comm.phase("eval"):
            comm.broadcast(b := torch.full((2,), float(rank)), src=1)
        out["broadcast"] = b.tolist()
    out["gather"] = [g.tolist() for g in comm.all_gather(torch.tensor([rank, 10 * rank]))]
    if rank == 0:
        comm.send(torch.arange(4.0), dst=1)
    else:
        out["recv"] = comm.recv(torch.zeros(4), src=0).tolist()
    mine, theirs = torch.full((6,), float(rank)), torch.empty(6)
    original, out["order"] = dist.batch_isend_irecv, []

    def spy(ops):  # which op the exchange posts first
        out["order"] += ["recv" if op.op is dist.irecv else "send" for op in ops]
        return original(ops)

    dist.batch_isend_irecv = spy
    try:
        comm.exchange({1 - rank: mine}, {1 - rank: theirs})
    finally:
        dist.batch_isend_irecv = original
    out["exchanged"] = theirs.tolist()
    comm.barrier()
    out["records"] = _summary(comm.ledger.records)
    out["steps"] = {r.step for r in comm.ledger.records}
    out["totals"] = comm.ledger.totals()[0], comm.ledger.totals(phases=["outer"])[0]
    out["aggregate"] = comm.ledger.aggregate()
    out["tensor"] = torch.arange(3.0) * rank  # tensors must survive the child's exit
    return out


def test_two_rank_ops_values_and_ledger():
    results = run_distributed(two_rank_ops, 2, timeout=60)
    for rank, out in enumerate(results):
        assert out["avg"] == [1.5] * 3
        assert out["sum"] == [3.0] * 3
        assert out["broadcast"] == [1.0, 1.0]
        assert out["gather"] == [[0, 0], [1, 10]]
        assert out["exchanged"] == [float(1 - rank)] * 6
        # the receive first: on gloo its ready-to-receive notice must not queue behind
        # this rank's own payload (Communicator.exchange; 2x the time on shaped links)
        assert out["order"] == ["recv", "send"]
        assert out["steps"] == {7}
        assert torch.equal(out["tensor"], torch.arange(3.0) * rank)
        p2p = ("train", "send", 2, (1,), 16, "inter") if rank == 0 else \
              ("train", "recv", 2, (0,), 16, "inter")
        # one rank per node by default: the world spans two nodes, so "inter"
        assert out["records"] == [
            ("train", "all_reduce", 2, None, 3 * 4, "inter"),
            ("train", "all_reduce", 2, None, 3 * 4, "inter"),
            ("outer", "all_reduce", 2, None, 5 * 8, "inter"),
            ("eval", "broadcast", 2, None, 2 * 4, "inter"),
            ("train", "all_gather", 2, None, 2 * 8, "inter"),
            p2p,
            ("train", "exchange", 2, (1 - rank,), 6 * 4, "inter"),
        ]  # barrier is not recorded
        assert out["totals"] == (12 + 12 + 40 + 8 + 16 + 16 + 24, 40)
        rows = {(a["phase"], a["op"]): (a["count"], a["bytes"]) for a in out["aggregate"]}
        assert rows[("train", "all_reduce")] == (2, 24)
        assert rows[("outer", "all_reduce")] == (1, 40)


def four_rank_groups(rank, world_size):
    comm = Communicator(rank, world_size, "cpu", ranks_per_node=2)  # nodes {0,1}, {2,3}
    same_node = comm.split([[0, 1], [2, 3]])
    cross_node = comm.split([[0, 2], [1, 3]])
    x = torch.tensor([float(rank)])
    comm.all_reduce(within := x.clone(), op="sum", group=same_node)
    comm.all_reduce(across := x.clone(), op="avg", group=cross_node)
    comm.all_reduce(world := x.clone(), op="avg")
    # ring exchange: send to the right, receive from the left and the right
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    got_left, got_right = torch.empty(2), torch.empty(2)
    comm.exchange({right: torch.full((2,), float(rank)), left: torch.full((2,), float(rank))},
                  {left: got_left, right: got_right})
    # uneven exchange: 1 float to the right, 3 to the left; the split must be recoverable
    comm.exchange({right: torch.ones(1), left: torch.ones(3)},
                  {left: torch.empty(1), right: torch.empty(3)})
    return dict(
        groups=(same_node.ranks, cross_node.ranks),
        values=(within.item(), across.item(), world.item()),
        ring=(got_left.tolist(), got_right.tolist()),
        records=_summary(comm.ledger.records),
        peer_nbytes=[r.peer_nbytes for r in comm.ledger.records],
    )


def test_four_rank_subgroups_tiers_and_ring_exchange():
    results = run_distributed(four_rank_groups, 4, timeout=60)
    for rank, out in enumerate(results):
        node_group = (0, 1) if rank < 2 else (2, 3)
        cross_group = (0, 2) if rank % 2 == 0 else (1, 3)
        assert out["groups"] == (node_group, cross_group)
        assert out["values"] == (sum(node_group), sum(cross_group) / 2, 1.5)
        assert out["ring"] == ([float((rank - 1) % 4)] * 2, [float((rank + 1) % 4)] * 2)
        ring_peers = tuple(sorted({(rank - 1) % 4, (rank + 1) % 4}))
        assert out["records"] == [
            ("train", "all_reduce", 2, node_group, 4, "intra"),
            ("train", "all_reduce", 2, cross_group, 4, "inter"),
            ("train", "all_reduce", 4, None, 4, "inter"),
            ("train", "exchange", 3, ring_peers, 2 * 8, "inter"),
            ("train", "exchange", 3, ring_peers, 4 * 4, "inter"),
        ]
        sent = {(rank + 1) % 4: 4, (rank - 1) % 4: 12}  # bytes to the right, to the left
        assert out["peer_nbytes"] == [None, None, None, (8, 8),
                                      tuple(sent[p] for p in ring_peers)]


SLOW = Profile("slow", intra=Tier(0.1, 1e12), inter=Tier(0.1, 1e12))
# 2 ranks: 2 (n-1) (alpha + S/(n beta)) = 2 * (0.1 + ~0) = 0.2 s


def emulated_all_reduce(rank, world_size):
    comm = Communicator(rank, world_size, "cpu", delay=delay_policy(SLOW, rank, 1))
    t = torch.ones(1000)
    start = time.perf_counter()
    comm.all_reduce(t)
    wall = time.perf_counter() - start
    return wall, comm.ledger.records[0].seconds, t[0].item()


def test_emulation_makes_ops_take_the_modelled_time():
    for wall, recorded, value in run_distributed(emulated_all_reduce, 2, timeout=60):
        assert value == 1.0
        assert wall >= 0.2
        assert recorded >= 0.2


def test_ledger_local():
    ledger = CommLedger()
    for i, phase in enumerate(["train", "outer", "train"]):
        ledger.add(CommRecord(i, phase, "all_reduce", 2, None, 10 * (i + 1), 0.5, "inter"))
    assert ledger.totals() == (60, 1.5)
    assert ledger.totals(phases=["train"]) == (40, 1.0)
    assert ledger.totals(start=2) == (30, 0.5)
    assert ledger.aggregate() == [
        dict(phase="train", op="all_reduce", tier="inter", group_size=2, count=2, bytes=40,
             seconds=1.0),
        dict(phase="outer", op="all_reduce", tier="inter", group_size=2, count=1, bytes=20,
             seconds=0.5),
    ]
    assert len(ledger) == 3


# ------------------------------------------------------------------ the helper itself


def raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()  # rank 0 would wait forever: the helper must not
    return rank


def test_helper_reraises_a_rank_error():
    with pytest.raises(ValueError, match="rank one is unhappy") as info:
        run_distributed(raise_on_rank_one, 2, timeout=60)
    assert "raise_on_rank_one" in str(info.value.__cause__)  # the rank's traceback


def hang_in_collective(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        time.sleep(600)


def test_helper_times_out_on_a_hung_collective():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks still running: \[0, 1\]"):
        run_distributed(hang_in_collective, 2, timeout=3)
    assert time.monotonic() - start < 3 + 5
