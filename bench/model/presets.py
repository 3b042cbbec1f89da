"""Named model shapes per architecture, and the config builder the harness uses.

    commbench config show configs/ddp-tiny.yaml --set model.arch=llama --set model.preset=7b
    pytest tests/test_model.py

`model_config(arch, preset, vocab_size, seq_len, ...)` resolves a preset with the run's
overrides into a `GPTConfig` or `LlamaConfig`; `config_of(cfg.model, vocab_size)` does it
for the `model:` section of a run config. The vocabulary comes from the tokenizer (padded
up to a multiple of `VOCAB_MULTIPLE`) and the context from `model.seq_len`.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.model.common import DecoderConfig
from bench.model.gpt import GPTConfig
from bench.model.llama import LlamaConfig


@dataclass(frozen=True)
class ModelShape:
    """Depth and width of a preset; vocabulary and context come from the data."""

    n_layer: int
    n_head: int
    n_embd: int
    n_kv_head: int | None = None
    """llama: key/value heads (None = n_head)."""
    ffn_hidden: int | None = None
    """llama: SwiGLU width (None = LLaMA's 8/3 rule, bench/model/llama.py)."""


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(n_layer=2, n_head=2, n_embd=64),  # ~0.13M params at vocab 256
    "cpu": ModelShape(n_layer=4, n_head=4, n_embd=128),  # 0.84M at vocab 256: 2 cores
    "small": ModelShape(n_layer=12, n_head=12, n_embd=768),  # GPT-2 124M
    "medium": ModelShape(n_layer=24, n_head=16, n_embd=1024),  # GPT-2 350M
    "xl": ModelShape(n_layer=48, n_head=25, n_embd=1600),  # GPT-2 1.5B
    "7b": ModelShape(n_layer=32, n_head=32, n_embd=4096),  # LLaMA-7B's depth and width
}
"""GPT-2 presets (`model.arch: gpt2`)."""

LLAMA_PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(n_layer=2, n_head=4, n_embd=64, n_kv_head=2),  # GQA even when tiny
    "cpu": ModelShape(n_layer=4, n_head=4, n_embd=128, n_kv_head=2,
                      ffn_hidden=352),  # 8/3 x 128 rounded to 32 (the 256 rule: 512)
    "small": ModelShape(n_layer=12, n_head=12, n_embd=768),  # ~124M class (85M in blocks)
    "medium": ModelShape(n_layer=24, n_head=16, n_embd=1024),  # ~350M class
    "1b": ModelShape(n_layer=16, n_head=32, n_embd=2048, n_kv_head=8,
                     ffn_hidden=8192),  # Llama 3.2 1B's shape
    "7b": ModelShape(n_layer=32, n_head=32, n_embd=4096),  # LLaMA-7B (SwiGLU 11008)
}
"""Llama presets (`model.arch: llama`)."""

ARCH_PRESETS: dict[str, dict[str, ModelShape]] = {"gpt2": PRESETS, "llama": LLAMA_PRESETS}
ARCHS = tuple(ARCH_PRESETS)

VOCAB_MULTIPLE = 64
"""Vocabularies are padded up to a multiple of this (tensor-core friendly matmuls)."""


def model_config(
    arch: str,
    preset: str,
    vocab_size: int,
    seq_len: int,
    dropout: float = 0.0,
    n_layer: int | None = None,
    n_head: int | None = None,
    n_embd: int | None = None,
    n_kv_head: int | None = None,
    tie_embeddings: bool | None = None,
) -> DecoderConfig:
    """Config of `arch`'s preset with optional shape overrides (ValueError naming the key).

    ``vocab_size`` is padded up to a multiple of ``VOCAB_MULTIPLE`` (GPT-2's 50257 ->
    50304; 256 stays 256). Padded ids never occur in the data, so training only pushes
    their logits down; code that needs the tokenizer's vocabulary must not read it from
    ``logits.shape[-1]``. A llama preset's key/value heads hold unless the head count is
    overridden, its SwiGLU width unless the width is.
    """
    if arch not in ARCH_PRESETS:
        raise ValueError(f"model.arch must be one of {list(ARCHS)}, got {arch!r}")
    presets = ARCH_PRESETS[arch]
    if preset not in presets:
        raise ValueError(f"model.preset must be one of {sorted(presets)} for model.arch "
                         f"{arch!r}, got {preset!r}")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"model.vocab_size must be an integer >= 1, got {vocab_size!r}")
    shape = presets[preset]
    common = dict(
        vocab_size=-(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
        seq_len=seq_len,
        n_layer=shape.n_layer if n_layer is None else n_layer,
        n_head=shape.n_head if n_head is None else n_head,
        n_embd=shape.n_embd if n_embd is None else n_embd,
        dropout=dropout,
    )
    if tie_embeddings is not None:
        common["tie_embeddings"] = tie_embeddings
    if arch == "gpt2":
        if n_kv_head is not None:
            raise ValueError(f"model.n_kv_head ({n_kv_head}) is for model.arch llama "
                             "(grouped-query attention); gpt2 has one key/value head per "
                             "head: set it to null")
        return GPTConfig(**common)
    if n_kv_head is None and common["n_head"] == shape.n_head:
        n_kv_head = shape.n_kv_head
    ffn_hidden = shape.ffn_hidden if common["n_embd"] == shape.n_embd else None
    return LlamaConfig(**common, n_kv_head=n_kv_head, ffn_hidden=ffn_hidden)


def gpt_config(preset: str, vocab_size: int, seq_len: int, *shape, **overrides) -> GPTConfig:
    """`model_config("gpt2", ...)`: (preset, vocab_size, seq_len, dropout, n_layer, n_head,
    n_embd), the builder's signature from before Llama."""
    return model_config("gpt2", preset, vocab_size, seq_len, *shape, **overrides)


def config_of(model_section, vocab_size: int) -> DecoderConfig:
    """The model config a run's `model:` section (bench.config.ModelConfig) describes."""
    m = model_section
    return model_config(m.arch, m.preset, vocab_size, m.seq_len, m.dropout, m.n_layer,
                        m.n_head, m.n_embd, m.n_kv_head, m.tie_embeddings)
