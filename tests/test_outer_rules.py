"""Outer rules (algorithms/outer_rules/): the registry, SparseLoCo's and NoLoCo's identities
with DiLoCo, their rounds against tensor math, their ledgers and their resume.

    pytest tests/test_outer_rules.py

- Registry: every row imports and says its state count, shard support and what it sends;
  sgd's and adam's state counts are those DiLoCo's memory plan always had.
- SparseLoCo with every entry sent (topk_per_chunk = chunk_size), fp32 values and no
  error decay is DiLoCo with the same outer SGD step, bit for bit (2 gloo ranks, one
  fragment and two); with 2-bit top-k it equals the round written out in tensor math.
- NoLoCo with 2 replicas (the peer is everyone) is DiLoCo with the same outer SGD step,
  bit for bit (Nesterov or not); with 4 it equals the pairs' math written out by hand.
- state_dict / load_state_dict: a strategy restored mid-run continues bit for bit.

The strategies run on a linear regression (tests/local_updates.py), each step's batch
the same for the two strategies compared, through real gloo groups with timeouts.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from algorithms.diloco import DiLoCo, DiLoCoConfig
from algorithms.gasloc import round_peers
from algorithms.outer_rules import RULES, rule_class
from algorithms.outer_rules.demo import DeMoConfig
from algorithms.outer_rules.noloco import NoLoCo, NoLoCoConfig
from algorithms.outer_rules.sparseloco import ChunkCodec, SparseLoCo, SparseLoCoConfig
from tests.distributed import run_distributed
from tests.local_updates import Regression, flat, global_flat, regression_batch, rule_strategy

INNER_LR = 0.1


class TwoBlocks(nn.Module):
    """Two blocks (3 -> 3 -> 2) with `as_layers()`, so that Streaming DiLoCo's fragments
    (algorithms/streaming.py) can cut it in two."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(3, 3), nn.Linear(3, 2)

    def as_layers(self):
        return [nn.Identity(), self.first, self.second, nn.Identity()]

    def forward(self, x, y):
        out = self.second(torch.tanh(self.first(x)))
        return out, ((out - y) ** 2).mean()


def _strategy(cls, config, model, rank, world_size, total_steps):
    return rule_strategy(cls, config, model, rank, world_size, total_steps, INNER_LR)


# ------------------------------------------------------------------------ the registry


def test_every_rule_says_its_state_shards_and_sends():
    configs = {"sgd": DiLoCoConfig(), "adam": DiLoCoConfig(outer_optimizer="adam"),
               "sparseloco": SparseLoCoConfig(), "noloco": NoLoCoConfig(),
               "demo": DeMoConfig()}
    assert set(configs) == set(RULES)
    for name, config in configs.items():
        rule = rule_class(name)
        assert config.rule() is rule
        assert isinstance(rule.shards, bool)
        assert rule.states(config) >= 0
        sends = rule.sends(config)
        assert sends.op in {"all_reduce", "all_gather", "quantized_all_reduce", "exchange"}
        assert sends.bytes_per_element > 0
    # the state counts DiLoCo's memory plan had before the registry
    assert DiLoCo.outer_states(DiLoCoConfig(outer_momentum=0)) == 0
    assert DiLoCo.outer_states(DiLoCoConfig()) == 1
    assert DiLoCo.outer_states(DiLoCoConfig(outer_optimizer="adam")) == 2
    assert SparseLoCo.outer_states(SparseLoCoConfig()) == 1  # the error feedback, no momentum
    assert SparseLoCo.outer_states(SparseLoCoConfig(outer_momentum=0.9)) == 2
    assert rule_class("sgd").sends(DiLoCoConfig(outer_grad_dtype="bf16")).bytes_per_element == 2
    assert NoLoCoConfig().rule().sends(NoLoCoConfig()).peers == "pair"
    with pytest.raises(ValueError, match="strategy.outer_optimizer must be one of"):
        rule_class("lamb")


def _cfg(shard="none"):
    return SimpleNamespace(parallel=SimpleNamespace(shard=shard, num_stages=1, group_size=1,
                                                    device="cpu"))


@pytest.mark.parametrize("config,message", [
    (SparseLoCoConfig(outer_compression="int8"), "outer_compression='int8' with sparseloco"),
    (SparseLoCoConfig(outer_grad_dtype="bf16"), "outer_grad_dtype='bf16' with sparseloco"),
    (NoLoCoConfig(overlap_steps=1), "overlap_steps=1 with noloco"),
    (NoLoCoConfig(outer_compression="topk"), "outer_compression='topk' with noloco"),
])
def test_rules_refuse_what_they_cannot_run_with(config, message):
    with pytest.raises(ValueError, match=message):
        config.check(_cfg())


