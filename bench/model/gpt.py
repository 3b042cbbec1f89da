"""GPT-2 (`model.arch: gpt2`): a nanoGPT-like decoder-only transformer.

Exercise it with ``pytest tests/test_model.py``; the training loop builds it through
``build_model(model_config(cfg.model, vocab_size))`` (bench/model/__init__.py).

Architecture: learned token and position embeddings, ``n_layer`` pre-LayerNorm blocks
(causal self-attention through ``F.scaled_dot_product_attention`` and a 4x GELU MLP, both
with biases), a final LayerNorm, and an LM head tied to the token embedding (untied with
``tie_embeddings=False``). Init and the layer list: bench/model/common.py.

On GPU the loop wraps steps in ``autocast_context(device, "bf16")`` and may compile the
model; nothing here depends on compilation (no data-dependent Python branches in
``forward``), so compiled and eager models compute the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.model.common import CausalLM, DecoderConfig, Embedding, Head, TransformerBlock


@dataclass
class GPTConfig(DecoderConfig):
    """A GPT-2 shape (fields: `DecoderConfig`)."""

    arch: str = "gpt2"
    ARCH = "gpt2"


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


class Block(TransformerBlock):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def block_forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        x_BTC = x_BTC + self.attn(self.ln_1(x_BTC))
        return x_BTC + self.mlp(self.ln_2(x_BTC))


class GPT(CausalLM):
    """GPT-2-style language model; see the module docstring."""

    def build(self, cfg: GPTConfig) -> tuple[Embedding, list[Block], Head]:
        embed = Embedding(cfg, positions=True)
        head = Head(nn.LayerNorm(cfg.n_embd), cfg.vocab_size, cfg.n_embd,
                    embed.wte.weight if cfg.tie_embeddings else None)
        return embed, [Block(cfg) for _ in range(cfg.n_layer)], head
