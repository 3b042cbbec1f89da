"""DiLoCo (algorithms/diloco.py, algorithms/outer.py): identities, the outer step (fp32 and
with a bf16 pseudo-gradient) against tensor math, ledger, config errors. Resume is in
tests/test_resume.py; shared helpers in tests/local_updates.py.

Multi-process tests run the real training loop (bench.run.train.Trainer) or the strategy on
real gloo process groups through tests/distributed.py, each with a timeout. Several runs
share one launch to keep process start-up (the slow part on 2 cores) down.
"""

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from algorithms.base import TrainSetup
from algorithms.comm import Communicator
from algorithms.diloco import DiLoCo, DiLoCoConfig
from bench.config import load_config
from bench.run.train import lr_at, make_optimizer_factory
from tests import helpers
from tests.distributed import run_distributed
from tests.helpers import assert_bad_config, max_change, params_of
from tests.local_updates import Regression, flat, make_trainer, regression_batch, train_many

DILOCO_TINY = "configs/diloco-tiny.yaml"


def assert_same_params(a: dict, b: dict, atol=2e-6, rtol=1e-5):
    helpers.assert_same_params(a, b, atol=atol, rtol=rtol)


# ------------------------------------------------------------------------ identities


def diloco_and_local_sgd(rank, world_size, overrides, run_dir):
    """DiLoCo (outer lr 1, momentum 0) through the loop, and Local SGD in plain torch."""
    trainer = make_trainer(world_size, DILOCO_TINY, overrides, run_dir)
    initial = copy.deepcopy(trainer.strategy.model)
    start = params_of(initial)
    trainer.run()
    diloco = params_of(trainer.strategy.eval_model())

    cfg, model = trainer.cfg, initial
    optimizer = make_optimizer_factory(cfg)(model)
    for step in range(cfg.run.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = trainer.stream.batch(step)
        optimizer.zero_grad()
        model(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        if (step + 1) % cfg.strategy.inner_steps == 0:  # average the replicas
            for p in model.parameters():
                dist.all_reduce(p.data)
                p.data.div_(world_size)
    return diloco, params_of(model), params_of(trainer.strategy.model), start


@pytest.mark.timeout(150)
def test_diloco_outer_lr_1_momentum_0_equals_local_sgd(tmp_path):
    overrides = ["run.steps=6", "strategy.inner_steps=3", "strategy.outer_lr=1",
                 "strategy.outer_momentum=0"]
    results = run_distributed(diloco_and_local_sgd, 2, overrides, str(tmp_path), timeout=130)
    for diloco, local_sgd, replica, initial in results:
        assert_same_params(diloco, local_sgd)
        assert_same_params(diloco, results[0][0], atol=0, rtol=0)  # one global θ
        assert_same_params(replica, diloco, atol=0, rtol=0)  # replicas restart from θ
        assert max_change(diloco, initial) > 1e-3  # training moved the weights


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size,group_size", [(2, 1), (4, 2)])
def test_diloco_h1_outer_sgd_lr1_equals_ddp_with_sgd(tmp_path, world_size, group_size):
    common = ["run.steps=4", "optim.name=sgd", "optim.lr=0.5", "optim.grad_clip=0",
              f"parallel.group_size={group_size}"]
    diloco = [*common, "strategy.inner_steps=1", "strategy.outer_lr=1",
              "strategy.outer_momentum=0"]
    runs = [("configs/ddp-tiny.yaml", common), (DILOCO_TINY, diloco),
            ("configs/ddp-tiny.yaml", [*common, "run.steps=1", "optim.lr=1e-9"])]
    results = run_distributed(train_many, world_size, runs, str(tmp_path), timeout=180)
    for ddp, local, initial in results:
        assert_same_params(local["params"], ddp["params"])
        assert max_change(ddp["params"], initial["params"]) > 1e-3  # training moved them
    phases = {row[0] for row in results[0][1]["ledger"]}
    assert phases == ({"inner", "outer"} if group_size > 1 else {"outer"})


# ------------------------------------------------------------------- the outer step


def nesterov_rounds(rank, world_size, inner_steps, num_rounds, lr, mu, wire="fp32"):
    """The strategy against the outer step restated in tensor math, round by round.

    wire bf16: each replica's Δ_i is rounded to bf16, summed in bf16 by the all-reduce,
    halved in bf16, and only then handed to the fp32 outer step.
    """
    torch.manual_seed(0)
    model = Regression()
    reference = copy.deepcopy(model)
    comm = Communicator(rank, world_size, "cpu")
    setup = TrainSetup(model=model, comm=comm, total_steps=inner_steps * num_rounds,
                       make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    config = DiLoCoConfig(inner_steps=inner_steps, outer_lr=lr, outer_momentum=mu,
                          outer_grad_dtype=wire)
    wire_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[wire]
    strategy = DiLoCo(config, setup)
    inner = torch.optim.SGD(reference.parameters(), lr=0.1)
    theta, m = flat(reference), torch.zeros_like(flat(reference))
    errors, moved = [], []
    for t in range(num_rounds):
        for h in range(inner_steps):
            step = t * inner_steps + h
            strategy.train_step(regression_batch(rank, step))
            inner.zero_grad()
            reference(*regression_batch(rank, step))[1].backward()
            inner.step()
            if h < inner_steps - 1:  # mid-round the evaluated model is still θ
                errors.append((flat(strategy.eval_model()) - theta).abs().max().item())
        delta = (theta - flat(reference)).to(wire_dtype)
        dist.all_reduce(delta) if world_size > 1 else None
        delta = (delta / world_size).float()
        m = mu * m + delta                         # m ← μ m + Δ
        theta = theta - lr * (delta + mu * m)      # θ ← θ − η (Δ + μ m)
        torch.nn.utils.vector_to_parameters(theta.clone(), reference.parameters())
        errors.append((flat(strategy.eval_model()) - theta).abs().max().item())
        # the replica restarts from θ
        moved.append((flat(model) - theta).abs().max().item())
    return errors, moved, strategy.round, theta


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [1, 2])
def test_outer_nesterov_step_matches_tensor_math(world_size):
    # world_size 1: a single replica still applies the outer step (identity c)
    results = run_distributed(nesterov_rounds, world_size, 3, 2, 0.7, 0.9, timeout=80)
    for errors, moved, rounds, _ in results:
        assert rounds == 2
        assert max(errors) < 1e-6 and max(moved) < 1e-6


@pytest.mark.timeout(90)
def test_bf16_outer_all_reduce_matches_tensor_math_with_delta_in_bf16():
    bf16 = run_distributed(nesterov_rounds, 2, 3, 2, 0.7, 0.9, "bf16", timeout=80)
    fp32 = run_distributed(nesterov_rounds, 2, 3, 2, 0.7, 0.9, timeout=80)
    for (errors, moved, rounds, theta), (*_, theta_fp32) in zip(bf16, fp32, strict=True):
        assert rounds == 2
        assert max(errors) < 1e-6 and max(moved) < 1e-6
        assert (theta - theta_fp32).abs().max() > 1e-5  # the rounding really shows


# ------------------------------------------------------------------------ ledger


@pytest.mark.timeout(200)
def test_ledger_outer_bytes_per_round_and_inner_bytes_tagged_apart(tmp_path):
    common = ["run.steps=4", "strategy.inner_steps=2", "parallel.group_size=2",
              "network.ranks_per_node=2"]  # a replica = a node: DDP intra, outer inter
    runs = [(DILOCO_TINY, common),
            (DILOCO_TINY, [*common, "strategy.outer_grad_dtype=bf16"]),
            (DILOCO_TINY, [*common, "strategy.outer_grad_dtype=bf16",
                           "strategy.outer_optimizer=adam", "strategy.outer_lr=0.01"])]
    results = run_distributed(train_many, 4, runs, str(tmp_path), timeout=180)
    for rank_results in results:
        for run, wire_bytes in zip(rank_results, (4, 2, 2), strict=True):
            num_params = run["summary"]["num_params"]
            inner, outer = {}, {}
            for phase, op, step, nbytes, group_size, tier in run["ledger"]:
                assert op == "all_reduce" and group_size == 2
                assert (phase, tier) in {("inner", "intra"), ("outer", "inter")}
                per_step = inner if phase == "inner" else outer
                per_step[step] = per_step.get(step, 0) + nbytes
            assert inner == {s: num_params * 4 for s in range(4)}  # fp32 gradients
            assert outer == {1: num_params * wire_bytes, 3: num_params * wire_bytes}
            assert run["summary"]["comm_bytes_per_rank"] == num_params * (16 + 2 * wire_bytes)
    rows = [r for r in _read_metrics(tmp_path / "run1") if "outer_round" in r]
    assert [r["outer_round"] for r in rows] == [1, 2]  # rows of the round-closing steps
    assert rows[-1]["outer_bytes"] == results[0][1]["summary"]["num_params"] * 2
    assert rows[-1]["pseudo_grad_norm"] > 0 and rows[-1]["outer_s"] > 0
    strategy = load_config(DILOCO_TINY).strategy
    assert (rows[-1]["outer_lr"], rows[-1]["outer_momentum"]) == (strategy.outer_lr,
                                                                  strategy.outer_momentum)


def _read_metrics(run_dir):
    from bench.run.files import read_jsonl

    return [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "loss" in r]


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("override,message", [
    ("strategy.inner_steps=0", "strategy.inner_steps must be >= 1, got 0"),
    ("strategy.outer_lr=0", "strategy.outer_lr must be > 0, got 0.0"),
    ("strategy.outer_lr=-0.5", "strategy.outer_lr must be > 0, got -0.5"),
    ("strategy.outer_momentum=1", "strategy.outer_momentum must be in [0, 1), got 1.0"),
    ("strategy.outer_optimizer=lamb",
     "strategy.outer_optimizer must be one of ['sgd', 'adam'], got 'lamb'"),
    ("strategy.outer_grad_dtype=int8", "strategy.outer_grad_dtype must be one of"),
    ("parallel.group_size=3",
     "parallel.world_size (4) must be divisible by parallel.group_size (3)"),
    ("parallel.num_stages=2", "strategy diloco is data parallel only"),
])
def test_bad_diloco_config_fails_before_launch(override, message):
    assert_bad_config(DILOCO_TINY, override, message)


def test_tiny_config_matches_ddp_tiny_budget():
    ddp, diloco = load_config("configs/ddp-tiny.yaml"), load_config(DILOCO_TINY)
    for section in ("run", "model", "data", "optim", "parallel", "network"):
        a, b = vars(getattr(ddp, section)).copy(), vars(getattr(diloco, section)).copy()
        a.pop("name", None), b.pop("name", None)
        assert a == b, section
    assert diloco.strategy.inner_steps == 10 and ddp.parallel.world_size == 4
