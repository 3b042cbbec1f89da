"""What the training loop records when ranks differ: the clock, the tokens, the projection.

A test strategy (`Straggler`, registered in the rank processes only) does no training:
rank 1 computes (burns CPU time) for SLEEP_S in every step and consumes half a batch;
every rank all-reduces a large tensor in the first steps only, like Pier's DDP warmup. Issue 10, defects 2, 3 and 5:
- the clock must be the slowest rank's (rank 0 waits for rank 1 outside its timed steps);
- tokens are those consumed, summed over ranks, not the nominal global batch;
- projected time accumulates step by step, so time to target sees the front-loaded traffic.

Only lower bounds on seconds are asserted (CPU time burnt guarantees them), never upper
bounds; `Descheduled` checks that a wait (for a core, a peer) is not counted as compute.
"""

import math
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from algorithms.base import STRATEGIES, StepStats, Strategy, StrategyConfig
from bench.config import load_config
from bench.env import cores_available
from bench.network import get_profile, project
from bench.run.records import RunDir
from bench.run.train import TRAIN_PHASES, Trainer
from tests.distributed import run_distributed
from tests.helpers import IdleStrategy, burn_cpu

SLEEP_S = 0.15
"""Seconds of CPU time rank 1 computes in each step."""
STEPS = 6
FRONT_STEPS = 2
"""Steps at the start that all-reduce FRONT_FLOATS floats (training traffic)."""
FRONT_FLOATS = 1 << 20
SETTINGS = [f"run.steps={STEPS}", "run.log_every=2", "run.val_every=3", "run.val_sequences=8",
            "run.target_loss=100", "checkpoint.final=false", "parallel.world_size=2",
            "network.profiles=[nvlink, wan-1g]"]


@dataclass
class StragglerConfig(StrategyConfig):
    name: str = "straggler"


class Straggler(IdleStrategy, Strategy):
    """Rank 1 is late and reads half its batch; all ranks talk only in the first steps."""

    Config = StragglerConfig

    def train_step(self, batch):
        if self.comm.rank == 1:
            burn_cpu(SLEEP_S)
        if self.comm.step < FRONT_STEPS:
            self.comm.all_reduce(torch.zeros(FRONT_FLOATS))
        tokens = batch[1].numel() // (2 if self.comm.rank == 1 else 1)
        return StepStats(loss=1.0, tokens=tokens)


def train_straggler(rank, world_size, run_dir):
    STRATEGIES["straggler"] = f"{__name__}:Straggler"  # in this rank's process only
    cfg = load_config("configs/ddp-tiny.yaml", SETTINGS)
    cfg.strategy = StragglerConfig()
    trainer = Trainer(cfg, Path(run_dir), torch.device("cpu"), "gloo", keep_records=True)
    summary = trainer.run()
    train = [r for r in trainer.ledger.records if r.phase in TRAIN_PHASES]
    # the loop prices with the run's backend (network.model: auto -> gloo here); wan-1g is
    # TCP: its first step's connection is new (slow start), the second's warm
    modelled = {name: sum(project([r for r in train if r.step == step], get_profile(name),
                                  rank, 1, backend="gloo", idle=math.inf if step == 0 else 0.0)
                          for step in range(FRONT_STEPS))
                for name in ("nvlink", "wan-1g")}
    return summary, modelled, cfg.data.batch_size * cfg.model.seq_len


@pytest.fixture(scope="module")
def straggler_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straggler")
    results = run_distributed(train_straggler, 2, str(run_dir), timeout=120)
    return results, RunDir(run_dir).read_metrics()


@pytest.mark.timeout(150)
def test_clock_is_the_slowest_ranks(straggler_run):
    """Defect 2: rank 0 waits for rank 1 only in the harness's untimed reductions."""
    results, rows = straggler_run
    for summary, _, _ in results:  # every rank returns the same, settled clock
        assert summary["wall_s"] >= STEPS * SLEEP_S
        assert summary["wall_s"] == results[0][0]["wall_s"]
        assert summary["throughput_tokens_per_s"] <= summary["total_tokens"] / (STEPS * SLEEP_S)
    # metrics rows (steps 2, 4, 6) and validation rows (steps 3, 6) alike
    assert [r["step"] for r in rows] == [2, 3, 4, 6, 6]
    for row in rows:
        assert row["elapsed_s"] >= row["step"] * SLEEP_S, row
    assert [r["elapsed_s"] for r in rows] == sorted(r["elapsed_s"] for r in rows)


