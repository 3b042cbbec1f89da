"""Unit tests for bench/model/: shapes, loss, causality, layer list, counts, init, errors,
for both architectures (gpt2, llama)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from bench.model import (
    ARCHS,
    GPT,
    LLAMA_PRESETS,
    PRESETS,
    GPTConfig,
    Llama,
    LlamaConfig,
    autocast_context,
    build_model,
    config_from_dict,
    gpt_config,
    model_config,
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


# ------------------------------------------------------------------------------ llama


def tiny_llama(seed: int = 0, **overrides) -> Llama:
    torch.manual_seed(seed)
    return build_model(model_config("llama", "tiny", 256, 32, **overrides))


def expected_llama_params(vocab: int, n_layer: int, c: int, n_head: int, n_kv: int,
                          ffn: int, tied: bool) -> int:
    """Llama counted by hand: no biases, no position embedding."""
    kv = c // n_head * n_kv
    per_block = c + (c * c + 2 * c * kv + c * c) + c + 3 * c * ffn  # norms, q k v o, swiglu
    return vocab * c * (1 if tied else 2) + n_layer * per_block + c  # + final norm


def test_llama_7b_is_llama_7b_on_meta():
    """LLaMA-7B's published count, 6,738,415,616 at vocabulary 32000 (never allocated)."""
    with torch.device("meta"):
        model = build_model(model_config("llama", "7b", 32000, 2048))
    assert model.cfg.ffn_hidden == 11008 and not model.cfg.tie_embeddings
    assert model.num_params() == 6_738_415_616
    n = model.num_params(non_embedding=True)
    assert n == 6_738_415_616 - 32000 * 4096  # the untied head's matmul counts, the lookup not
    assert model.flops_per_token() == 6 * n + 12 * 32 * 4096 * 2048


def test_llama_1b_preset_is_llama_3_2_1b_shape():
    with torch.device("meta"):
        model = build_model(model_config("llama", "1b", 128256, 2048, tie_embeddings=True))
    assert model.num_params() == expected_llama_params(128256, 16, 2048, 32, 8, 8192, True)
    assert 1.23e9 < model.num_params() < 1.24e9  # Llama 3.2 1B: 1.24B


