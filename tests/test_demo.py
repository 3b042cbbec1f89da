"""DeMo (algorithms/outer_rules/demo.py): the block-DCT codec, the identity with DiLoCo, the
round against tensor math, the ledger, the refusals, the plans and the what-if.

    pytest tests/test_demo.py

- Codec: the DCT matrix is orthonormal and equals scipy's DCT-II (norm="ortho"); each
  block sends its k largest |coefficients| (scipy's 2-D DCT of the block), the residual is
  the input minus what was sent, a payload decodes to what was sent, and is 6 bytes
  (fp32 value, int16 offset) per coefficient sent.
- Identity: every coefficient sent, β = 0, no sign is DiLoCo with a plain outer SGD step
  (same η, momentum 0) on 2 gloo ranks, within 1e-6 (not bit for bit: the DCT round trip
  rounds, each element's error a few ulp of the round's Δ).
- With sign, β = 0.9 and 2 of each block's coefficients the rounds equal the algorithm
  written out with scipy's DCT (≤ 1e-5, θ and m).
- Ledger: one all_gather a round of exactly the payload's bytes; resume is bit-exact. The
  what-if's traffic description against real 4-rank runs' ledgers (every step; replica
  groups): tests/test_whatif.py, cases "demo" and "demo-hier" (tests/strategies.py).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from scipy.fft import dct, dctn
from torch import nn

from algorithms.base import strategy_class
from algorithms.diloco import DiLoCo, DiLoCoConfig
from algorithms.memory import MemoryFacts
from algorithms.outer_rules import rule_class
from algorithms.outer_rules.demo import (
    DCTCodec,
    DeMo,
    DeMoConfig,
    DeMoRule,
    block_size,
    dct_matrix,
    tensor_blocks,
)
from tests.distributed import run_distributed
from tests.local_updates import flat, global_flat, rule_strategy

INNER_LR = 0.1


class Small(nn.Module):
    """8 -> 6 -> 4: weights of 6 x 8 and 4 x 6 (blocks of 3 x 4 and 4 x 3 with chunk 4),
    biases of 6 and 4."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 6), nn.Linear(6, 4)

    def forward(self, x, y):
        out = self.second(torch.tanh(self.first(x)))
        return out, ((out - y) ** 2).mean()


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _strategy(cls, config, model, rank, world_size, total_steps):
    return rule_strategy(cls, config, model, rank, world_size, total_steps, INNER_LR)


# ------------------------------------------------------------------------ the codec


def test_dct_matrix_is_scipys_orthonormal_dct():
    for n in (1, 2, 5, 8, 64):
        d = dct_matrix(n).double()
        assert torch.allclose(d @ d.T, torch.eye(n, dtype=torch.float64), atol=1e-6)
        expected = dct(np.eye(n), type=2, norm="ortho", axis=0)
        assert np.abs(d.numpy() - expected).max() < 1e-6


def test_blocks_follow_the_largest_divisor_rule():
    assert block_size(256, 64) == 64 and block_size(96, 64) == 48
    assert block_size(12, 8) == 6 and block_size(7, 4) == 1 and block_size(3, 64) == 3
    t = tensor_blocks((256, 96), 64, 32)
    assert (t.h, t.w, t.blocks, t.k) == (64, 48, 4 * 2, 32)
    assert tensor_blocks((10,), 4, 32) == tensor_blocks((1, 10), 4, 32)  # 1-D: one row
    assert tensor_blocks((10,), 4, 32).k == 2  # runs of 2: both coefficients sent
    assert tensor_blocks((4, 2, 3), 8, 5).cols == 6  # more dims: (dim 0, the rest)


def test_codec_sends_each_blocks_largest_coefficients_and_keeps_the_rest():
    shapes = [(6, 8), (6,), (12, 10)]
    x = torch.randn(sum(int(np.prod(s)) for s in shapes),
                    generator=torch.Generator().manual_seed(0))
    codec = DCTCodec(shapes, 4, 3)
    payload, sent = codec.encode(x)
    assert payload.dtype == torch.uint8
    # blocks: 6 x 8 -> 3 x 4 (4 blocks), 6 -> runs of 3 (2), 12 x 10 -> 4 x 2 (15); 3 each
    assert codec.payload_bytes == payload.numel() == 6 * 3 * (4 + 2 + 15)
    assert DCTCodec.payload_bytes_of(shapes, 4, 3) == codec.payload_bytes
    assert torch.equal(codec.decode(payload), sent)  # what the peers decode is what m loses
    start = 0
    for shape, (h, w) in zip(shapes, [(3, 4), (1, 3), (4, 2)], strict=True):
        n = int(np.prod(shape))
        part = x[start:start + n].double().numpy().reshape(-1, shape[-1] if len(shape) > 1
                                                           else n)
        got = sent[start:start + n].double().numpy().reshape(part.shape)
        for r in range(0, part.shape[0], h):
            for c in range(0, part.shape[1], w):
                coef = dctn(part[r:r + h, c:c + w], norm="ortho")
                keep = np.argsort(-np.abs(coef).ravel())[:3]
                chosen = np.zeros(coef.size)
                chosen[keep] = coef.ravel()[keep]
                # what was sent is exactly the block's top 3 coefficients, inverted
                expected = dctn(chosen.reshape(coef.shape), norm="ortho", type=3)
                assert np.abs(got[r:r + h, c:c + w] - expected).max() < 1e-5
        start += n
    residual = x - sent
    assert residual.norm() < x.norm() and residual.abs().max() > 1e-3


