"""Resume: a run interrupted at a checkpoint and resumed ends with the same parameters,
bit for bit, as the same run made in one go; one test, parametrised over strategies.

Each case checkpoints where a strategy has state to lose: DiLoCo mid-round (outer
momentum, offloaded global θ, inner Adam state), Pier after its lazy start's momentum
fill and mid-round, GASLoC mid-round with a worker idling part of each round (θ_i,
y_prev, the round counter, the idle worker's last loss), DDP (optimizer state).
Runs go through the real loop (bench.train.Trainer) on 2 gloo ranks.
"""

import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.helpers import assert_same_params, params_of
from tests.local_updates import make_trainer

CASES = {
    "ddp": ("configs/ddp-tiny.yaml", ["run.steps=6", "checkpoint.every=3"], 3),
    "diloco": ("configs/diloco-tiny.yaml",  # H = 4, checkpoint at 6: mid-round
               ["run.steps=8", "strategy.inner_steps=4", "checkpoint.every=6",
                "strategy.offload_outer=true"], 6),
    "pier": ("configs/pier-tiny.yaml",  # lazy start 2 steps (one fill), outer steps at 4, 6, 8
             ["run.steps=8", "strategy.inner_steps=2", "strategy.warmup_fraction=0.25",
              "checkpoint.every=5"], 5),
    "gasloc": ("configs/gasloc-tiny.yaml",  # rounds of 2, worker 1 idles; checkpoint mid-round
               ["run.steps=8", "strategy.inner_steps=[2, 1]", "checkpoint.every=5"], 5),
}


def straight_then_resumed(rank, world_size, config, overrides, run_dir):
    """Train straight through (checkpointing on the way), then resume from the checkpoint.

    Returns (straight params, resumed params, resumed worker params, checkpoint step,
    straight worker params): the evaluated model and this rank's own model.
    """
    straight = make_trainer(world_size, config, overrides, run_dir)
    straight.run()
    straight_own = params_of(straight.strategy.model)
    straight_eval = params_of(straight.strategy.eval_model())
    straight.strategy.close()
    os.environ["COMMBENCH_RESUME"] = "1"
    try:
        resumed = make_trainer(world_size, config, overrides, run_dir)
        step = torch.load(resumed.records.state_checkpoint(resumed.rank), weights_only=False)["step"]
        resumed.run()
    finally:
        del os.environ["COMMBENCH_RESUME"]
    return (straight_eval, params_of(resumed.strategy.eval_model()),
            params_of(resumed.strategy.model), step, straight_own)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", CASES)
def test_resumed_run_ends_with_the_same_parameters(tmp_path, case):
    config, overrides, checkpoint_step = CASES[case]
    results = run_distributed(straight_then_resumed, 2, config, overrides, str(tmp_path),
                              timeout=130)
    for straight, resumed, resumed_own, step, straight_own in results:
        assert step == checkpoint_step  # the second run really resumed there
        assert_same_params(resumed, straight, atol=0, rtol=0)
        assert_same_params(resumed_own, straight_own, atol=0, rtol=0)

