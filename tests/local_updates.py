"""Shared pieces of the local-update strategies' tests (DiLoCo, Pier, GASLoC, resume).

Not a test module: tests import from here, never from one another. Two kinds of helper:
- the real training loop (bench.run.train.Trainer) on a tiny config: `make_trainer`, `train`,
  `train_many` (several runs in one launch: process start-up is the slow part);
- a strategy driven directly on a 3 -> 2 linear regression, to compare it step by step
  with the same algorithm restated in tensor math: `Regression`, `regression_batch`, `flat`.
"""

from pathlib import Path

import torch
from torch import nn

from bench.config import load_config
from bench.run.train import Trainer
from tests.helpers import params_of

SMALL = ["run.log_every=1", "run.val_every=0", "run.val_sequences=2", "model.seq_len=32",
         "data.batch_size=2", "optim.warmup_steps=2", "checkpoint.final=false"]
"""Overrides that make a tiny config's run take seconds."""


def make_trainer(world_size, config, overrides, run_dir) -> Trainer:
    cfg = load_config(config, [*SMALL, f"parallel.world_size={world_size}", *overrides])
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer(cfg, run_dir, torch.device("cpu"), "gloo", keep_records=True)


def train(world_size, config, overrides, run_dir) -> dict:
    """Run the loop; return the eval model's params, the ledger rows and the summary."""
    trainer = make_trainer(world_size, config, overrides, run_dir)
    summary = trainer.run()
    trainer.strategy.close()
    ledger = [(r.phase, r.op, r.step, r.nbytes, r.group_size, r.tier)
              for r in trainer.ledger.records]
    return {"params": params_of(trainer.strategy.eval_model()), "ledger": ledger,
            "summary": summary}


def train_many(rank, world_size, runs, base_dir) -> list[dict]:
    """Several `train` runs, one after another, in one launch: runs = [(config, overrides)]."""
    return [train(world_size, config, overrides, Path(base_dir) / f"run{i}")
            for i, (config, overrides) in enumerate(runs)]


class Regression(nn.Module):
    """A linear model with the loop's `model(x, y) -> (prediction, loss)` convention."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x, y):
        prediction = self.linear(x)
        return prediction, ((prediction - y) ** 2).mean()


def regression_batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def rule_strategy(cls, config, model, rank, world_size, total_steps, inner_lr=0.1):
    """A local-update strategy `cls` on `model` with inner SGD at `inner_lr`, on the default
    group (the outer-rule tests: tests/test_outer_rules.py, tests/test_demo.py)."""
    from algorithms.base import TrainSetup
    from algorithms.comm import Communicator

    comm = Communicator(rank, world_size, "cpu")
    setup = TrainSetup(model=model, comm=comm, total_steps=total_steps,
                       make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=inner_lr))
    return cls(config, setup)


def global_flat(strategy) -> torch.Tensor:
    """The strategy's global θ, flat."""
    return torch.cat([g.detach().reshape(-1) for g in strategy.outer.global_params])
