"""Unit tests for bench/model.py: shapes, loss, causality, layer list, counts, errors."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from bench.model import (
    GPT,
    PRESETS,
    GPTConfig,
    autocast_context,
    gpt_config,
)
from bench.optim import configure_optimizer_groups, muon_param_split


def expected_num_params(vocab: int, seq_len: int, n_layer: int, n_embd: int) -> int:
    """GPT-2 with biases and a tied head, counted by hand."""
    c = n_embd
    per_block = (
        (2 * c)  # ln_1
        + (c * 3 * c + 3 * c)  # qkv
        + (c * c + c)  # attention output projection
        + (2 * c)  # ln_2
        + (c * 4 * c + 4 * c)  # mlp fc
        + (4 * c * c + c)  # mlp projection
    )
    return vocab * c + seq_len * c + n_layer * per_block + 2 * c  # + ln_f


def tiny_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(gpt_config("tiny", vocab_size=256, seq_len=32, **overrides))


def test_small_is_gpt2_124m():
    cfg = gpt_config("small", vocab_size=50257, seq_len=1024)
    assert cfg.vocab_size == 50304  # padded to a multiple of 64
    with torch.device("meta"):  # no memory, no init cost
        model = GPT(cfg)
    n = model.num_params()
    assert n == expected_num_params(50304, 1024, 12, 768)
    assert 123e6 < n < 126e6


def test_unpadded_vocab_stays():
    assert gpt_config("tiny", vocab_size=256, seq_len=128).vocab_size == 256


def test_tiny_under_one_million():
    model = GPT(gpt_config("tiny", vocab_size=256, seq_len=128))
    s = PRESETS["tiny"]
    assert model.num_params() == expected_num_params(256, 128, s.n_layer, s.n_embd)
    assert model.num_params() < 1_000_000


def test_forward_shapes_and_loss_matches_cross_entropy():
    model = tiny_model()
    idx = torch.randint(0, 256, (3, 20))
    targets = torch.randint(0, 256, (3, 20))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 20, 256)
    expected = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
    assert torch.equal(loss, expected)
    logits_only, no_loss = model(idx)
    assert no_loss is None
    assert torch.equal(logits_only, logits)


def test_too_long_sequence_raises():
    model = tiny_model()
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_causal():
    model = tiny_model()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_as_layers_equals_forward():
    model = tiny_model()
    layers = model.as_layers()
    assert len(layers) == model.cfg.n_layer + 2
    idx = torch.randint(0, 256, (2, 32))
    x = idx
    for layer in layers:
        x = layer(x)
    logits, _ = model(idx)
    assert torch.equal(x, logits)
    model_params = {id(p) for p in model.parameters()}
    layer_params = {id(p) for layer in layers for p in layer.parameters()}
    assert layer_params == model_params


def test_tied_weights_shared():
    model = tiny_model()
    head, embed = model.as_layers()[-1], model.as_layers()[0]
    assert head.weight is embed.wte.weight
    with torch.no_grad():
        embed.wte.weight[5, 0] += 1.0
    assert head.weight[5, 0] == embed.wte.weight[5, 0]
    _, loss = model(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
    loss.backward()
    assert embed.wte.weight.grad is head.weight.grad
    # counted once
    assert sum(p.numel() for p in model.parameters()) == model.num_params()


def test_bad_preset_raises():
    with pytest.raises(ValueError, match=r"model\.preset.*'nope'") as info:
        gpt_config("nope", vocab_size=256, seq_len=32)
    assert "tiny" in str(info.value)


def test_bad_head_count_raises():
    with pytest.raises(ValueError, match=r"model\.n_embd.*model\.n_head"):
        gpt_config("tiny", vocab_size=256, seq_len=32, n_head=3)
    with pytest.raises(ValueError, match=r"model\.n_layer"):
        gpt_config("tiny", vocab_size=256, seq_len=32, n_layer=0)


def test_flops_per_token_by_hand():
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_embd=32))
    n = expected_num_params(64, 16, 2, 32) - 16 * 32  # without position embedding
    assert model.num_params(non_embedding=True) == n
    assert model.flops_per_token() == 6 * n + 12 * 2 * 32 * 16


def test_same_seed_same_init_and_different_seed_differs():
    a, b, c = tiny_model(seed=1), tiny_model(seed=1), tiny_model(seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["embed.wte.weight"], sc["embed.wte.weight"])


def test_residual_projection_init_is_scaled():
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", vocab_size=256, seq_len=32, n_embd=256, n_head=4))
    proj_std = model.blocks[0].mlp.proj.weight.std().item()
    fc_std = model.blocks[0].mlp.fc.weight.std().item()
    assert fc_std == pytest.approx(0.02, rel=0.05)
    assert proj_std == pytest.approx(0.02 / (2 * 2) ** 0.5, rel=0.05)


def test_config_is_plain_data():
    cfg = gpt_config("tiny", vocab_size=256, seq_len=32, dropout=0.1)
    assert GPTConfig(**dataclasses.asdict(cfg)) == cfg


def test_autocast_context():
    with autocast_context("cpu", "bf16"):
        assert torch.is_autocast_enabled("cpu")
    with autocast_context("cpu", "fp32"):
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError, match="fp16"):
        autocast_context("cpu", "fp16")


def test_bf16_forward_runs():
    model = tiny_model()
    idx = torch.randint(0, 256, (2, 8))
    with autocast_context("cpu", "bf16"):
        logits, loss = model(idx, idx)
    assert logits.dtype == torch.bfloat16
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


def test_optimizer_groups_and_muon_split_partition_params():
    model = tiny_model()
    all_ids = {id(p) for p in model.parameters()}
    decay, no_decay = configure_optimizer_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"])
    assert {id(p) for p in decay["params"] + no_decay["params"]} == all_ids
    assert len(decay["params"]) + len(no_decay["params"]) == len(all_ids)

    hidden, other = muon_param_split(model)
    assert len(hidden) == 4 * model.cfg.n_layer  # qkv, attn proj, fc, mlp proj
    assert all(p.dim() == 2 for p in hidden)
    other_ids = {id(p) for p in other}
    assert id(model.as_layers()[0].wte.weight) in other_ids
    assert {id(p) for p in hidden} | other_ids == all_ids
    assert len(hidden) + len(other) == len(all_ids)
    torch.optim.AdamW(configure_optimizer_groups(model, 0.1), lr=1e-3)