@pytest.mark.parametrize("kwargs,message", [
    ({"chunk_size": 1}, "strategy.chunk_size must be in [2, 32768], got 1"),
    ({"chunk_size": 2 ** 16}, "strategy.chunk_size must be in [2, 32768], got 65536"),
    ({"topk_per_chunk": 0}, "strategy.topk_per_chunk must be in [1, chunk_size=4096], got 0"),
    ({"error_decay": 1.5}, "strategy.error_decay must be in [0, 1], got 1.5"),
])
def test_bad_sparseloco_config(kwargs, message):
    with pytest.raises(ValueError) as err:
        SparseLoCoConfig(**kwargs)
    assert message in str(err.value)


def test_bad_noloco_config():
    with pytest.raises(ValueError, match="strategy.pull must be >= 0 or null, got -1"):
        NoLoCoConfig(pull=-1)


# ------------------------------------------------------------------- SparseLoCo's codec


def test_chunk_codec_round_trip_and_sizes():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    codec = ChunkCodec(x.numel(), 4096, 64, "2bit")
    payload, sent = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes
    assert codec.payload_bytes == 3 * 64 // 4 + 2 * 3 * 64 + 4 * 3  # codes, int16 offsets, scales
    assert torch.equal(codec.decode(payload), sent)  # what the peers decode is what e loses
    chosen = sent != 0
    assert chosen.sum() == 3 * 64
    padded = torch.zeros(3 * 4096)
    padded[:x.numel()] = x
    for c in range(3):  # each chunk sends its k largest magnitudes, within s/3 of each
        part, got = padded[c * 4096:(c + 1) * 4096], sent[c * 4096:(c + 1) * 4096]
        top = part.abs().topk(64).indices
        assert set(top.tolist()) == set(torch.nonzero(got).view(-1).tolist())
        scale = part[top].abs().max()
        assert (got[top] - part[top]).abs().max() <= scale / 3 + 1e-6
        assert set(torch.unique((got[top] / scale * 3).round()).tolist()) <= {-3, -1, 1, 3}
    assert ChunkCodec.bytes_per_element(4096, 64, "2bit") == (16 + 128 + 4) / 4096
    lossless = ChunkCodec(x.numel(), 4096, 4096, "fp32")
    payload, sent = lossless.encode(x)
    assert torch.equal(sent, x) and torch.equal(lossless.decode(payload), x)


# ------------------------------------------------- identities with DiLoCo, bit for bit


def _pair_of_runs(rank, world_size, other, other_kwargs, diloco_kwargs, inner_steps, rounds,
                  model_cls):
    """DiLoCo and `other` side by side on the same batches: per step the largest difference
    of the replicas and of the evaluated models, and `other`'s outer ledger records."""
    torch.manual_seed(0)
    model = model_cls()
    total = inner_steps * rounds
    common = {"inner_steps": inner_steps, **diloco_kwargs}
    diloco = _strategy(DiLoCo, DiLoCoConfig(**common), model, rank, world_size, total)
    cls, config_cls = {"sparseloco": (SparseLoCo, SparseLoCoConfig),
                       "noloco": (NoLoCo, NoLoCoConfig)}[other]
    strategy = _strategy(cls, config_cls(**common, **other_kwargs), copy.deepcopy(model), rank,
                         world_size, total)
    differences, start = [], flat(model)
    for step in range(total):
        batch = regression_batch(rank, step)
        diloco.comm.step = strategy.comm.step = step  # what the loop does
        diloco.train_step(batch)
        strategy.train_step(batch)
        differences.append(max((flat(diloco.model) - flat(strategy.model)).abs().max().item(),
                               (flat(diloco.eval_model()) - flat(strategy.eval_model()))
                               .abs().max().item()))
    records = [(r.phase, r.op, r.step, r.nbytes, r.peers) for r in strategy.comm.ledger.records
               if r.phase == "outer"]
    moved = (flat(strategy.eval_model()) - start).abs().max().item()
    return differences, records, moved


EVERYTHING_SENT = {"chunk_size": 4, "topk_per_chunk": 4, "value_format": "fp32",
                   "error_decay": 0.0}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model_cls,fragments", [(Regression, 1), (TwoBlocks, 2)])
