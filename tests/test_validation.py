"""The validation set: the same windows for every layout, scored as the exact mean.

    pytest tests/test_validation.py

A run is scored on `run.val_sequences` windows of the held-out split (bench/data/batches.py
`validation_set`), whatever its batch size, world size or pipeline depth; every strategy's
`evaluate` returns the mean over all of their positions (a sum of batch loss x positions
over the ranks, over the positions), never a mean of batch means, which would depend on
how the set was cut. The report and `commbench claims` refusing to compare runs on
different sets are tested in tests/test_report.py and tests/test_claims.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from algorithms.base import mean_loss
from bench.config import load_config
from bench.data import load_corpus
from bench.data.batches import validation_set
from bench.model import GPT, GPTConfig, build_model
from bench.run.train import Trainer
from tests.distributed import run_distributed

TOKENS = np.random.default_rng(0).integers(0, 64, 32 * 40 + 1).astype(np.uint16)
TOKENS[: 32 * 20] //= 8  # the first half of the windows uses 8 of the 64 tokens
"""A made-up split of 40 windows of seq_len 32 whose windows differ in loss."""
TINY = ["configs/ddp-tiny.yaml", "configs/pipeline-1f1b-tiny.yaml", "configs/2bw-tiny.yaml"]


def _model() -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=32, n_layer=1, n_head=2, n_embd=16))
    with torch.no_grad():
        model.embed.wte.weight.mul_(20)  # sharp logits: windows differ clearly in loss
    return model


def _mean_of_batch_means(model, batches) -> float:
    return float(np.mean([model(x, y)[1].item() for x, y in batches]))


@torch.no_grad()
def test_mean_loss_is_the_exact_mean_whatever_the_batching():
    model, vs = _model(), validation_set(TOKENS, 32, 10)
    xs, ys = zip(*vs.batches(10), strict=True)
    whole = model(torch.cat(xs), torch.cat(ys))[1].item()  # every window in one forward
    for cut in (1, 3, 4, 7, 10):
        assert mean_loss(model, vs.batches(cut), torch.device("cpu")) == pytest.approx(
            whole, rel=1e-6)
    # the defect this guards against: batches of 4, 4 and 2 averaged as equals
    assert abs(_mean_of_batch_means(model, vs.batches(4)) - whole) > 1e-4


def _two_rank_shares(rank, world_size):
    model, vs = _model(), validation_set(TOKENS, 32, 7)
    whole = torch.cat([x for x, _ in vs.batches(7)]), torch.cat([y for _, y in vs.batches(7)])
    single = model(*whole)[1].item()
    # rank 0 gets 4 windows (batches of 3 and 1), rank 1 gets 3 (one batch of 3)
    mine = vs.batches(3, rank, world_size)
    # one window: rank 1 has none and still joins the reduction
    one = validation_set(TOKENS, 32, 1)
    alone = mean_loss(model, one.batches(3, rank, world_size), torch.device("cpu"))
    return (single, mean_loss(model, mine, torch.device("cpu")), [len(x) for x, _ in mine],
            model(*one.batches(1)[0])[1].item(), alone)


@pytest.mark.timeout(120)
def test_mean_loss_over_two_gloo_ranks_equals_one_batch_of_everything():
    (single, exact0, cut0, one, alone0), (_, exact1, cut1, _, alone1) = run_distributed(
        _two_rank_shares, 2, timeout=90)
    assert (cut0, cut1) == ([3, 1], [3])
    assert exact0 == exact1 == pytest.approx(single, rel=1e-6)
    assert alone0 == alone1 == pytest.approx(one, rel=1e-6)


def _tiny_config_validation(rank, world_size, root):
    """Per config: the set, this rank's shard of it, the loop's validation loss and one
    uneven evaluation against a single batch of everything, all before any step."""
    out = []
    for i, path in enumerate(TINY):
        cfg = load_config(path, ["checkpoint.final=false"])
        trainer = Trainer(cfg, f"{root}/{i}", torch.device("cpu"), "gloo")
        shard, num_shards = trainer.strategy.data_shard()
        splits = load_corpus(cfg.data.corpus, cfg.data.tokenizer, cfg.data.cache_dir,
                             cfg.data.val_fraction)
        loss = trainer.validate()[0]
        # an uneven cut: 10 windows over the shards, in batches of at most 3
        uneven = validation_set(splits.val, cfg.model.seq_len, 10)
        uneven_loss = trainer.strategy.evaluate(uneven.batches(3, shard, num_shards))
        reference = {}
        whole = build_model(trainer.model_config)  # pipeline ranks hold only their stage
        whole.init_seed = trainer.model.init_seed  # the loop's model, all of it
        whole.init_weights()
        for name, vs in (("shipped", trainer.val_set), ("uneven", uneven)):
            x, y = vs.batches(vs.sequences)[0]
            reference[name] = mean_loss(whole, [(x, y)], torch.device("cpu"))
        trainer.strategy.close()
        out.append({"record": trainer.val_set.record(), "shard": (shard, num_shards),
                    "windows": torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in trainer.val]
                                         ).numpy(),
                    "all": trainer.val_set.windows, "loss": loss, "uneven": uneven_loss,
                    "reference": reference})
    return out


@pytest.mark.timeout(240)
def test_tiny_configs_validate_on_the_same_windows_with_the_same_loss(tmp_path):
    """ddp-tiny (4 shards of batch 8), pipeline-1f1b-tiny and 2bw-tiny (2 replicas of batch
    16, 2 stages each): one validation set, each replica's windows a disjoint share of it,
    and the loss of the untrained model (the same on every layout) equal to one batch of
    all the windows, for the shipped set and an uneven cut of another."""
    per_rank = run_distributed(_tiny_config_validation, 4, str(tmp_path), timeout=200)
    first = per_rank[0][0]
    assert first["record"]["sequences"] == 64 and first["record"]["seq_len"] == 128
    for i, path in enumerate(TINY):
        ranks = [r[i] for r in per_rank]
        assert all(r["record"] == first["record"] for r in ranks), path
        assert all(np.array_equal(r["all"], first["all"]) for r in ranks), path
        shares = {r["shard"]: r["windows"] for r in ranks}  # stages of a replica share one
        union = np.concatenate(list(shares.values()))
        assert len(union) == 64, path
        assert sorted(map(bytes, union.astype("<u2"))) == sorted(
            map(bytes, first["all"].astype("<u2"))), path
        for r in ranks:
            assert r["loss"] == pytest.approx(r["reference"]["shipped"], rel=1e-6), path
            assert r["uneven"] == pytest.approx(r["reference"]["uneven"], rel=1e-6), path
            assert r["reference"] == pytest.approx(first["reference"], rel=1e-6), path