def test_codec_sending_everything_round_trips_within_float_rounding():
    x = torch.randn(6 * 8 + 6, generator=torch.Generator().manual_seed(1))
    codec = DCTCodec([(6, 8), (6,)], 4, 16)
    payload, sent = codec.encode(x)
    assert (sent - x).abs().max() < 1e-6
    assert (codec.decode(payload) - x).abs().max() < 1e-6
    assert codec.payload_bytes == 6 * x.numel()  # every coefficient, once


# ------------------------------------------------------------ the rule and its config


def _cfg(world=4, group=1, shard="none"):
    return SimpleNamespace(parallel=SimpleNamespace(shard=shard, num_stages=1,
                                                    group_size=group, world_size=world,
                                                    device="cpu"))


def test_registry_row_states_and_sends():
    config = DeMoConfig()
    assert config.rule() is rule_class("demo") is DeMoRule
    assert strategy_class("demo") is DeMo
    assert DeMoRule.shards is False and DeMo.outer_states(config) == 1  # m_i
    sends = DeMoRule.sends(config)
    assert (sends.op, sends.bytes_per_element) == ("all_gather", 6 * 32 / 4096)
    facts = MemoryFacts(param_bytes=4000, optimizer={}, optimizer_step_bytes=0,
                        activation_bytes=0, world_size=4)
    cfg = SimpleNamespace(strategy=config, parallel=SimpleNamespace(
        world_size=4, group_size=1, shard="none"))
    terms = DeMo.memory_terms(cfg, facts)
    assert terms["outer: optimizer state"] == 4000  # the momentum: one θ
    assert terms["demo: gathered payloads"] == 4 * int(np.ceil(1000 * 6 * 32 / 4096))


@pytest.mark.parametrize("kwargs,cfg,message", [
    ({"outer_compression": "int8"}, _cfg(), "outer_compression='int8' with demo"),
    ({"outer_grad_dtype": "bf16"}, _cfg(), "outer_grad_dtype='bf16' with demo"),
    ({"fragments": 2, "inner_steps": 2}, _cfg(), "fragments=2 with demo"),
    ({"overlap_steps": 1, "inner_steps": 4}, _cfg(), "overlap_steps=1 with demo"),
    ({}, _cfg(world=2, group=2), "with one replica"),
    ({}, _cfg(shard="fsdp"), "does not work on shards"),
])
def test_demo_refuses_what_it_cannot_run_with(kwargs, cfg, message):
    with pytest.raises(ValueError, match=message):
        DeMoConfig(**kwargs).rule().check(DeMoConfig(**kwargs), cfg)


@pytest.mark.parametrize("kwargs,message", [
    ({"outer_momentum": 0.9}, "strategy.outer_momentum must be 0 with demo"),
    ({"momentum_decay": 1.0}, "strategy.momentum_decay must be in [0, 1), got 1.0"),
    ({"chunk_size": 129}, "strategy.chunk_size must be in [1, 128] with demo, got 129"),
    ({"topk_per_chunk": 0}, "strategy.topk_per_chunk must be in [1, chunk_size² = 4096]"),
    ({"chunk_size": 4, "topk_per_chunk": 17}, "chunk_size² = 16], got 17"),
    ({"outer_weight_decay": -1}, "strategy.outer_weight_decay must be >= 0, got -1"),
])
def test_bad_demo_config(kwargs, message):
    with pytest.raises(ValueError) as err:
        DeMoConfig(**kwargs)
    assert message in str(err.value)


# ------------------------------------------------------- identity with DiLoCo, ledger


def _pair(rank, world_size, inner_steps, rounds, lr):
    """DiLoCo (outer SGD, η, momentum 0) and DeMo sending everything, β = 0, no sign, on
    the same batches: the largest difference per step; DeMo's outer records."""
    torch.manual_seed(0)
    model = Small()
    total = inner_steps * rounds
    common = {"inner_steps": inner_steps, "outer_lr": lr, "outer_momentum": 0.0}
    diloco = _strategy(DiLoCo, DiLoCoConfig(**common, nesterov=False), model, rank,
                       world_size, total)
    demo = _strategy(DeMo, DeMoConfig(**common, chunk_size=4, topk_per_chunk=16,
                                      momentum_decay=0.0, sign=False),
                     copy.deepcopy(model), rank, world_size, total)
    start, differences = flat(model), []
    for step in range(total):
        diloco.comm.step = demo.comm.step = step
        diloco.train_step(batch(rank, step))
        demo.train_step(batch(rank, step))
        differences.append(max((flat(diloco.model) - flat(demo.model)).abs().max().item(),
                               (flat(diloco.eval_model()) - flat(demo.eval_model()))
                               .abs().max().item()))
    records = [(r.op, r.step, r.nbytes) for r in demo.comm.ledger.records
               if r.phase == "outer"]
    return differences, records, (flat(demo.eval_model()) - start).abs().max().item()