@pytest.mark.timeout(150)
def test_tokens_are_those_consumed(straggler_run):
    """Defect 3: rank 1 reads half a batch per step; the nominal rate would count a full one."""
    results, rows = straggler_run
    summary, _, rank_batch_tokens = results[0]
    per_step = rank_batch_tokens + rank_batch_tokens // 2
    assert summary["total_tokens"] == STEPS * per_step
    assert [r["tokens"] for r in rows] == [r["step"] * per_step for r in rows]
    assert summary["tokens_to_target"] == 3 * per_step  # the first validation, step 3


@pytest.mark.timeout(150)
def test_projected_time_accumulates_step_by_step(straggler_run):
    """Defect 5: all traffic is in steps 0-1, so at step 3 of 6 the projected time on a
    slow network is over half the total (uniform scaling would say exactly half)."""
    results, rows = straggler_run
    summary = results[0][0]
    comm_extra = max(m["wan-1g"] - m["nvlink"] for _, m, _ in results)
    assert comm_extra > 0.01  # the front-loaded traffic costs something on wan-1g
    for row in rows:
        gap = row["projected_elapsed_s"]["wan-1g"] - row["projected_elapsed_s"]["nvlink"]
        assert gap == pytest.approx(comm_extra, rel=1e-9), row  # all paid by step 2
        assert row["projected_elapsed_s"]["nvlink"] >= row["step"] * SLEEP_S  # slowest rank
    last = rows[-1]["projected_elapsed_s"]
    for name in ("nvlink", "wan-1g"):
        assert summary["projected"][name]["total_s"] == pytest.approx(last[name])
        # the robust projection: rank 1's median compute is at least its burn
        assert summary["projected_robust"][name]["total_s"] >= STEPS * SLEEP_S
    assert min(summary["compute_per_step"]["no traffic"]["median_s"]) >= 0
    assert summary["compute_per_step"]["no traffic"]["median_s"][1] >= SLEEP_S
    wan_total = summary["projected"]["wan-1g"]["total_s"]
    at_target = summary["projected_time_to_target_s"]["wan-1g"]
    val3 = next(r for r in rows if r["step"] == 3 and "val_loss" in r)
    assert at_target == val3["projected_elapsed_s"]["wan-1g"]
    assert at_target > wan_total * summary["tokens_to_target"] / summary["total_tokens"]


BURN_S, WAIT_S = 0.04, 0.12
"""`Descheduled`: every rank's compute per step (CPU time), and rank 1's wait for a core."""


@dataclass
class DescheduledConfig(StrategyConfig):
    name: str = "descheduled"


class Descheduled(IdleStrategy, Strategy):
    """Ranks sharing cores, as 4 gloo ranks on 2 cores: every rank computes BURN_S a step,
    rank 1 also waits WAIT_S for a core before it (a sleep: no CPU time), then all
    all-reduce, so rank 0 waits for rank 1 there: a DDP step's shape."""

    Config = DescheduledConfig

    def train_step(self, batch):
        if self.comm.rank == 1:
            time.sleep(WAIT_S)
        burn_cpu(BURN_S)
        self.comm.all_reduce(torch.zeros(4))
        return StepStats(loss=1.0, tokens=batch[1].numel())


def train_descheduled(rank, world_size, run_dir):
    STRATEGIES["descheduled"] = f"{__name__}:Descheduled"
    cfg = load_config("configs/ddp-tiny.yaml", SETTINGS)
    cfg.strategy = DescheduledConfig()
    return Trainer(cfg, Path(run_dir), torch.device("cpu"), "gloo").run()


@pytest.mark.timeout(150)
def test_a_wait_for_a_core_is_not_compute(tmp_path):
    """Issue 50: on CPU a rank's compute is its CPU time, so neither the descheduled rank
    (whose wall step holds its wait) nor its peer (whose wall step holds the wait for it)
    counts the wait as compute, and the projection prices BURN_S a step, not BURN_S +
    WAIT_S (wall minus exposed comm: 0.16 s on rank 1)."""
    summaries = run_distributed(train_descheduled, 2, str(tmp_path), timeout=120)
    summary = summaries[0]
    assert summary["compute_clock"] == "thread_cpu"
    assert summary["ranks_per_core"] == pytest.approx(2 / cores_available())
    medians = summary["compute_per_step"]["train:all_reduce"]["median_s"]
    for median in medians:
        assert BURN_S <= median < BURN_S + WAIT_S / 2, medians
    assert summary["wall_s"] >= STEPS * (BURN_S + WAIT_S)  # the wall clock holds the wait
    nvlink = summary["projected"]["nvlink"]["total_s"]
    assert nvlink < STEPS * (BURN_S + WAIT_S / 2), nvlink


