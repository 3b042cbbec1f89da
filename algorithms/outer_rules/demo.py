"""DeMo: the replicas keep a local momentum and send only its fast components, a top-k of
the DCT coefficients of each block of each tensor; the step is the sign of their mean.

    pytest tests/test_demo.py

Peng, Quesnelle, Kingma 2024, "DeMo: Decoupled Momentum Optimization", arXiv 2411.19870
(code: github.com/bloc97/DeMo). The math, its identity and our choices: docs/algorithms.md
("DeMo"). A round every `inner_steps` H steps (H = 1: the paper's DeMo, every step, with
inner SGD at lr 1 so that Δ_i is the step's gradient); per round, on each replica i:

    m_i ← β m_i + Δ_i                        the local momentum (starts at 0)
    q_i = IDCT(TopK_blocks(DCT(m_i)))        per block of each tensor, its k largest |coef|
    m_i ← m_i − q_i                          the rest stays (the slow components)
    Q = mean_i q_i                           an all-gather of the (offset, value) pairs
    θ ← θ (1 − η λ) − η sign(Q)              decoupled weight decay λ, the sign optional

The DCT is the orthonormal DCT-II applied as matmuls with a cached matrix per block size
(`dct_matrix`): a 2-D tensor (rows, cols) is cut into h × w blocks, h and w the largest
divisors of rows and cols not above `chunk_size` (the paper's code's rule), each block's
coefficients `D_h X D_wᵀ`; a 1-D tensor into runs of w. The wire format (`DCTCodec`, ours):
per block its k offsets into the h·w coefficients as int16 and their values as fp32.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch

from algorithms.diloco import DiLoCo, DiLoCoConfig
from algorithms.outer_rules import OuterRule, Sends
from algorithms.outer_rules.sparseloco import CodedFeedback
from algorithms.traffic import Transfer, cross_of

MAX_CHUNK = 128
"""A block holds at most chunk_size² coefficients, whose offsets travel as int16."""


@functools.cache
def dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix D (n × n, fp32): `D x` are the coefficients of x,
    `Dᵀ c` inverts them (D is orthogonal; built in fp64, rounded once)."""
    k = torch.arange(n, dtype=torch.float64).view(-1, 1)
    i = torch.arange(n, dtype=torch.float64).view(1, -1)
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2 / n)
    d[0] /= math.sqrt(2)
    return d.to(torch.float32)


def block_size(n: int, chunk: int) -> int:
    """The largest divisor of n not above `chunk` (1 when n is prime and above it)."""
    return max(d for d in range(1, min(n, chunk) + 1) if n % d == 0)


