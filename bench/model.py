"""The one GPT every commbench run trains: a nanoGPT-like decoder-only transformer.

Exercise it with ``pytest tests/test_model.py``; the training loop builds it through
``GPT(gpt_config(cfg.model.preset, tokenizer.vocab_size, cfg.model.seq_len))``.

Architecture (GPT-2): learned token and position embeddings, ``n_layer`` pre-LayerNorm
blocks (causal self-attention through ``F.scaled_dot_product_attention`` and a 4x GELU
MLP, both with biases), a final LayerNorm, and an LM head tied to the token embedding.
Init is GPT-2's: normal(0, 0.02) for weights, zero biases, residual output projections
scaled by 1/sqrt(2 * n_layer). Init draws only from the global torch RNG, so the same
seed gives the same weights on every rank.

For pipelines, ``GPT.as_layers()`` gives the model as an ordered list of modules
(embedding, blocks..., head) whose sequential application *is* ``forward``.

On GPU the loop wraps steps in ``autocast_context(device, "bf16")`` and calls
``torch.compile(model)`` itself; nothing here depends on compilation (no data-dependent
Python branches in ``forward``), so compiled and eager models compute the same function.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelShape:
    """Depth and width of a preset; vocabulary and context come from the data."""

    n_layer: int
    n_head: int
    n_embd: int


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(n_layer=2, n_head=2, n_embd=64),  # ~0.13M params at vocab 256
    "small": ModelShape(n_layer=12, n_head=12, n_embd=768),  # GPT-2 124M
    "medium": ModelShape(n_layer=24, n_head=16, n_embd=1024),  # GPT-2 350M
    "xl": ModelShape(n_layer=48, n_head=25, n_embd=1600),  # GPT-2 1.5B
    "7b": ModelShape(n_layer=32, n_head=32, n_embd=4096),  # LLaMA-7B shape
}

VOCAB_MULTIPLE = 64
"""gpt_config pads the vocabulary up to a multiple of this (tensor-core friendly matmuls)."""


@dataclass
class GPTConfig:
    """Plain data describing one GPT; ``dataclasses.asdict`` of it goes into checkpoints."""

    vocab_size: int
    """Rows of the token embedding (may exceed the tokenizer's vocabulary when padded)."""
    seq_len: int
    """Maximum context length: rows of the position embedding."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide n_embd."""
    n_embd: int
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout on attention weights and residual branches (0 for pretraining)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name} must be an integer >= 1, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout!r}")


def gpt_config(
    preset: str,
    vocab_size: int,
    seq_len: int,
    dropout: float = 0.0,
    n_layer: int | None = None,
    n_head: int | None = None,
    n_embd: int | None = None,
) -> GPTConfig:
    """Config for a named preset, with optional shape overrides.

    ``vocab_size`` is padded up to a multiple of ``VOCAB_MULTIPLE`` (GPT-2's 50257 ->
    50304; 256 stays 256). Padded ids never occur in the data, so training only pushes
    their logits down; code that needs the tokenizer's vocabulary must not read it from
    ``logits.shape[-1]``.
    """
    if preset not in PRESETS:
        raise ValueError(f"model.preset must be one of {sorted(PRESETS)}, got {preset!r}")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"model.vocab_size must be an integer >= 1, got {vocab_size!r}")
    shape = PRESETS[preset]
    return GPTConfig(
        vocab_size=-(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
        seq_len=seq_len,
        n_layer=shape.n_layer if n_layer is None else n_layer,
        n_head=shape.n_head if n_head is None else n_head,
        n_embd=shape.n_embd if n_embd is None else n_embd,
        dropout=dropout,
    )


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj.is_residual_projection = True
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        B, T, C = x_BTC.shape
        q, k, v = self.qkv(x_BTC).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim), the layout SDPA expects.
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y_BHTD = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y_BTC = y_BHTD.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(y_BTC))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.proj.is_residual_projection = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x_BTC))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        x_BTC = x_BTC + self.attn(self.ln_1(x_BTC))
        return x_BTC + self.mlp(self.ln_2(x_BTC))


class Embedding(nn.Module):
    """Token ids (B, T) -> hidden states (B, T, C): token + position embeddings."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.seq_len = cfg.seq_len
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        T = idx_BT.size(1)
        if T > self.seq_len:
            raise ValueError(f"sequence length {T} exceeds model.seq_len {self.seq_len}")
        pos_T = torch.arange(T, device=idx_BT.device)
        return self.dropout(self.wte(idx_BT) + self.wpe(pos_T))


class Head(nn.Module):
    """Hidden states (B, T, C) -> logits (B, T, V): final LayerNorm, then the tied projection.

    ``weight`` is the token embedding's Parameter object itself (weight tying). A pipeline
    that puts ``Head`` and ``Embedding`` on different stages holds two copies of it and
    must keep them equal itself (e.g. sum their gradients across the two stages).
    """

    def __init__(self, n_embd: int, tied_weight: nn.Parameter) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd)
        self.weight = tied_weight

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln_f(x_BTC), self.weight)


def lm_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all positions (fp32 logits): `GPT.forward`'s loss,
    and the one a pipeline's last stage applies (TrainSetup.loss_fn)."""
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten())


class GPT(nn.Module):
    """GPT-2-style language model; see the module docstring."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = Head(cfg.n_embd, self.embed.wte.weight)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "is_residual_projection", False):
                # Each block adds two residual branches; keep the stream's variance flat.
                std /= math.sqrt(2 * self.cfg.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(
        self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position and, given targets, the mean cross-entropy over all."""
        x = idx_BT
        for layer in self.as_layers():
            x = layer(x)
        logits_BTV = x
        if targets_BT is None:
            return logits_BTV, None
        return logits_BTV, lm_loss(logits_BTV, targets_BT)

    def as_layers(self) -> list[nn.Module]:
        """[Embedding, Block * n_layer, Head]: applied in order they are exactly ``forward``.

        The modules are the GPT's own (same Parameters), so a pipeline may cut this list
        into contiguous stages. Embedding and Head share the tied token-embedding weight;
        see ``Head`` for what a pipeline splitting them must do.
        """
        return [self.embed, *self.blocks, self.head]

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count, each shared Parameter once.

        ``non_embedding=True`` leaves out the position embedding only: the token embedding
        is also the LM head, whose matmul costs compute (nanoGPT's convention, and the N
        used by ``flops_per_token``).
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.embed.wpe.weight.numel()
        return n

    def flops_per_token(self) -> int:
        """Training FLOPs per token, PaLM appendix B style: 6N + 12 * L * C * T.

        6N covers forward (2N) and backward (4N) matmuls with N = num_params(non_embedding
        =True); 12 * n_layer * n_embd * seq_len covers the attention score and value
        matmuls at full context. Divide achieved FLOP/s by peak FLOP/s for MFU.
        """
        c = self.cfg
        return 6 * self.num_params(non_embedding=True) + 12 * c.n_layer * c.n_embd * c.seq_len


PRECISIONS = ("bf16", "fp32")


def autocast_context(device_type: str, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast for ``precision='bf16'``, a no-op context for ``'fp32'``.

    Use around forward and loss only (backward runs outside it). Parameters and optimizer
    state stay fp32 either way.
    """
    if precision == "bf16":
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    if precision == "fp32":
        return contextlib.nullcontext()
    raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