def test_coupled_max_takes_the_slowest_rank_per_stretch_not_per_step():
    """Two ranks with alternating jitter over 4 local steps then an outer step: they wait
    for each other only at the outer step, so the stretch costs the slower rank's SUM
    (4 + 3 + ... = 12.0 s), not the sum of per-step maxima (which would say 14.0 s)."""
    from bench.network.timeline import coupled_max

    def total(values, coupled):
        return coupled_max(values, coupled, torch.zeros(values.shape[:2]))[0].tolist()

    # [ranks, steps, k]; k = 2 columns (e.g. two profiles), the second doubled
    rank0 = [3.0, 2.0, 3.0, 2.0, 2.0]
    rank1 = [2.0, 3.0, 2.0, 3.0, 1.0]
    values = torch.tensor([[[v, 2 * v] for v in rank0], [[v, 2 * v] for v in rank1]],
                          dtype=torch.float64)
    local = torch.tensor([False, False, False, False, True])
    assert total(values, local) == [12.0, 24.0]
    # every step coupled (DDP): the per-step maxima, 3 + 3 + 3 + 3 + 2
    assert total(values, torch.ones(5, dtype=torch.bool)) == [14.0, 28.0]
    # no coupled step: the window's end still waits for the slowest rank (12 vs 11)
    assert total(values, torch.zeros(5, dtype=torch.bool)) == [12.0, 24.0]
    # a coupled step in the middle: stretches [0, 1] (5 vs 5) and [2..4] (7 vs 6)
    mid = torch.tensor([False, True, False, False, False])
    assert total(values, mid) == [12.0, 24.0]
    # the slowest rank changes between stretches: rank 0 leads steps 0-1, rank 1 steps 2-3
    swap = torch.tensor([[[3.0], [3.0], [1.0], [1.0]], [[1.0], [1.0], [3.0], [3.0]]],
                        dtype=torch.float64)
    assert total(swap, torch.tensor([False, True, False, False])) == [12.0]
    assert total(swap, torch.zeros(4, dtype=torch.bool)) == [8.0]


def test_projection_compute_and_comm_are_the_timeline_ranks():
    """Issue 27, one model per record: two ranks of unequal compute (a pipeline's stages,
    a straggler), every step coupled. On the fast profile (column 0) the heavy rank 0 ends
    each step; on the slow one (column 1) the light rank 1, whose exposed transfers are
    longer, does. The projection's compute is the rank that ends each stretch, and its
    comm the rest of that rank's step: the maximum of the ranks' own comm (rank 1's on
    the fast profile, 1.5 s a step) belongs to no timeline (4 s + 1.5 s is no step)."""
    from bench.network.timeline import coupled_max, kind_id, robust_projection

    compute = torch.tensor([[4.0, 4.0], [1.0, 1.0]], dtype=torch.float64)
    comm = torch.tensor([[[0.5, 1.0], [0.5, 1.0]],   # rank 0: per step, per column
                         [[1.5, 5.0], [1.5, 5.0]]], dtype=torch.float64)
    values = compute.unsqueeze(-1) + comm
    coupled = torch.ones(2, dtype=torch.bool)
    totals, timeline = coupled_max(values, coupled, compute)
    assert totals.tolist() == [9.0, 12.0]  # 2 x 4.5 (rank 0), 2 x 6.0 (rank 1)
    assert timeline.tolist() == [8.0, 2.0]  # rank 0's compute, then rank 1's
    assert (totals - timeline).tolist() == [1.0, 10.0]  # the timeline's comm
    assert comm.sum(dim=1).amax(dim=0).tolist() == [3.0, 10.0]  # max-of-comm: not it
    # one stretch over both steps: the same ranks end it; a tie goes to the lowest rank
    assert [x.tolist() for x in coupled_max(values, torch.zeros(2, dtype=torch.bool),
                                            compute)] == [[9.0, 12.0], [8.0, 2.0]]
    tie = torch.tensor([[[2.0]], [[2.0]]], dtype=torch.float64)
    assert coupled_max(tie, coupled[:1], torch.tensor([[1.5], [0.5]]))[1].tolist() == [1.5]
    # the robust projection picks its timeline alike, per column, from the medians
    kid = kind_id("train:send")
    no_link = ((0.0, 0.0), (0.0, 0.0))  # per column (d, h): no critical path
    content = ((((kid, 2),), no_link, (1.0, 2.0)),   # rank 0: median 4 s, 2 steps
               (((kid, 2),), no_link, (3.0, 10.0)))  # rank 1: median 1 s
    totals, robust_compute = robust_projection({content: 3}, [{"train:send": 4.0},
                                                             {"train:send": 1.0}], 2)
    assert totals == [3 * 9.0, 3 * 12.0] and robust_compute == [3 * 8.0, 3 * 2.0]


