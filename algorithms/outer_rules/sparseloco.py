"""SparseLoCo: DiLoCo whose replicas send a chunk-wise top-k of an error-feedback
accumulator, in 2 bits, instead of outer momentum.

    pytest tests/test_outer_rules.py -k sparseloco

Sarfi, Thérien, Lidin, Belilovsky 2025, "Communication Efficient LLM Pre-training with
SparseLoCo", arXiv 2508.15706. The math, its identity and our choices:
docs/algorithms.md ("SparseLoCo"). Per round, on each replica i (one fragment's flat θ):

    e_i ← β e_i + Δ_i                      error feedback: takes the outer momentum's place
    Δ̂_i = Q(TopK_chunks(e_i))               k entries of each chunk of `chunk_size`, 2-bit
    e_i ← e_i − Δ̂_i                         what was not sent (and Q's rounding) stays
    Δ = mean_i Δ̂_i                         an all-gather of the coded Δ̂_i (phase "outer")
    θ ← θ − η Δ                             the outer SGD step (momentum 0 by default)

The coded format (`ChunkCodec`, ours): per chunk the k offsets in the chunk as int16, the
values as 2-bit codes (four a byte) of the levels {−1, −1/3, 1/3, 1}·s with s the chunk's
largest selected magnitude (one fp32 scale), or, with `value_format: fp32`, the values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from algorithms.diloco import DiLoCo, DiLoCoConfig
from algorithms.outer_rules import Sends
from algorithms.outer_rules.sgd import SGDRule
from algorithms.outer_traffic import Exchange, streaming_traffic
from algorithms.traffic import Traffic, Transfer, cross_of

MAX_CHUNK = 2 ** 15
"""A chunk's offsets travel as int16."""


