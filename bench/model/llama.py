"""Llama (`model.arch: llama`): the decoder of LLaMA / Llama 2-3, the papers' architecture.

    commbench run configs/ddp-tiny.yaml --set model.arch=llama
    pytest tests/test_model.py -k llama

Architecture (Hugging Face `LlamaForCausalLM`'s, weight for weight; eval/export.py writes
one): a token embedding (no position embedding), ``n_layer`` pre-RMSNorm blocks, a final
RMSNorm and an LM head (untied by default, as LLaMA-7B; ``tie_embeddings`` ties it as
Llama 3.2 1B). A block is

    x + o(attention(rope(q(n1(x))), rope(k(n1(x))), v(n1(x))))   causal, n_head query heads,
                                                                   n_kv_head key/value heads
    x + down(silu(gate(n2(x))) * up(n2(x)))                        SwiGLU, ffn_hidden wide

with no biases anywhere. Rotary embeddings rotate the two halves of each head
(`rotate_half`, HF's convention) with frequencies theta^(-2i/head_dim); ``n_kv_head <
n_head`` is grouped-query attention (each key/value head serves n_head / n_kv_head query
heads). Init and the layer list: bench/model/common.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.model.common import (
    CausalLM,
    DecoderConfig,
    Embedding,
    Head,
    RMSNorm,
    TransformerBlock,
)

FFN_MULTIPLE = 256
"""The SwiGLU width rule rounds 8/3 * n_embd up to a multiple of this (LLaMA's)."""


def swiglu_hidden(n_embd: int) -> int:
    """LLaMA's SwiGLU width: int(2/3 * 4 * n_embd) rounded up to FFN_MULTIPLE (4096 -> 11008)."""
    hidden = int(2 * 4 * n_embd / 3)
    return FFN_MULTIPLE * -(-hidden // FFN_MULTIPLE)


@dataclass
class LlamaConfig(DecoderConfig):
    """A Llama shape (common fields: `DecoderConfig`)."""

    tie_embeddings: bool = False
    arch: str = "llama"
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention); must divide n_head; None = n_head."""
    ffn_hidden: int | None = None
    """SwiGLU hidden width; None = `swiglu_hidden(n_embd)`."""
    rope_theta: float = 10000.0
    """Rotary base frequency (LLaMA 1/2: 10000)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    ARCH = "llama"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.ffn_hidden is None:
            self.ffn_hidden = swiglu_hidden(self.n_embd)
        for name in ("n_kv_head", "ffn_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name} must be an integer >= 1, got {value!r}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"model.n_kv_head ({self.n_kv_head}) must divide model.n_head "
                             f"({self.n_head})")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(f"model.n_embd / model.n_head (the head width, "
                             f"{self.n_embd // self.n_head}) must be even for rotary "
                             "embeddings")


def rotary_cos_sin(T: int, head_dim: int, theta: float,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of shape (T, head_dim) in fp32: position t, frequency theta^(-2i/d),
    each frequency repeated for the two halves (HF Llama's layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device,
                                            dtype=torch.float32) / head_dim)
    freqs_TD = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs_TD, freqs_TD), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x_BHTD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    half = x_BHTD.shape[-1] // 2
    rotated = torch.cat((-x_BHTD[..., half:], x_BHTD[..., :half]), dim=-1)
    return x_BHTD * cos_TD.to(x_BHTD.dtype) + rotated * sin_TD.to(x_BHTD.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.theta, self.dropout = cfg.rope_theta, cfg.dropout
        self.q = nn.Linear(cfg.n_embd, cfg.n_head * self.head_dim, bias=False)
        self.k = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.v = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.proj = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, bias=False)
        self.proj.is_residual_projection = True
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTC.shape
        D = self.head_dim
        q = self.q(x_BTC).view(B, T, self.n_head, D).transpose(1, 2)
        k = self.k(x_BTC).view(B, T, self.n_kv_head, D).transpose(1, 2)
        v = self.v(x_BTC).view(B, T, self.n_kv_head, D).transpose(1, 2)
        cos, sin = rotary_cos_sin(T, D, self.theta, x_BTC.device)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y_BHTD = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True,
            enable_gqa=self.n_kv_head != self.n_head)
        y_BTC = y_BHTD.transpose(1, 2).contiguous().view(B, T, self.n_head * D)
        return self.resid_dropout(self.proj(y_BTC))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.up = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)
        self.down.is_residual_projection = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.silu(self.gate(x_BTC)) * self.up(x_BTC)))


class LlamaBlock(TransformerBlock):
    """x + attn(rmsnorm(x)), then x + swiglu(rmsnorm(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.ln_1 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ln_2 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def block_forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        x_BTC = x_BTC + self.attn(self.ln_1(x_BTC))
        return x_BTC + self.mlp(self.ln_2(x_BTC))


class Llama(CausalLM):
    """Llama-style language model; see the module docstring."""

    def build(self, cfg: LlamaConfig) -> tuple[Embedding, list[LlamaBlock], Head]:
        embed = Embedding(cfg, positions=False)
        head = Head(RMSNorm(cfg.n_embd, cfg.norm_eps), cfg.vocab_size, cfg.n_embd,
                    embed.wte.weight if cfg.tie_embeddings else None)
        return embed, [LlamaBlock(cfg) for _ in range(cfg.n_layer)], head