@pytest.mark.parametrize("tied", [False, True])
def test_llama_counts_by_hand(tied):
    model = tiny_llama(tie_embeddings=tied)
    s = LLAMA_PRESETS["tiny"]
    assert model.num_params() == expected_llama_params(256, s.n_layer, s.n_embd, s.n_head,
                                                       s.n_kv_head, 256, tied)
    assert (model.head.weight is model.embed.wte.weight) == tied
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    assert model.blocks[0].attn.k.weight.shape == (s.n_embd // s.n_head * s.n_kv_head, s.n_embd)


@pytest.mark.parametrize("arch, preset", [(a, p) for a, presets in
                                          (("gpt2", PRESETS), ("llama", LLAMA_PRESETS))
                                          for p in presets])
def test_every_preset_counts_by_hand(arch, preset):
    """Every preset of both architectures builds (on meta) with the count its shape gives."""
    s = {"gpt2": PRESETS, "llama": LLAMA_PRESETS}[arch][preset]
    with torch.device("meta"):
        model = build_model(model_config(arch, preset, 256, 128))
    if arch == "gpt2":
        assert model.num_params() == expected_num_params(256, 128, s.n_layer, s.n_embd)
    else:
        assert model.num_params() == expected_llama_params(
            256, s.n_layer, s.n_embd, s.n_head, s.n_kv_head or s.n_head, model.cfg.ffn_hidden,
            False)
        assert model.cfg.ffn_hidden == (s.ffn_hidden or model.cfg.ffn_hidden)


def test_llama_forward_causal_and_layers_equal_forward():
    model = tiny_llama()
    idx = torch.randint(0, 256, (2, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, 256)
    assert torch.equal(loss, F.cross_entropy(logits.reshape(-1, 256), idx.reshape(-1)))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    other, _ = model(changed)
    torch.testing.assert_close(logits[:, :10], other[:, :10], rtol=0, atol=0)
    assert not torch.allclose(logits[:, 10:], other[:, 10:])
    x = idx
    for layer in model.as_layers():
        x = layer(x)
    assert torch.equal(x, logits)


def test_llama_grouped_query_attention_equals_repeated_heads():
    """GQA with n_kv_head = 1 equals full attention whose key/value heads are copies."""
    gqa = tiny_llama(n_kv_head=1)
    full = tiny_llama(n_kv_head=4)
    state = gqa.state_dict()
    for i in range(gqa.cfg.n_layer):
        for name in ("k", "v"):
            key = f"blocks.{i}.attn.{name}.weight"
            state[key] = state[key].repeat(4, 1)  # every query head sees the one kv head
    full.load_state_dict(state)
    idx = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(gqa(idx)[0], full(idx)[0], atol=1e-5, rtol=1e-5)


def test_llama_rotary_is_relative():
    """Rotary attention scores depend on the distance between positions only."""
    from bench.model.llama import apply_rotary, rotary_cos_sin

    cos, sin = rotary_cos_sin(12, 8, 10000.0, torch.device("cpu"))
    q, k = torch.randn(8), torch.randn(8)
    rq = apply_rotary(q.expand(1, 1, 12, 8), cos, sin)[0, 0]
    rk = apply_rotary(k.expand(1, 1, 12, 8), cos, sin)[0, 0]
    assert torch.allclose(rq[5] @ rk[2], rq[9] @ rk[6], atol=1e-5)
    assert torch.allclose(rq[0], q)  # position 0 is not rotated


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_same_init_per_arch(arch):
    def build(seed):
        torch.manual_seed(seed)
        return build_model(model_config(arch, "tiny", 256, 32)).state_dict()

    a, b, c = build(3), build(3), build(4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed.wte.weight"], c["embed.wte.weight"])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tied", [False, True])
def test_a_meta_built_part_materialises_to_the_full_models_values(arch, tied):
    """The init is a function of (seed, name): a part of a meta-device model, materialised
    alone, holds exactly the full model's values (pipeline stages, FSDP shards)."""
    torch.manual_seed(7)
    full = build_model(model_config(arch, "tiny", 256, 32, n_layer=3, tie_embeddings=tied))
    torch.manual_seed(7)
    with torch.device("meta"):
        meta = build_model(model_config(arch, "tiny", 256, 32, n_layer=3,
                                        tie_embeddings=tied))
    layers = meta.as_layers()
    last = torch.nn.Sequential(layers[2], layers[-1])  # block 1 and the head
    meta.materialize(last, "cpu")
    got = dict(last.named_parameters())
    expected = full.state_dict()
    assert torch.equal(got["0.ln_1.weight"], expected["blocks.1.ln_1.weight"])
    assert torch.equal(got["0.mlp." + ("fc" if arch == "gpt2" else "gate") + ".weight"],
                       expected["blocks.1.mlp." + ("fc" if arch == "gpt2" else "gate")
                                + ".weight"])
    assert torch.equal(got["1.weight"], expected["head.weight"])  # tied: the embedding's
    assert all(p.is_meta for p in layers[0].parameters())  # the rest is still not allocated
    meta.materialize(torch.nn.ModuleList(meta.as_layers()), "cpu")
    assert all(torch.equal(v, expected[k]) for k, v in meta.state_dict().items())
    assert (meta.head.weight is meta.embed.wte.weight) == tied


def test_arch_is_recorded_and_read_back():
    for cfg in (gpt_config("tiny", 256, 32), model_config("llama", "tiny", 256, 32)):
        data = dataclasses.asdict(cfg)
        assert data["arch"] == cfg.arch and config_from_dict(data) == cfg
    old = dataclasses.asdict(gpt_config("tiny", 256, 32))
    del old["arch"]  # a checkpoint from before Llama
    assert config_from_dict(old) == gpt_config("tiny", 256, 32)
    with pytest.raises(ValueError, match="llama"):
        GPTConfig(**{**old, "arch": "llama"})
    assert isinstance(model_config("llama", "tiny", 256, 32), LlamaConfig)


@pytest.mark.parametrize("overrides, message", [
    (dict(arch="bert"), "model.arch"),
    (dict(arch="llama", preset="xl"), "model.preset"),
    (dict(arch="llama", n_kv_head=3), "model.n_kv_head"),
    (dict(arch="gpt2", n_kv_head=1), "model.n_kv_head"),
    (dict(arch="llama", n_embd=60, n_head=4, n_kv_head=4), "even"),
])
def test_bad_llama_shapes_name_the_key(overrides, message):
    arch = overrides.pop("arch")
    preset = overrides.pop("preset", "tiny")
    with pytest.raises(ValueError, match=message):
        model_config(arch, preset, 256, 32, **overrides)


def test_llama_muon_hidden_matrices_are_the_block_linears():
    model = tiny_llama()
    hidden, other = muon_param_split(model)
    assert len(hidden) == 7 * model.cfg.n_layer  # q, k, v, o, gate, up, down
    assert {id(p) for p in other} == {id(model.embed.wte.weight), id(model.head.weight),
                                      id(model.head.ln_f.weight),
                                      *(id(b.ln_1.weight) for b in model.blocks),
                                      *(id(b.ln_2.weight) for b in model.blocks)}


# ------------------------------------------------------------ activation checkpointing


def _saved_bytes_and_grads(model, idx):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, idx)
    loss.backward()
    return sum(saved), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ARCHS)
def test_activation_checkpointing_same_gradients_fewer_saved_activations(arch):
    """Blocks recomputed in backward give the same gradients bit for bit (dropout too: the
    recomputation replays the RNG) while autograd keeps fewer activations."""
    torch.manual_seed(1)
    idx = torch.randint(0, 256, (4, 32))
    results = []
    for enabled in (False, True):
        torch.manual_seed(0)
        model = build_model(model_config(arch, "tiny", 256, 32, dropout=0.1)).train()
        model.enable_activation_checkpointing(enabled)
        torch.manual_seed(5)  # the dropout masks
        results.append(_saved_bytes_and_grads(model, idx))
    (plain_bytes, plain), (ckpt_bytes, ckpt) = results
    assert plain.keys() == ckpt.keys()
    assert all(torch.equal(plain[k], ckpt[k]) for k in plain)
    assert ckpt_bytes < plain_bytes / 2