class ChunkCodec:
    """Chunk-wise top-k of a flat fp32 buffer and its wire format (module docstring)."""

    def __init__(self, numel: int, chunk_size: int, k: int, value_format: str):
        if not 2 <= chunk_size <= MAX_CHUNK:
            raise ValueError(f"chunk_size must be in [2, {MAX_CHUNK}], got {chunk_size}")
        if not 1 <= k <= chunk_size:
            raise ValueError(f"k must be in [1, chunk_size={chunk_size}], got {k}")
        self.numel, self.chunk_size, self.k, self.value_format = numel, chunk_size, k, value_format
        self.chunks = max(1, math.ceil(numel / chunk_size))
        sent = self.chunks * k
        self.code_bytes = math.ceil(sent / 4) if value_format == "2bit" else 4 * sent
        self.index_bytes = 2 * sent
        self.scale_bytes = 4 * self.chunks if value_format == "2bit" else 0

    @property
    def payload_bytes(self) -> int:
        return self.code_bytes + self.index_bytes + self.scale_bytes

    @staticmethod
    def bytes_per_element(chunk_size: int, k: int, value_format: str) -> float:
        """Payload bytes per element of θ (whole chunks; the what-if's figure)."""
        codes = k / 4 + 4 if value_format == "2bit" else 4 * k  # 2-bit codes + scale
        return (codes + 2 * k) / chunk_size

    @torch.no_grad()
    def encode(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, sent): the uint8 payload for `flat` and the dense fp32 buffer of what
        it decodes to (subtracted from the error feedback)."""
        rows = torch.zeros(self.chunks * self.chunk_size, dtype=torch.float32,
                           device=flat.device)
        rows[:self.numel] = flat
        rows = rows.view(self.chunks, self.chunk_size)
        offsets = rows.abs().topk(self.k, dim=1, sorted=False).indices
        values = rows.gather(1, offsets)
        parts = []
        if self.value_format == "2bit":
            scale = values.abs().amax(dim=1, keepdim=True)
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            codes = ((values / safe + 1) * 1.5).round_().clamp_(0, 3).to(torch.uint8)
            values = _levels(codes) * scale
            parts.append(_pack(codes.view(-1)))
        else:
            parts.append(values.reshape(-1).view(torch.uint8))
        parts.append(offsets.to(torch.int16).reshape(-1).view(torch.uint8))
        if self.value_format == "2bit":
            parts.append(scale.reshape(-1).view(torch.uint8))
        sent = torch.zeros_like(rows).scatter_(1, offsets, values)
        return torch.cat(parts), sent.view(-1)[:self.numel]

    @torch.no_grad()
    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """A payload (any rank's) -> the dense fp32 buffer of `numel` it stands for."""
        shape = (self.chunks, self.k)
        codes = payload[:self.code_bytes]
        start = self.code_bytes
        offsets = payload[start:start + self.index_bytes].clone().view(torch.int16)
        offsets = offsets.view(shape).long()
        if self.value_format == "2bit":
            scale = payload[start + self.index_bytes:].clone().view(torch.float32)
            values = _levels(_unpack(codes, shape[0] * shape[1]).view(shape)) * scale.view(-1, 1)
        else:
            values = codes.clone().view(torch.float32).view(shape)
        dense = torch.zeros(self.chunks, self.chunk_size, dtype=torch.float32,
                            device=payload.device)
        return dense.scatter_(1, offsets, values).view(-1)[:self.numel]


def _levels(codes: torch.Tensor) -> torch.Tensor:
    """2-bit code c -> the level 2c/3 − 1 in {−1, −1/3, 1/3, 1} (times the chunk's scale)."""
    return codes.float() * (2 / 3) - 1


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 3] -> four a byte (code 4i + j in bits 2j, 2j + 1 of byte i)."""
    padded = torch.zeros(math.ceil(codes.numel() / 4) * 4, dtype=torch.uint8,
                         device=codes.device)
    padded[:codes.numel()] = codes
    quads = padded.view(-1, 4)
    return quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)


def _unpack(packed: torch.Tensor, count: int) -> torch.Tensor:
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed.view(-1, 1) >> shifts) & 3).view(-1)[:count]


class CodedFeedback:
    """A rule whose exchange is a per-replica accumulator sent through a codec (SparseLoCo's
    error feedback e_i, DeMo's momentum m_i): a ← decay·a + Δ_i; the codec's payload of a is
    sent and what it decodes to is removed from a (the rest waits for later rounds); the
    replicas' payloads are decoded and averaged (one all-gather, `average_coded`). A rule
    mixing it in sets `codec`, `decay` and `accumulator` (None before the first round)."""

    codec: ChunkCodec  # or any codec with encode, decode and payload_bytes (DeMo's DCTCodec)
    decay: float
    accumulator: torch.Tensor | None

    @torch.no_grad()
    def exchange(self, outer, group, launch):
        flat = outer.pseudo_gradient(torch.float32)
        a = flat if self.accumulator is None else self.accumulator.mul_(self.decay).add_(flat)
        payload, sent = self.codec.encode(a)
        self.accumulator = a.sub_(sent)
        return outer.comm.average_coded(payload, self.codec.decode, group, launch)

    @torch.no_grad()
    def warm_up(self, outer, group) -> None:
        payload = torch.zeros(self.codec.payload_bytes, dtype=torch.uint8,
                              device=outer.params[0].device)
        outer.comm.average_coded(payload, self.codec.decode, group, record=False)

    def saved_accumulator(self) -> torch.Tensor | None:
        return None if self.accumulator is None else self.accumulator.clone()

    def load_accumulator(self, saved: torch.Tensor | None) -> None:
        self.accumulator = None if saved is None else saved.to(self.params[0].device)


class SparseLoCoRule(CodedFeedback, SGDRule):
    """The outer SGD step on the mean of the replicas' coded top-k of their error-feedback
    accumulators (module docstring); one accumulator e_i per fragment and replica.

    Not on shards (yet): its chunks would cut each rank's shards rather than the model, so
    a sharded run would not equal the unsharded one (what tests/test_shard.py requires of
    every strategy that shards)."""

    shards = False

    def __init__(self, params, lr: float = 1.0, momentum: float = 0.0, nesterov: bool = True,
                 error_decay: float = 0.95, chunk_size: int = 4096, topk_per_chunk: int = 64,
                 value_format: str = "2bit"):
        super().__init__(params, lr, momentum, nesterov)
        self.decay = error_decay
        self.codec = ChunkCodec(sum(p.numel() for p in params), chunk_size, topk_per_chunk,
                                value_format)
        self.accumulator = None
        """e_i, on the replica's device; None before the first round."""

    @classmethod
    def from_config(cls, params, config) -> SparseLoCoRule:
        return cls(params, lr=config.outer_lr, momentum=config.outer_momentum,
                   nesterov=config.nesterov, error_decay=config.error_decay,
                   chunk_size=config.chunk_size, topk_per_chunk=config.topk_per_chunk,
                   value_format=config.value_format)

    @classmethod
    def states(cls, config) -> int:
        return 1 + int(config.outer_momentum > 0)  # e_i, and SGD's momentum if any

    @classmethod
    def sends(cls, config) -> Sends:
        return Sends("all_gather", ChunkCodec.bytes_per_element(
            config.chunk_size, config.topk_per_chunk, config.value_format))

    @classmethod
    def check(cls, config, cfg) -> None:
        super().check(config, cfg)
        if config.outer_compression != "none":
            raise ValueError(f"strategy.outer_compression={config.outer_compression!r} with "
                             "sparseloco: its exchange has its own format (chunk_size, "
                             "topk_per_chunk, value_format); use outer_compression none")
        if config.outer_grad_dtype != "fp32":
            raise ValueError(f"strategy.outer_grad_dtype={config.outer_grad_dtype!r} with "
                             "sparseloco: its values travel as value_format says; use fp32")

    def state_dict(self) -> dict:
        return {"optimizer": super().state_dict(), "error": self.saved_accumulator()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state["optimizer"])
        self.load_accumulator(state["error"])


@dataclass
class SparseLoCoConfig(DiLoCoConfig):
    name: str = "sparseloco"
    """SparseLoCo (arXiv 2508.15706): DiLoCo sending a 2-bit chunk-wise top-k of an
    error-feedback accumulator, with a plain outer SGD step."""
    outer_optimizer: Literal["sparseloco"] = "sparseloco"
    """The outer rule (algorithms/outer_rules/sparseloco.py)."""
    inner_steps: int = 50
    """H, inner steps per outer round (the paper: 15 to 250; ours: 50)."""
    outer_lr: float = 1.0
    """η of the outer step θ ← θ − η mean_i Δ̂_i (ours: 1, plain averaging of the sparse
    updates)."""
    outer_momentum: float = 0.0
    """Outer SGD momentum: 0, the paper's (the accumulator takes its place)."""
    error_decay: float = 0.95
    """β of the error feedback e ← β e + Δ (ours: 0.95). 0 keeps nothing but what was not
    sent of this round."""
    chunk_size: int = 4096
    """Elements of the flat pseudo-gradient per chunk (ours: 4096; at most 32768, offsets
    are int16). The last chunk is zero-padded."""
    topk_per_chunk: int = 64
    """k, entries sent per chunk (ours: 64 of 4096, 1.6%: the paper's 1-3%)."""
    value_format: Literal["2bit", "fp32"] = "2bit"
    """2bit: the paper's; four levels {±1/3, ±1} of the chunk's largest selected magnitude,
    one fp32 scale per chunk. fp32: the values as they are."""

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.error_decay <= 1:
            raise ValueError(f"strategy.error_decay must be in [0, 1], got {self.error_decay!r}")
        if not 2 <= self.chunk_size <= MAX_CHUNK:
            raise ValueError(f"strategy.chunk_size must be in [2, {MAX_CHUNK}], "
                             f"got {self.chunk_size!r}")
        if not 1 <= self.topk_per_chunk <= self.chunk_size:
            raise ValueError(f"strategy.topk_per_chunk must be in [1, chunk_size="
                             f"{self.chunk_size}], got {self.topk_per_chunk!r}")


class SparseLoCo(DiLoCo):
    """SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706): DiLoCo with the sparseloco outer
    rule (`SparseLoCoRule`; docs/algorithms.md). **Our choices** where the paper is not
    explicit to us: chunks of the flat fragment buffer (crossing tensor boundaries), the
    2-bit levels and the int16 offsets, β = 0.95, η = 1, H = 50.

    Identity (tests/test_outer_rules.py): `topk_per_chunk = chunk_size`, `value_format:
    fp32`, `error_decay: 0` is DiLoCo with the same outer SGD step, bit for bit.
    """

    Config = SparseLoCoConfig

    @classmethod
    def memory_terms(cls, cfg, facts) -> dict[str, int]:
        """DiLoCo's (the error feedback is the rule's state), + a round's buffers: the
        chunked copy of e and what it sends (θ padded to whole chunks, each), every
        replica's payload gathered, the decoded payload and the running sum (θ each)."""
        terms = super().memory_terms(cfg, facts)
        config, theta = cfg.strategy, facts.param_bytes
        codec = ChunkCodec(theta // 4, config.chunk_size, config.topk_per_chunk,
                           config.value_format)
        replicas = cfg.parallel.world_size // cfg.parallel.group_size
        terms["sparseloco: chunked e and the sent part"] = (
            2 * codec.chunks * config.chunk_size * 4)
        terms["sparseloco: gathered payloads"] = replicas * codec.payload_bytes
        terms["sparseloco: decoded payload and the sum"] = 2 * theta
        return terms

    @classmethod
    def traffic(cls, cfg, facts) -> Traffic:
        """DiLoCo's, its exchange `payload_gather`'s; with fragments or overlap, Streaming
        DiLoCo's schedule (algorithms/outer_traffic.py) with that exchange per fragment:
        each fragment's rule codes its own flat buffer (its chunks, its payload)."""
        config = cfg.strategy
        if (config.fragments, config.overlap_steps) == (1, 0):
            return super().traffic(cfg, facts)
        return streaming_traffic(config, cfg, facts, 4, exchange=cls.payload_gather(cfg),
                                 notes=["sparseloco: each fragment's chunk-wise top-k "
                                        "payload all-gathered across the replicas"])

    @classmethod
    def payload_gather(cls, cfg) -> Exchange:
        """One all-gather of a fragment's coded payload (its `ChunkCodec` of `numel`
        elements) across the ranks holding `rank`'s position in every replica (phase
        "outer"), launched `overlap` steps early; bytes as coded (word 1: no planner's
        dtype rescales them)."""
        config, p = cfg.strategy, cfg.parallel

        def gather(rank: int, fragment: int, round_: int, numel: int, overlap: int):
            codec = ChunkCodec(numel, config.chunk_size, config.topk_per_chunk,
                               config.value_format)
            return [Transfer("outer", "all_gather", (codec.payload_bytes,),
                             cross_of(rank, p.group_size, p.world_size),
                             overlap_steps=overlap, word_bytes=1)]
        return gather

    @classmethod
    def outer_transfers(cls, cfg, facts, rank: int) -> list[Transfer]:
        """One all-gather of this rank's coded payload across the replicas (phase "outer")."""
        p = cfg.parallel
        if p.world_size // p.group_size == 1:
            return []
        return cls.payload_gather(cfg)(rank, 0, 0, facts.param_bytes // 4, 0)
