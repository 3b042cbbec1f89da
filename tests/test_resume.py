"""Resume: a run interrupted at a checkpoint and resumed ends with the same parameters,
bit for bit, as the same run made in one go; one test, parametrised over strategies.

Each case checkpoints where a strategy has state to lose: DiLoCo mid-round (outer
momentum, offloaded global θ, inner Adam state), Pier after its lazy start's momentum
fill and mid-round, GASLoC mid-round with a worker idling part of each round (θ_i,
y_prev, the round counter, the idle worker's last loss), DDP (optimizer state).
Runs go through the real loop (bench.run.train.Trainer) on 2 gloo ranks, and on 4: with 3 or
more ranks a reduction's summation order depends on how DDP buckets the gradients (2 ranks
sum commutatively), which caught DDP rebuilding its buckets after the first step of each
process (algorithms/base.py `DataParallelStrategy.warm_up`). The 4-rank cases checkpoint
off the logging grid; the long ones (44 steps, every family) run under `tox -e slow`.
"""

import os

import pytest

from tests import strategies
from tests.distributed import run_distributed
from tests.helpers import assert_same_params, params_of
from tests.local_updates import make_trainer


def saved_step(run) -> int:
    """The step of the run's complete checkpoint (bench/run/dcp_state.py)."""
    from bench.run import dcp_state

    return int(dcp_state.latest(run)[1]["step"])


def launch_timeout(case) -> int:
    """Seconds for a case's launch: 2 ranks 130, 4 ranks 280, a slow one (44 steps) 880."""
    return 880 if case.slow else 130 if case.ranks <= 2 else 280


def straight_then_resumed(rank, world_size, config, overrides, run_dir):
    """Train straight through (checkpointing on the way), then resume from the checkpoint.

    Returns (straight params, resumed params, resumed worker params, checkpoint step,
    straight worker params): the evaluated model and this rank's own model.
    """
    straight = make_trainer(world_size, config, overrides, run_dir)
    straight.run()
    straight_own = params_of(own_model(straight.strategy))
    straight_eval = params_of(straight.strategy.eval_model())
    straight.strategy.close()
    os.environ["COMMBENCH_RESUME"] = "1"
    try:
        resumed = make_trainer(world_size, config, overrides, run_dir)
        step = saved_step(resumed.records)
        resumed.run()
    finally:
        del os.environ["COMMBENCH_RESUME"]
    return (straight_eval, params_of(resumed.strategy.eval_model()),
            params_of(own_model(resumed.strategy)), step, straight_own)


def own_model(strategy):
    """This rank's own weights: the replica or worker (a pipeline: its stage)."""
    return getattr(strategy, "model", None) or strategy.eval_model()


RESUMES = [  # (ranks, config, overrides, checkpoint step, timeout s): tests/strategies.py
    pytest.param(case.ranks, strategies.config_of(entry, case), list(case.overrides),
                 case.checkpoint_step, launch_timeout(case), id=case_id,
                 marks=[pytest.mark.timeout(launch_timeout(case) + 20),
                        *([pytest.mark.slow] if case.slow else [])])
    for case_id, (entry, case) in sorted(strategies.cases("resume").items(),
                                         key=lambda item: (item[1][1].slow, item[1][1].ranks))
]


@pytest.mark.parametrize("world, config, overrides, checkpoint_step, timeout", RESUMES)
def test_resumed_run_ends_with_the_same_parameters(tmp_path, world, config, overrides,
                                                   checkpoint_step, timeout):
    """Bit for bit: the evaluated model and this rank's own, and really from the checkpoint."""
    results = run_distributed(straight_then_resumed, world, config, overrides, str(tmp_path),
                              timeout=timeout)
    for straight, resumed, resumed_own, step, straight_own in results:
        assert step == checkpoint_step  # the second run really resumed there
        assert_same_params(resumed, straight, atol=0, rtol=0)
        assert_same_params(resumed_own, straight_own, atol=0, rtol=0)


# ------------------------------------------------------------------------ stop signals

STOPS = {  # family -> (config, overrides): a stop asked on rank 1 in step 5 (tests/strategies.py)
    family: (strategies.config_of(entry, case), list(case.overrides))
    for family, (entry, case) in strategies.cases("stop").items()}


def straight_stopped_resumed(rank, world_size, config, overrides, base):
    """The run straight through; the same run stopped by a SIGTERM that only rank 1
    receives, at step 5; then resumed. Returns what the test compares."""
    from bench.run.stop import handle_signals

    overrides = [*overrides, "checkpoint.every=100"]  # the stop's checkpoint is the only one
    straight = make_trainer(world_size, config, overrides, f"{base}/straight")
    straight.run()
    straight.strategy.close()
    os.environ["COMMBENCH_FAULT"] = "1:5:sigterm"
    try:
        stopped = make_trainer(world_size, config, overrides, f"{base}/cut")
        handle_signals(stopped.stop)
        summary = stopped.run()
        stopped.strategy.close()
    finally:
        del os.environ["COMMBENCH_FAULT"]
    os.environ["COMMBENCH_RESUME"] = "1"
    try:
        resumed = make_trainer(world_size, config, overrides, f"{base}/cut")
        saved = saved_step(resumed.records)
        resumed.run()
    finally:
        del os.environ["COMMBENCH_RESUME"]
    return {"summary": summary, "checkpoint_step": saved,
            "straight": params_of(own_model(straight.strategy)),
            "resumed": params_of(own_model(resumed.strategy)),
            "straight_eval": params_of(straight.strategy.eval_model()),
            "resumed_eval": params_of(resumed.strategy.eval_model())}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("family", [  # ~30 s each: one family in the default tests
    pytest.param(family, marks=[pytest.mark.slow] if case.slow else [])
    for family, (_, case) in strategies.cases("stop").items()])
def test_a_stop_signal_checkpoints_where_all_ranks_agree_and_resumes_bit_exact(tmp_path,
                                                                             family):
    """bench/run/stop.py: one rank's SIGTERM stops every rank at one step boundary (the first
    after it that all can reach), with a checkpoint there; the resumed run ends with the
    uninterrupted run's parameters, and its metrics rows (a stop between two rows: the
    open window is in the checkpoint) hold the same losses."""
    from bench.run.records import RunDir

    config, overrides = STOPS[family]
    results = run_distributed(straight_stopped_resumed, 2, config, overrides, str(tmp_path),
                              timeout=180)
    steps = {r["summary"]["steps"] for r in results}
    assert len(steps) == 1, steps  # one boundary for every rank
    (step,) = steps
    # the first boundary both ranks can reach: at most the next synchronisation after step 5
    assert 5 < step <= 8
    log_every = int(next(o for o in overrides if o.startswith("run.log_every=")).split("=")[1])
    assert step % log_every, step  # off the rows' grid: the checkpoint carries an open window
    for r in results:
        assert r["checkpoint_step"] == step  # saved at the stop, and resumed from there
        assert r["summary"]["interrupted"] is True and r["summary"]["stopped_by"] == "SIGTERM"
        assert r["summary"]["status"] == "failed"
        assert_same_params(r["resumed"], r["straight"], atol=0, rtol=0)
        assert_same_params(r["resumed_eval"], r["straight_eval"], atol=0, rtol=0)
    straight, cut = RunDir(tmp_path / "straight"), RunDir(tmp_path / "cut")
    rows = [(r["step"], r.get("loss"), r.get("val_loss")) for r in straight.read_metrics()]
    assert [(r["step"], r.get("loss"), r.get("val_loss")) for r in cut.read_metrics()] == rows