def test_sparseloco_sending_everything_is_diloco_bit_for_bit(model_cls, fragments):
    outer = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True, "fragments": fragments}
    results = run_distributed(_pair_of_runs, 2, "sparseloco", EVERYTHING_SENT, outer,
                              2, 3, model_cls, timeout=100)
    for differences, records, moved in results:
        assert max(differences) == 0.0  # bit for bit, every step
        assert moved > 1e-3
        assert {op for _, op, *_ in records} == {"all_gather"}
        # one fragment: a round every 2 steps; two: one fragment a step, both at the last
        assert len(records) == {1: 3, 2: 7}[fragments]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nesterov", [False, True])
def test_noloco_with_two_replicas_is_diloco_bit_for_bit(nesterov):
    outer = {"outer_lr": 0.7, "outer_momentum": 0.5, "nesterov": nesterov}
    results = run_distributed(_pair_of_runs, 2, "noloco", {}, outer, 2, 3, Regression,
                              timeout=100)
    num_params = sum(p.numel() for p in Regression().parameters())
    for rank, (differences, records, moved) in enumerate(results):
        assert max(differences) == 0.0
        assert moved > 1e-3
        # one exchange a round: Δ_i and φ_i, fp32, to the other replica
        assert records == [("outer", "exchange", step, 2 * 4 * num_params, (1 - rank,))
                           for step in (1, 3, 5)]


# ----------------------------------------------------------------- against tensor math


def _sparseloco_math(rank, world_size, rounds, inner_steps, chunk, k, beta, lr):
    """SparseLoCo (2-bit) against its round written out: e ← βe + Δ; per chunk the k
    largest |e|, coded to {±1/3, ±1}·max; e ← e − sent; θ ← θ − η mean(sent)."""
    torch.manual_seed(0)
    model = Regression()
    reference = copy.deepcopy(model)
    config = SparseLoCoConfig(inner_steps=inner_steps, outer_lr=lr, error_decay=beta,
                              chunk_size=chunk, topk_per_chunk=k)
    strategy = _strategy(SparseLoCo, config, model, rank, world_size, inner_steps * rounds)
    inner = torch.optim.SGD(reference.parameters(), lr=INNER_LR)
    theta = flat(reference)
    error = torch.zeros_like(theta)
    errors = []
    for t in range(rounds):
        for h in range(inner_steps):
            step = t * inner_steps + h
            strategy.train_step(regression_batch(rank, step))
            inner.zero_grad()
            reference(*regression_batch(rank, step))[1].backward()
            inner.step()
        error = beta * error + (theta - flat(reference))
        sent = torch.zeros_like(error)
        for start in range(0, error.numel(), chunk):
            part = error[start:start + chunk]
            top = part.abs().topk(min(k, part.numel())).indices
            scale = part[top].abs().max()
            levels = ((part[top] / scale + 1) * 1.5).round().clamp(0, 3) * (2 / 3) - 1
            sent[start + top] = levels * scale
        error = error - sent
        everyone = [torch.empty_like(sent) for _ in range(world_size)]
        dist.all_gather(everyone, sent)
        theta = theta - lr * torch.stack(everyone).sum(0) / world_size
        torch.nn.utils.vector_to_parameters(theta.clone(), reference.parameters())
        errors.append(max((global_flat(strategy) - theta).abs().max().item(),
                          (strategy.outer.parts[0].rule.accumulator - error).abs().max().item()))
    return errors


@pytest.mark.timeout(90)
def test_sparseloco_round_matches_tensor_math():
    # 8 parameters in chunks of 3 (the last one padded), 2 of each sent in 2 bits
    for errors in run_distributed(_sparseloco_math, 2, 3, 2, 3, 2, 0.9, 1.0, timeout=80):
        assert max(errors) < 1e-6