@dataclass(frozen=True)
class TensorBlocks:
    """How one tensor is cut: viewed as (rows, cols), blocks of h × w, k sent per block."""

    rows: int
    cols: int
    h: int
    w: int
    k: int

    @property
    def blocks(self) -> int:
        return (self.rows // self.h) * (self.cols // self.w)

    @property
    def sent(self) -> int:
        return self.blocks * self.k


def tensor_blocks(shape, chunk_size: int, k: int) -> TensorBlocks:
    shape = tuple(shape) or (1,)
    rows, cols = (1, shape[0]) if len(shape) == 1 else (shape[0], math.prod(shape[1:]))
    h, w = block_size(rows, chunk_size), block_size(cols, chunk_size)
    return TensorBlocks(rows, cols, h, w, min(k, h * w))


class DCTCodec:
    """Block-DCT top-k of a flat fp32 buffer holding tensors of `shapes` (in order), and its
    wire format: all the values (fp32), then all the offsets (int16)."""

    def __init__(self, shapes, chunk_size: int, k: int):
        if not 1 <= chunk_size <= MAX_CHUNK:
            raise ValueError(f"chunk_size must be in [1, {MAX_CHUNK}], got {chunk_size}")
        if not 1 <= k:
            raise ValueError(f"k must be >= 1, got {k}")
        self.tensors = [tensor_blocks(s, chunk_size, k) for s in shapes]
        self.numel = sum(t.rows * t.cols for t in self.tensors)
        sent = sum(t.sent for t in self.tensors)
        self.value_bytes, self.index_bytes = 4 * sent, 2 * sent

    @property
    def payload_bytes(self) -> int:
        return self.value_bytes + self.index_bytes

    @staticmethod
    def payload_bytes_of(shapes, chunk_size: int, k: int) -> int:
        """Bytes one replica sends per round for tensors of `shapes` (the what-if's)."""
        return 6 * sum(tensor_blocks(s, chunk_size, k).sent for s in shapes)

    @staticmethod
    def coefficients(x: torch.Tensor, t: TensorBlocks) -> torch.Tensor:
        """(rows, cols) -> (blocks, h·w): each block's 2-D DCT `D_h X D_wᵀ`, row-major."""
        dh, dw = dct_matrix(t.h).to(x.device), dct_matrix(t.w).to(x.device)
        blocks = x.view(t.rows // t.h, t.h, t.cols // t.w, t.w)
        return torch.einsum("ahbw,ih,jw->abij", blocks, dh, dw).reshape(t.blocks, t.h * t.w)

    @staticmethod
    def inverse(c: torch.Tensor, t: TensorBlocks) -> torch.Tensor:
        """`coefficients`' inverse: (blocks, h·w) -> the flat (rows · cols) tensor."""
        dh, dw = dct_matrix(t.h).to(c.device), dct_matrix(t.w).to(c.device)
        blocks = c.view(t.rows // t.h, t.cols // t.w, t.h, t.w)
        return torch.einsum("abij,ih,jw->ahbw", blocks, dh, dw).reshape(-1)

    @torch.no_grad()
    def encode(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, sent): the uint8 payload for `flat` and the dense fp32 buffer it
        decodes to (what the momentum loses)."""
        values, offsets, sent, start = [], [], torch.empty_like(flat), 0
        for t in self.tensors:
            n = t.rows * t.cols
            coef = self.coefficients(flat[start:start + n].view(t.rows, t.cols), t)
            top = coef.abs().topk(t.k, dim=1, sorted=False).indices
            chosen = coef.gather(1, top)
            sent[start:start + n] = self.inverse(
                torch.zeros_like(coef).scatter_(1, top, chosen), t)
            values.append(chosen.reshape(-1))
            offsets.append(top.to(torch.int16).reshape(-1))
            start += n
        payload = torch.cat([torch.cat(values).view(torch.uint8),
                             torch.cat(offsets).view(torch.uint8)])
        return payload, sent

    @torch.no_grad()
    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """A payload (any replica's) -> the dense fp32 buffer of `numel` it stands for."""
        values = payload[:self.value_bytes].clone().view(torch.float32)
        offsets = payload[self.value_bytes:].clone().view(torch.int16).long()
        out, start, at = torch.empty(self.numel, device=payload.device), 0, 0
        for t in self.tensors:
            n, m = t.rows * t.cols, t.sent
            coef = torch.zeros(t.blocks, t.h * t.w, device=payload.device)
            coef.scatter_(1, offsets[at:at + m].view(t.blocks, t.k),
                          values[at:at + m].view(t.blocks, t.k))
            out[start:start + n] = self.inverse(coef, t)
            start, at = start + n, at + m
        return out


class DeMoRule(CodedFeedback, OuterRule):
    """The DeMo round on the global θ of one fragment (module docstring); one momentum m_i
    per replica. Not on shards: its blocks are the whole tensors' (a rank's shards would
    cut them elsewhere)."""

    shards = False

    def __init__(self, params, momentum_decay: float = 0.999, chunk_size: int = 64,
                 topk_per_chunk: int = 32, sign: bool = True, weight_decay: float = 0.0):
        super().__init__(params)
        self.decay, self.sign = momentum_decay, sign
        self.weight_decay = weight_decay
        self.codec = DCTCodec([p.shape for p in params], chunk_size, topk_per_chunk)
        self.accumulator = None
        """m_i, on the replica's device; None before the first round."""

    @classmethod
    def from_config(cls, params, config) -> DeMoRule:
        return cls(params, momentum_decay=config.momentum_decay,
                   chunk_size=config.chunk_size, topk_per_chunk=config.topk_per_chunk,
                   sign=config.sign, weight_decay=config.outer_weight_decay)

    @classmethod
    def states(cls, config) -> int:
        return 1  # m_i

    @classmethod
    def sends(cls, config) -> Sends:
        """Whole blocks of chunk_size²: k (fp32 value, int16 offset) pairs each."""
        k = min(config.topk_per_chunk, config.chunk_size ** 2)
        return Sends("all_gather", 6 * k / config.chunk_size ** 2)

    @classmethod
    def check(cls, config, cfg) -> None:
        super().check(config, cfg)
        plain = {"outer_compression": (config.outer_compression, "none",
                                       "its exchange has its own format"),
                 "outer_grad_dtype": (config.outer_grad_dtype, "fp32",
                                      "its values travel in fp32"),
                 "fragments": (config.fragments, 1, "a round sends the whole model's blocks"),
                 "overlap_steps": (config.overlap_steps, 0, "its exchange is blocking")}
        for key, (value, default, why) in plain.items():
            if value != default:
                raise ValueError(f"strategy.{key}={value!r} with demo: {why}; use {key} "
                                 f"{default!r}")
        replicas = cfg.parallel.world_size // cfg.parallel.group_size
        if replicas < 2:
            raise ValueError(f"strategy.name 'demo' with one replica (parallel.world_size "
                             f"{cfg.parallel.world_size} / group_size "
                             f"{cfg.parallel.group_size}): nothing to exchange, and one "
                             "replica's round would step on Δ without DeMo's momentum; use "
                             "2 or more replicas")

    @torch.no_grad()
    def step(self, delta: torch.Tensor, lr: float, momentum: float) -> None:
        update = delta.sign() if self.sign else delta
        offset = 0
        for p in self.params:
            n = p.numel()
            if self.weight_decay:
                p.mul_(1 - lr * self.weight_decay)
            p.add_(update[offset:offset + n].view_as(p).to(device=p.device, dtype=p.dtype),
                   alpha=-lr)
            offset += n

    def state_dict(self) -> dict:
        return {"momentum": self.saved_accumulator()}

    def load_state_dict(self, state: dict) -> None:
        self.load_accumulator(state["momentum"])


@dataclass
class DeMoConfig(DiLoCoConfig):
    name: str = "demo"
    """DeMo (arXiv 2411.19870): each replica's local momentum, its block-DCT top-k
    all-gathered every H steps, the sign of the mean as the step."""
    outer_optimizer: Literal["demo"] = "demo"
    """The outer rule (algorithms/outer_rules/demo.py)."""
    inner_steps: int = 1
    """H: 1, the paper's DeMo (an exchange every step; with inner SGD at lr 1, no momentum,
    no weight decay, Δ_i is the step's gradient); more: DeMo's rule on DiLoCo's rounds."""
    outer_lr: float = 4e-4
    """η of θ ← θ − η sign(Q), constant (the paper's 300M and 1B runs: 4e-4 peak)."""
    outer_momentum: float = 0.0
    """Unused: DeMo's momentum is the local m (momentum_decay); must stay 0."""
    momentum_decay: float = 0.999
    """β of m ← β m + Δ (the paper's compression_decay: 0.999). 0: no momentum."""
    chunk_size: int = 64
    """Target block side s: a tensor's blocks are h × w, the largest divisors of its rows
    and columns not above s (the paper's: 64; at most 128)."""
    topk_per_chunk: int = 32
    """k, DCT coefficients sent per block (the paper's: 32, of 64² = 4096); a block of
    fewer coefficients sends them all."""
    sign: bool = True
    """Step with sign(Q) (the paper's); false: with Q itself."""
    outer_weight_decay: float = 0.0
    """λ of the decoupled weight decay θ ← θ (1 − η λ) before the step (the paper's: 0)."""

    def __post_init__(self):
        super().__post_init__()
        if self.outer_momentum != 0:
            raise ValueError(f"strategy.outer_momentum must be 0 with demo (its momentum is "
                             f"the local one, strategy.momentum_decay), got "
                             f"{self.outer_momentum!r}")
        if not 0 <= self.momentum_decay < 1:
            raise ValueError(f"strategy.momentum_decay must be in [0, 1), "
                             f"got {self.momentum_decay!r}")
        if not 1 <= self.chunk_size <= MAX_CHUNK:
            raise ValueError(f"strategy.chunk_size must be in [1, {MAX_CHUNK}] with demo, "
                             f"got {self.chunk_size!r}")
        if not 1 <= self.topk_per_chunk <= self.chunk_size ** 2:
            raise ValueError(f"strategy.topk_per_chunk must be in [1, chunk_size² = "
                             f"{self.chunk_size ** 2}], got {self.topk_per_chunk!r}")
        if self.outer_weight_decay < 0:
            raise ValueError(f"strategy.outer_weight_decay must be >= 0, "
                             f"got {self.outer_weight_decay!r}")


class DeMo(DiLoCo):
    """DeMo (Peng, Quesnelle, Kingma 2024, arXiv 2411.19870) on DiLoCo's round machinery
    with the demo outer rule (`DeMoRule`; docs/algorithms.md). **Our choices** where the
    paper and its code are not explicit or we differ: the mean over all replicas (the code
    averages each coefficient over the replicas that sent it; the same sign), int16
    offsets and fp32 values, η constant (the code scales it and the gradient by the lr
    schedule), tensors of more than 2 dims viewed as (dim 0, the rest).

    Identity (tests/test_demo.py): every coefficient sent, β = 0, no sign is DiLoCo with a
    plain outer SGD step (η, momentum 0), up to the DCT round trip's float rounding.
    """

    Config = DeMoConfig

    @classmethod
    def memory_terms(cls, cfg, facts) -> dict[str, int]:
        """DiLoCo's (m_i is the rule's state), + a round's buffers: the sent part (θ), one
        tensor's coefficients and their top-k (≤ 2 θ), every replica's payload gathered
        (whole-block estimate), the decoded payload and the running sum (θ each)."""
        terms = super().memory_terms(cfg, facts)
        config, theta = cfg.strategy, facts.param_bytes
        replicas = cfg.parallel.world_size // cfg.parallel.group_size
        payload = math.ceil(theta / 4 * config.rule().sends(config).bytes_per_element)
        terms["demo: the sent part, a tensor's coefficients and their top-k"] = 3 * theta
        terms["demo: gathered payloads"] = replicas * payload
        terms["demo: decoded payload and the sum"] = 2 * theta
        return terms

    @classmethod
    def outer_transfers(cls, cfg, facts, rank: int) -> list[Transfer]:
        """One all-gather of this rank's payload (every tensor's blocks, from their shapes)
        across the replicas (phase "outer")."""
        config, p = cfg.strategy, cfg.parallel
        if p.world_size // p.group_size == 1:
            return []
        nbytes = DCTCodec.payload_bytes_of([q.shape for q in facts.params], config.chunk_size,
                                           config.topk_per_chunk)
        return [Transfer("outer", "all_gather", (nbytes,),
                         cross_of(rank, p.group_size, p.world_size))]
