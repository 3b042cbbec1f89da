"""Pier (algorithms/pier.py): identities with DiLoCo and DDP, the lazy start and scheduled
outer step restated in tensor math (flat and hierarchical, with hand-computed schedule
values), the schedules, the ledger across the switch, config errors. Resume is in
tests/test_resume.py; shared helpers in tests/local_updates.py.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from algorithms.base import TrainSetup
from algorithms.comm import Communicator
from algorithms.pier import Pier, PierConfig, pier_schedule
from tests.distributed import run_distributed
from tests.helpers import assert_bad_config, assert_same_params, max_change
from tests.local_updates import Regression, flat, regression_batch, train_many

DILOCO_TINY = "configs/diloco-tiny.yaml"
PIER_TINY = "configs/pier-tiny.yaml"


@pytest.mark.timeout(200)
def test_pier_without_lazy_start_and_constant_schedule_is_diloco(tmp_path):
    common = ["run.steps=6", "strategy.inner_steps=2", "strategy.outer_lr=0.7",
              "strategy.outer_momentum=0.9", "parallel.group_size=2"]
    runs = [(DILOCO_TINY, common),
            (PIER_TINY, [*common, "strategy.warmup_fraction=0", "strategy.schedule=constant"])]
    results = run_distributed(train_many, 4, runs, str(tmp_path), timeout=180)
    for diloco, pier in results:
        assert_same_params(pier["params"], diloco["params"], atol=0, rtol=0)
        assert pier["ledger"] == diloco["ledger"]


@pytest.mark.timeout(240)
def test_pier_during_lazy_start_is_ddp_and_ledger_follows_the_switch(tmp_path):
    common = ["run.steps=8", "parallel.group_size=2"]
    pier = [*common, "strategy.inner_steps=2"]
    runs = [("configs/ddp-tiny.yaml", common),
            (PIER_TINY, [*pier, "strategy.warmup_fraction=0.95"]),  # all 8 steps lazy
            (PIER_TINY, [*pier, "strategy.warmup_fraction=0.5"])]   # 4 lazy, 4 local
    results = run_distributed(train_many, 4, runs, str(tmp_path), timeout=220)
    for ddp, lazy, switched in results:
        assert_same_params(lazy["params"], ddp["params"], atol=0, rtol=0)
        assert {(phase, size) for phase, _, _, _, size, _ in lazy["ledger"]} == {("inner", 4)}
        assert max_change(switched["params"], ddp["params"]) > 1e-4  # local steps differ
        sizes = {}
        for phase, _, step, _, size, _ in switched["ledger"]:
            sizes.setdefault((phase, size), set()).add(step)
        # gradients over all 4 ranks, then inside the group; outer steps at 6 and 8 only
        # (the round ends at 2 and 4 fill the momentum locally)
        assert sizes == {("inner", 4): {0, 1, 2, 3}, ("inner", 2): {4, 5, 6, 7},
                         ("outer", 2): {5, 7}}


def pier_rounds(rank, world_size, config: PierConfig, total_steps, group_size, expected):
    """Pier's strategy against the lazy start and scheduled outer step in tensor math.

    `expected` holds the (η, μ) of every round, computed by hand in the test. Gradients
    are averaged over the world during the lazy start and over the replica (the
    `group_size` consecutive ranks) after it; Δ is the mean over the replicas.
    """
    torch.manual_seed(0)
    model = Regression()
    reference = copy.deepcopy(model)
    setup = TrainSetup(model=model, comm=Communicator(rank, world_size, "cpu"),
                       total_steps=total_steps, group_size=group_size,
                       make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    strategy = Pier(config, setup)
    inner = torch.optim.SGD(reference.parameters(), lr=0.1)
    warmup = round(config.warmup_fraction * total_steps)
    replica = range(rank // group_size * group_size, (rank // group_size + 1) * group_size)
    theta, m = flat(reference), torch.zeros_like(flat(reference))
    rounds = iter(expected)
    errors, reported = [], []
    for step in range(total_steps):
        stats = strategy.train_step(regression_batch(rank, step))
        inner.zero_grad()
        reference(*regression_batch(rank, step))[1].backward()
        for p in reference.parameters():
            every = [torch.empty_like(p.grad) for _ in range(world_size)]
            dist.all_gather(every, p.grad)
            averaged = every if step < warmup else [every[r] for r in replica]
            p.grad = torch.stack(averaged).mean(0)
        inner.step()
        if (step + 1) % config.inner_steps:
            continue
        lr, mu = next(rounds)
        delta = theta - flat(reference)
        if step < warmup:  # fill the momentum with μ_max, no outer step
            m = mu * m + delta
            theta = flat(reference)
        else:
            dist.all_reduce(delta)  # replicas' ranks hold equal Δ: world mean = replica mean
            delta /= world_size
            m = mu * m + delta
            theta = theta - lr * (delta + mu * m)
            torch.nn.utils.vector_to_parameters(theta.clone(), reference.parameters())
        errors.append((flat(strategy.eval_model()) - theta).abs().max().item())
        reported.append((stats.extras["outer_lr"], stats.extras["outer_momentum"]))
    return errors, reported


# 10 steps, H = 2, lazy start 40% (steps 1-4: fills at 20% and 40%), η warmup over 30%.
LONG_WARMUP = dict(inner_steps=2, warmup_fraction=0.4, outer_lr_warmup=0.3)
CASES = {
    # step schedule: μ is 0.9 from 20% on, yet the fills at 20% and 40% use μ_max = 0.99;
    # η: 1.1 * (0.6 - 0.4) / 0.3 at 60%, then 0.9 from 80%.
    "step-long-warmup": (PierConfig(schedule="step", **LONG_WARMUP), 4, 2,
                         [(0.0, 0.99), (0.0, 0.99), (1.1 * 0.2 / 0.3, 0.9), (0.9, 0.9),
                          (0.9, 0.9)]),
    # cosine with the μ decay starting at 10%, inside the lazy start: fills still use 0.99.
    # 60%: μ = 0.9 + 0.09 * (1 + cos(100°)) / 2 = 0.937186; 80%: η = 0.9 + 0.2 * (1 +
    # cos(60°)) / 2 = 1.05, μ = 0.9 + 0.09 * (1 + cos(140°)) / 2 = 0.910528.
    "cosine-decay-inside-warmup": (PierConfig(momentum_decay_start=0.1, **LONG_WARMUP), 2, 1,
                                   [(0.0, 0.99), (0.0, 0.99), (1.1 * 0.2 / 0.3, 0.937186),
                                    (1.05, 0.910528), (0.9, 0.9)]),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES)
def test_lazy_start_and_scheduled_outer_step_match_tensor_math(case):
    config, world_size, group_size, expected = CASES[case]
    results = run_distributed(pier_rounds, world_size, config, 10, group_size, expected,
                              timeout=100)
    for errors, reported in results:
        assert len(errors) == 5 and max(errors) < 1e-6
        flat_pairs = [value for pair in reported for value in pair]
        assert flat_pairs == pytest.approx([v for pair in expected for v in pair], abs=1e-6)


def test_schedules():
    cosine = PierConfig()
    assert pier_schedule(cosine, 0.05) == (0.0, 0.99)
    assert pier_schedule(cosine, 0.15) == pytest.approx((0.55, 0.99 - 0.09 * 0.0076), abs=1e-4)
    assert pier_schedule(cosine, 0.2)[0] == pytest.approx(1.1)
    assert pier_schedule(cosine, 0.55)[1] == pytest.approx(0.945)  # halfway down the decay
    assert pier_schedule(cosine, 0.6)[0] == pytest.approx(1.0)  # halfway down 1.1 -> 0.9
    assert pier_schedule(cosine, 1.0) == pytest.approx((0.9, 0.9))
    step = PierConfig(schedule="step")
    assert [pier_schedule(step, p)[1] for p in (0.12, 0.15, 0.19, 0.2, 0.9)] == \
        [0.99, 0.95, 0.95, 0.9, 0.9]
    assert [pier_schedule(step, p)[0] for p in (0.05, 0.15, 0.5, 0.79, 0.8)] == \
        pytest.approx([0.0, 0.55, 1.1, 1.1, 0.9])
    constant = PierConfig(schedule="constant", outer_lr=0.5, outer_momentum=0.8)
    assert pier_schedule(constant, 0.0) == pier_schedule(constant, 0.7) == (0.5, 0.8)
    # μ_max of the lazy start's fills, per schedule
    assert (cosine.peak_momentum(), step.peak_momentum(), constant.peak_momentum()) == (
        0.99, 0.99, 0.8)


@pytest.mark.parametrize("override,message", [
    ("strategy.warmup_fraction=1.0", "strategy.warmup_fraction must be in [0, 1), got 1.0"),
    ("strategy.warmup_fraction=-0.1", "strategy.warmup_fraction must be in [0, 1), got -0.1"),
    ("strategy.inner_steps=0", "strategy.inner_steps must be >= 1, got 0"),
    ("strategy.outer_lr_peak=0", "strategy.outer_lr_peak must be > 0, got 0.0"),
    ("strategy.outer_optimizer=adam", "strategy.outer_optimizer must be 'sgd' for pier"),
    ("strategy.schedule=linear", "strategy.schedule must be one of"),
    ("strategy.momentum_decay_start=1.0", "must be below strategy.momentum_decay_end"),
    ("strategy.step_momentum=[0.99, 0.9]", "strategy.step_momentum needs one value more"),
    ("parallel.group_size=3",
     "parallel.world_size (4) must be divisible by parallel.group_size (3)"),
])
def test_bad_pier_config_fails_before_launch(override, message):
    assert_bad_config(PIER_TINY, override, message)
