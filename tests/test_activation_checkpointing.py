"""`model.activation_checkpointing: blocks` through the real loop, for every strategy and
pipeline: the same parameters as without it (recomputing a block's forward in backward
replays the same operations on the same inputs).

    pytest tests/test_activation_checkpointing.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.config import load_config
from bench.run.train import Trainer
from tests import strategies
from tests.distributed import run_distributed
from tests.helpers import assert_same_params, max_change

COMMON = ["parallel.world_size=2", "run.steps=3", "run.log_every=3", "run.val_every=0",
          "run.val_sequences=4", "model.seq_len=32", "data.batch_size=4",
          "checkpoint.final=false", "model.n_layer=2"]
CASES = {  # (config, overrides): tests/strategies.py `checkpointing`, DeepSpeed's if installed
    name: (strategies.config_of(entry, case), list(case.overrides))
    for name, (entry, case) in strategies.cases(
        "checkpointing", deepspeed=strategies.HAS_DEEPSPEED).items()}


def _train(rank, world_size, root, cache):
    """Every case with and without checkpointing; this rank's share of the final weights."""
    out = {}
    for name, (path, overrides) in CASES.items():
        for mode in ("none", "blocks"):
            cfg = load_config(path, [*COMMON, *overrides, f"data.cache_dir={cache}",
                                     f"model.activation_checkpointing={mode}"])
            run_dir = Path(root) / f"{name}-{mode}"
            run_dir.mkdir(parents=True, exist_ok=True)
            trainer = Trainer(cfg, run_dir, torch.device("cpu"), "gloo")
            start = {k: v.clone() for k, v in trainer.strategy.export_state().items()}
            trainer.run()
            out[name, mode] = (start, trainer.strategy.export_state())
            trainer.strategy.close()
    return out


@pytest.mark.timeout(600)
def test_checkpointing_blocks_gives_the_same_parameters_for_every_strategy(tmp_path):
    per_rank = run_distributed(_train, 2, str(tmp_path), str(tmp_path / "cache"), timeout=600)
    for name in CASES:
        merged = {}
        for mode in ("none", "blocks"):
            start, final = {}, {}
            for rank in per_rank:
                for key, value in rank[name, mode][0].items():
                    start.setdefault(key, value)
                for key, value in rank[name, mode][1].items():
                    final.setdefault(key, value)
            merged[mode] = (start, final)
        assert max_change(merged["none"][1], merged["none"][0]) > 1e-4, name  # it trained
        assert_same_params(merged["blocks"][1], merged["none"][1], atol=0, rtol=0)