def _noloco_math(rank, world_size, rounds, inner_steps, lr, mu, pull, seed):
    """NoLoCo on 4 replicas against the pairs' math: g = mean_pair Δ + (γ/η)(φ_i −
    mean_pair φ); m ← μ m + g; φ ← φ − η m (heavy ball); the replica restarts from φ."""
    torch.manual_seed(0)
    model = Regression()
    reference = copy.deepcopy(model)
    config = NoLoCoConfig(inner_steps=inner_steps, outer_lr=lr, outer_momentum=mu, pull=pull,
                          seed=seed)
    strategy = _strategy(NoLoCo, config, model, rank, world_size, inner_steps * rounds)
    inner = torch.optim.SGD(reference.parameters(), lr=INNER_LR)
    phi = flat(reference)
    momentum = torch.zeros_like(phi)
    errors, spread = [], []
    for t in range(rounds):
        for h in range(inner_steps):
            step = t * inner_steps + h
            strategy.train_step(regression_batch(rank, step))
            inner.zero_grad()
            reference(*regression_batch(rank, step))[1].backward()
            inner.step()
        mine = torch.stack([phi - flat(reference), phi])
        everyone = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(everyone, mine)
        (peer,) = round_peers("random-matching", world_size, seed, t)[rank]
        delta, phi_mean = (everyone[rank] + everyone[peer]) / 2
        momentum = mu * momentum + delta + pull / lr * (phi - phi_mean)
        phi = phi - lr * momentum
        torch.nn.utils.vector_to_parameters(phi.clone(), reference.parameters())
        errors.append((global_flat(strategy) - phi).abs().max().item())
        errors.append((flat(strategy.model) - phi).abs().max().item())
        spread.append(max((e[1] - everyone[0][1]).abs().max().item() for e in everyone))
    return errors, spread, strategy.metrics()["consensus"], flat(strategy.eval_model()), phi


@pytest.mark.timeout(150)
def test_noloco_pairs_match_tensor_math_on_four_replicas():
    results = run_distributed(_noloco_math, 4, 3, 2, 0.7, 0.5, 0.3, 1, timeout=130)
    for errors, spread, *_ in results:
        assert max(errors) < 1e-6
        assert max(spread[1:]) > 1e-4  # the replicas' φ really differ (no global average)
    # the evaluated model is the replicas' mean of φ, the same on every rank
    phis = torch.stack([phi for *_, phi in results])
    mean = phis.mean(0)
    consensus = ((phis - mean).norm(dim=1) / mean.norm()).mean().item()
    for _, _, distance, evaluated, _ in results:
        assert (evaluated - mean).abs().max() < 1e-6
        assert distance == pytest.approx(consensus, rel=1e-4) and distance > 0


def test_noloco_matching_leaves_one_out_when_odd():
    from algorithms.outer_rules.noloco import NoLoCoRule

    rule = NoLoCoRule([torch.zeros(2)], seed=3)
    peers = [rule.peer(i, 3) for i in range(3)]
    assert peers.count(None) == 1
    pair = [i for i, p in enumerate(peers) if p is not None]
    assert peers[pair[0]] == pair[1] and peers[pair[1]] == pair[0]


# ------------------------------------------------------------------------- resume


def _resume(rank, world_size, name, kwargs, inner_steps, rounds, stop):
    """Train `rounds` rounds straight, and again stopping at step `stop` (mid-round),
    restoring a fresh strategy from the state there: the same parameters at the end."""
    cls, config_cls = {"sparseloco": (SparseLoCo, SparseLoCoConfig),
                       "noloco": (NoLoCo, NoLoCoConfig)}[name]
    config = config_cls(inner_steps=inner_steps, **kwargs)
    total = inner_steps * rounds
    torch.manual_seed(0)
    initial = Regression()
    straight = _strategy(cls, config, copy.deepcopy(initial), rank, world_size, total)
    first = _strategy(cls, config, copy.deepcopy(initial), rank, world_size, total)
    for step in range(total):
        straight.train_step(regression_batch(rank, step))
    for step in range(stop):
        first.train_step(regression_batch(rank, step))
    state = copy.deepcopy(first.state_dict())
    resumed = _strategy(cls, config, Regression(), rank, world_size, total)
    resumed.load_state_dict(state)
    for step in range(stop, total):
        resumed.train_step(regression_batch(rank, step))
    return ((flat(straight.model) - flat(resumed.model)).abs().max().item()
            + (global_flat(straight) - global_flat(resumed)).abs().max().item())


@pytest.mark.timeout(120)
def test_sparseloco_and_noloco_resume_bit_for_bit():
    sparse = {"chunk_size": 3, "topk_per_chunk": 1, "error_decay": 0.9}
    assert run_distributed(_resume, 2, "sparseloco", sparse, 2, 4, 5, timeout=50) == [0.0] * 2
    assert run_distributed(_resume, 4, "noloco", {"pull": 0.3}, 2, 4, 5, timeout=60) == [0.0] * 4