def test_robust_projection_replaces_a_spike_by_the_median():
    """Issue 26: a load spike in one step moves `projected` by the spike but the robust
    projection by nothing (each rank's median compute per step kind, the same stretches
    and modelled communication)."""
    from bench.network.timeline import coupled_max, kind_id, robust_projection, stretches

    kind = "inner:all_reduce"
    compute = [[1.0, 1.0, 1.0, 9.0, 1.0, 1.0, 1.0, 1.0],  # rank 0: a spike in step 3
               [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]]
    coupled = torch.tensor([0, 0, 0, 1, 0, 0, 0, 1], dtype=torch.bool)
    width = 2  # one profile, overlap-aware and not
    robust = torch.zeros(2, 8, 2 + 3 * width, dtype=torch.float64)
    robust[:, :, 0] = kind_id(kind)
    robust[:, :, 1] = torch.tensor(compute, dtype=torch.float64)
    robust[:, [3, 7], 4] = 0.5  # column 0's (d, h, other): other 0.5 s at the coupled steps
    robust[:, [3, 7], 7] = 0.7  # column 1's
    found = stretches(robust, coupled, width)
    assert list(found.values()) == [2]  # two equal stretches of 4 steps
    totals, compute_s = robust_projection(found, [{kind: 1.0}, {kind: 2.0}], width)
    assert compute_s == [2 * 8.0, 2 * 8.0]  # rank 1's 4 x 2 s per stretch, twice
    assert totals == pytest.approx([2 * 8.5, 2 * 8.7], rel=1e-12)
    # the projection itself (coupled_max) pays rank 0's spike: 9 + 3 + 0.5 > 8.5
    values = torch.tensor(compute, dtype=torch.float64).unsqueeze(-1).repeat(1, 1, 2)
    values[:, [3, 7], 0] += 0.5
    assert coupled_max(values, coupled, values[:, :, 1])[0].tolist()[0] == 12.5 + 8.5


def test_stretches_of_a_run_projecting_onto_no_profile():
    """`network.profiles: []` (a run that projects nothing, as the shaped netlab runs):
    the stretch record has no columns, and its first settle used to fail reshaping them."""
    from bench.network.timeline import kind_id, stretches

    robust = torch.zeros(2, 3, 2, dtype=torch.float64)
    robust[:, :, 0] = kind_id("no traffic")
    found = stretches(robust, torch.tensor([0, 1, 0], dtype=torch.bool), 0)
    assert sum(found.values()) == 2  # [0, 1] and [2]
    assert all(links == others == () for stretch in found for _, links, others in stretch)


def test_robust_projection_record_is_bounded(monkeypatch):
    """Every step with measured overlap is a new stretch: the robust projection's record
    stops growing at ROBUST_RECORD_LIMIT numbers (dropped whole: no `projected_robust`
    for the run, rather than a record that is complete for some stretches only)."""
    from bench.run import meter

    monkeypatch.setattr(meter, "ROBUST_RECORD_LIMIT", 130)

    def settled(step):  # 2 ranks, one kind, 2 columns: 2 * (2 + 2 * 2 + 2) = 16 numbers
        content = tuple((((0.0, 1),), ((0.0, 0.0), (0.0, 0.0)), (step * 1e-3, 0.0))
                        for _ in range(2))
        return meter.Settled(0.1, 8, {}, {}, stretches={content: 1})

    state = meter.LoopState()
    for step in range(8):
        state.advance(settled(step))
    assert len(state.robust_stretches) == 8 and not state.robust_dropped  # 128 numbers
    state.advance(settled(8))
    assert state.robust_dropped and state.robust_stretches == {}
    state.advance(settled(9))
    assert state.robust_stretches == {} and state.tokens == 80  # the rest still counts