@pytest.mark.timeout(120)
def test_demo_sending_everything_unsigned_is_diloco_with_outer_sgd():
    results = run_distributed(_pair, 2, 2, 3, 0.7, timeout=100)
    n = sum(p.numel() for p in Small().parameters())
    for differences, records, moved in results:
        assert max(differences) < 1e-6  # the DCT round trip's rounding only
        assert moved > 1e-2
        # one all-gather a round of every coefficient: fp32 value + int16 offset each
        assert records == [("all_gather", step, 6 * n) for step in (1, 3, 5)]


def _math(rank, world_size, rounds, inner_steps, k, beta, lr, wd):
    """DeMo with sign against its round written out with scipy's DCT: m ← βm + Δ; per
    block the k largest |coef| sent; m ← m − sent; θ ← θ(1 − ηλ) − η sign(mean sent)."""
    torch.manual_seed(0)
    model = Small()
    reference = copy.deepcopy(model)
    config = DeMoConfig(inner_steps=inner_steps, outer_lr=lr, momentum_decay=beta,
                        chunk_size=4, topk_per_chunk=k, outer_weight_decay=wd)
    strategy = _strategy(DeMo, config, model, rank, world_size, inner_steps * rounds)
    inner = torch.optim.SGD(reference.parameters(), lr=INNER_LR)
    theta = flat(reference).double()
    m = torch.zeros_like(theta)
    blocks = {(6, 8): (3, 4), (6,): (1, 3), (4, 6): (4, 3), (4,): (1, 4)}
    errors = []
    for t in range(rounds):
        for h in range(inner_steps):
            step = t * inner_steps + h
            strategy.train_step(batch(rank, step))
            inner.zero_grad()
            reference(*batch(rank, step))[1].backward()
            inner.step()
        m = beta * m + (theta - flat(reference).double())
        sent, start = torch.zeros_like(m), 0
        for p in reference.parameters():
            n, (h, w) = p.numel(), blocks[tuple(p.shape)]
            part = m[start:start + n].numpy().reshape(-1 if p.dim() > 1 else 1, p.shape[-1])
            out = np.zeros_like(part)
            for r in range(0, part.shape[0], h):
                for c in range(0, part.shape[1], w):
                    coef = dctn(part[r:r + h, c:c + w], norm="ortho")
                    keep = np.argsort(-np.abs(coef).ravel())[:k]
                    chosen = np.zeros(coef.size)
                    chosen[keep] = coef.ravel()[keep]
                    out[r:r + h, c:c + w] = dctn(chosen.reshape(coef.shape), norm="ortho",
                                                 type=3)
            sent[start:start + n] = torch.from_numpy(out.reshape(-1))
            start += n
        m = m - sent
        everyone = [torch.empty_like(sent) for _ in range(world_size)]
        dist.all_gather(everyone, sent)
        theta = theta * (1 - lr * wd) - lr * torch.stack(everyone).mean(0).sign()
        torch.nn.utils.vector_to_parameters(theta.float().clone(), reference.parameters())
        errors.append(max((global_flat(strategy).double() - theta).abs().max().item(),
                          (strategy.outer.parts[0].rule.accumulator.double() - m).abs().max()
                          .item()))
    return errors


@pytest.mark.timeout(90)
def test_demo_round_matches_tensor_math():
    for errors in run_distributed(_math, 2, 3, 2, 2, 0.9, 0.05, 0.1, timeout=80):
        assert max(errors) < 1e-5


def _resume(rank, world_size, inner_steps, rounds, stop):
    config = DeMoConfig(inner_steps=inner_steps, outer_lr=0.05, chunk_size=4,
                        topk_per_chunk=2, momentum_decay=0.9)
    total = inner_steps * rounds
    torch.manual_seed(0)
    initial = Small()
    straight = _strategy(DeMo, config, copy.deepcopy(initial), rank, world_size, total)
    first = _strategy(DeMo, config, copy.deepcopy(initial), rank, world_size, total)
    for step in range(total):
        straight.train_step(batch(rank, step))
    for step in range(stop):
        first.train_step(batch(rank, step))
    resumed = _strategy(DeMo, config, Small(), rank, world_size, total)
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    for step in range(stop, total):
        resumed.train_step(batch(rank, step))
    return ((flat(straight.model) - flat(resumed.model)).abs().max().item()
            + (global_flat(straight) - global_flat(resumed)).abs().max().item())


@pytest.mark.timeout(90)
def test_demo_resume_bit_for_bit():
    assert run_distributed(_resume, 2, 2, 4, 5, timeout=60) == [0.0] * 2
