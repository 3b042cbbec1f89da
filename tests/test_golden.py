"""Golden trajectories: the first training losses of each strategy's tiny config, bit-exact.

    pytest tests/test_golden.py                              # check against tests/golden/*.json
    COMMBENCH_WRITE_GOLDEN=1 pytest tests/test_golden.py     # rewrite them, on purpose

Each case is a ready config (configs/*-tiny.yaml) cut to STEPS steps (shorter rounds for
the local-update methods, so that several outer rounds and gossip exchanges happen), run
by the real loop (bench.run.train.Trainer) on 4 gloo ranks, one thread each. Every loss the
loop logs (the mean over ranks, one row per step) must equal the fixture's to REL_TOL
(not bit for bit: the last float32 bits differ between x86-64 CPU generations), so any
change to the math, intended or not, fails here. When a change is intended, regenerate
and let the fixture's diff show the new trajectory in review.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from bench.config import load_config
from bench.run.files import read_jsonl
from bench.run.train import Trainer
from tests import strategies
from tests.distributed import run_distributed

GOLDEN = Path(__file__).resolve().parent / "golden"
WRITE = os.environ.get("COMMBENCH_WRITE_GOLDEN") == "1"
STEPS = 10
REL_TOL = 1e-5
"""Losses must match to 1e-5 relative: float32 CPU kernels differ in the last bits between
x86-64 generations (AVX2 vs AVX-512/AMX machines differ by ~1e-7 from step 1, growing to
~1e-6 by step 10), while any change to the math moves them by orders more."""
COMMON = [f"run.steps={STEPS}", "run.log_every=1", "run.val_every=0", "run.val_sequences=8",
          "optim.warmup_steps=2", "checkpoint.final=false", "parallel.world_size=4"]
CASES: dict[str, tuple[str, list[str]]] = {
    case_id: (strategies.config_of(entry, case), list(case.overrides))
    for case_id, (entry, case) in strategies.cases("golden").items()}
"""Fixture name -> (tiny config, overrides): tests/strategies.py `golden` (rounds of 3
inner steps for the local-update methods)."""
NEEDS_DEEPSPEED = {case_id for case_id, (_, case) in strategies.cases("golden").items()
                   if case.deepspeed}


def _trajectories(rank, world_size, cases, root):
    """Every case on this rank, one after the other; rank 0 returns the logged losses."""
    losses = {}
    for name, (path, overrides) in cases.items():
        cfg = load_config(path, [*COMMON, *overrides])
        run_dir = Path(root) / name
        run_dir.mkdir(parents=True, exist_ok=True)
        trainer = Trainer(cfg, run_dir, torch.device("cpu"), "gloo")
        trainer.run()
        trainer.strategy.close()
        rows = read_jsonl(run_dir / "metrics.jsonl") if rank == 0 else []
        losses[name] = [[row["step"], row["loss"]] for row in rows if "loss" in row]
    return losses


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory):
    cases = {name: case for name, case in CASES.items()
             if strategies.HAS_DEEPSPEED or name not in NEEDS_DEEPSPEED}
    root = tmp_path_factory.mktemp("golden")
    return run_distributed(_trajectories, 4, cases, str(root), timeout=400)[0]


def _fixture(name: str) -> dict:
    path, overrides = CASES[name]
    return {"config": path, "overrides": [*COMMON, *overrides], "world_size": 4,
            "torch": torch.__version__.split("+")[0]}


def _dumps(fixture: dict) -> str:
    """JSON with one [step, loss] row per line, so that a regenerated fixture diffs by step."""
    head = json.dumps({k: v for k, v in fixture.items() if k != "losses"}, indent=1)
    rows = ",\n".join(f"  {json.dumps(row)}" for row in fixture["losses"])
    return f'{head[:-2]},\n "losses": [\n{rows}\n ]\n}}\n'


@pytest.mark.timeout(450)
@pytest.mark.parametrize("name", list(CASES))
def test_first_losses_equal_the_golden_trajectory(trajectories, name):
    if name not in trajectories:
        pytest.skip("deepspeed is not installed")
    losses = trajectories[name]
    assert [step for step, _ in losses] == list(range(1, STEPS + 1)), "one loss row per step"
    path = GOLDEN / f"{name}.json"
    if WRITE:
        path.write_text(_dumps({**_fixture(name), "losses": losses}))
        return
    if not path.exists():
        pytest.fail(f"no fixture {path}; write it with COMMBENCH_WRITE_GOLDEN=1")
    golden = json.loads(path.read_text())
    assert golden["overrides"] == _fixture(name)["overrides"], (
        f"{path.name} was written for other overrides; regenerate with COMMBENCH_WRITE_GOLDEN=1")
    mismatches = [(g[0], g[1], got[1]) for g, got in zip(golden["losses"], losses, strict=True)
                  if g[0] != got[0] or abs(g[1] - got[1]) > REL_TOL * abs(g[1])]
    assert not mismatches, (
        f"{name}: losses differ from {path.name} at {len(mismatches)} of {STEPS} steps, "
        f"first (step, golden, now) = {mismatches[0]}; if the change is intended, regenerate "
        "with COMMBENCH_WRITE_GOLDEN=1 and review the diff")
