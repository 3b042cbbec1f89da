"""Pier (algorithms/pier.py): identities with DiLoCo and DDP, the lazy start and scheduled
outer step restated in tensor math, the schedules, the ledger across the switch, resume,
config errors. Helpers come from tests/test_diloco.py.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from algorithms.base import TrainSetup
from algorithms.comm import Communicator
from algorithms.pier import Pier, PierConfig, pier_schedule
from bench.config import load_config
from tests.distributed import run_distributed
from tests.helpers import max_change
from tests.test_diloco import (
    DILOCO_TINY,
    Regression,
    assert_same_params,
    flat,
    regression_batch,
    resume_matches,
    train_many,
)

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


def pier_rounds(rank, world_size, config: PierConfig, total_steps):
    """Pier's strategy against the lazy start and scheduled outer step in tensor math."""
    torch.manual_seed(0)
    model = Regression()
    reference = copy.deepcopy(model)
    setup = TrainSetup(model=model, comm=Communicator(rank, world_size, "cpu"),
                       total_steps=total_steps,
                       make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    strategy = Pier(config, setup)
    inner = torch.optim.SGD(reference.parameters(), lr=0.1)
    warmup = round(config.warmup_fraction * total_steps)
    theta, m = flat(reference), torch.zeros_like(flat(reference))
    errors, schedule = [], []
    for step in range(total_steps):
        strategy.train_step(regression_batch(rank, step))
        inner.zero_grad()
        reference(*regression_batch(rank, step))[1].backward()
        if step < warmup:  # DDP over all ranks
            for p in reference.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world_size
        inner.step()
        if (step + 1) % config.inner_steps:
            continue
        lr, mu = pier_schedule(config, (step + 1) / total_steps)
        delta = theta - flat(reference)
        if step < warmup:  # fill the momentum, no outer step
            m = mu * m + delta
            theta = flat(reference)
        else:
            dist.all_reduce(delta)
            delta /= world_size
            m = mu * m + delta
            theta = theta - lr * (delta + mu * m)
            torch.nn.utils.vector_to_parameters(theta.clone(), reference.parameters())
        errors.append((flat(strategy.eval_model()) - theta).abs().max().item())
        schedule.append((lr, mu))
    return errors, schedule


@pytest.mark.timeout(90)
def test_lazy_start_and_scheduled_outer_step_match_tensor_math():
    config = PierConfig(inner_steps=2, warmup_fraction=0.25, outer_lr_warmup=0.25)
    errors, schedule = run_distributed(pier_rounds, 2, config, 12, timeout=80)[0]
    assert len(errors) == 6 and max(errors) < 1e-6
    lrs, mus = zip(*schedule, strict=True)
    # round 1 (steps 1-2) fills the momentum; round 2 straddles the switch at step 3
    assert lrs[:3] == pytest.approx((0.0, 1.1 / 3, 1.1))  # η ramps over 25%..50%
    assert mus[0] == pytest.approx(0.99) and len(set(mus)) == 6  # μ decays after 25%


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


@pytest.mark.timeout(120)
def test_pier_resumes_to_the_same_parameters(tmp_path):
    # lazy start 2 steps (one momentum fill), outer steps at 4, 6, 8, checkpoint at 5
    overrides = ["run.steps=8", "strategy.inner_steps=2", "strategy.warmup_fraction=0.25",
                 "checkpoint.every=5"]
    results = run_distributed(resume_matches, 2, PIER_TINY, overrides, str(tmp_path),
                              timeout=100)
    for straight, resumed, step in results:
        assert step == 5
        assert_same_params(resumed, straight, atol=0, rtol=0)


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
    with pytest.raises(ValueError) as err:
        load_config(PIER_TINY, [override])
    assert message in str(err.value)
