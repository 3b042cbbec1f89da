"""What every commbench architecture shares: the config base, the layer list, the init.

Exercised by `pytest tests/test_model.py`. An architecture (bench/model/gpt.py,
bench/model/llama.py) is a `CausalLM`: an `Embedding`, `n_layer` `TransformerBlock`s and a
`Head`, whose sequential application (`as_layers()`) IS `forward`, so pipelines cut the list
into stages and optimizers classify parameters by module type (the Linear weights inside a
`TransformerBlock` are the hidden matrices Muon updates), whatever the architecture.

Initialisation is a pure function of (seed, parameter name): the model draws ONE integer
from the global torch RNG when it is built (`init_seed`), and each parameter is filled from
its own CPU generator seeded by that integer and the parameter's name in the whole model
(`embed.wte.weight`, `blocks.3.attn.q.weight`, ...). So the same `torch.manual_seed` gives
the same weights on every rank, and a part of the model built on the meta device (one
pipeline stage, one FSDP shard) is materialised with exactly the values the whole model
would have had, without building the rest (`materialize`). Values are drawn in fp32 on the
CPU whatever the device, so CPU and GPU runs start from the same weights.

Rules: Linear and Embedding weights normal(0, 0.02), residual output projections (flagged
`is_residual_projection`) 0.02 / sqrt(2 * n_layer) (each block adds two residual branches),
biases 0, norm gains 1 (LayerNorm biases 0), an untied head normal(0, 0.02).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

INIT_STD = 0.02


@dataclass
class DecoderConfig:
    """Fields every architecture has; plain data (`dataclasses.asdict` goes into checkpoints)."""

    vocab_size: int
    """Rows of the token embedding (may exceed the tokenizer's vocabulary when padded)."""
    seq_len: int
    """Maximum context length."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide n_embd."""
    n_embd: int
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout on attention weights and residual branches (0 for pretraining)."""
    tie_embeddings: bool = True
    """Whether the LM head is the token embedding's weight (one Parameter) or its own."""
    arch: str = ""
    """The architecture (`ARCHS` in bench/model/__init__.py); fixed by each subclass."""

    ARCH = ""

    def __post_init__(self) -> None:
        if self.arch != self.ARCH:
            raise ValueError(f"model.arch of a {type(self).__name__} must be {self.ARCH!r}, "
                             f"got {self.arch!r}")
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


class RMSNorm(nn.Module):
    """x / rms(x) * gain, computed in fp32 and cast back (Hugging Face Llama's order)."""

    def __init__(self, n_embd: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n_embd))

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        x = x_BTC.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(x_BTC.dtype)


class TransformerBlock(nn.Module):
    """Base of every architecture's block: `block_forward` is the math; `forward` adds
    activation checkpointing when `checkpointing` is on (recompute the block's activations
    in backward instead of keeping them: same values, less memory, about a third more
    compute). Optimizers find hidden matrices as the Linear weights inside these."""

    checkpointing = False

    def block_forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        if self.checkpointing and torch.is_grad_enabled():
            return checkpoint(self.block_forward, x_BTC, use_reentrant=False)
        return self.block_forward(x_BTC)


class Embedding(nn.Module):
    """Token ids (B, T) -> hidden states (B, T, C): token embedding, plus learned position
    embeddings when `positions` (GPT-2; Llama's positions are rotary, inside attention)."""

    def __init__(self, cfg: DecoderConfig, positions: bool) -> None:
        super().__init__()
        self.seq_len = cfg.seq_len
        self.tied = cfg.tie_embeddings
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd) if positions else None
        self.dropout = nn.Dropout(cfg.dropout)

    def tied_parameter(self) -> nn.Parameter | None:
        """The weight shared with the head, None when the head is untied."""
        return self.wte.weight if self.tied else None

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        T = idx_BT.size(1)
        if T > self.seq_len:
            raise ValueError(f"sequence length {T} exceeds model.seq_len {self.seq_len}")
        x_BTC = self.wte(idx_BT)
        if self.wpe is not None:
            x_BTC = x_BTC + self.wpe(torch.arange(T, device=idx_BT.device))
        return self.dropout(x_BTC)


class Head(nn.Module):
    """Hidden states (B, T, C) -> logits (B, T, V): final norm, then the output projection.

    Tied (`tied_weight` given): `weight` is the token embedding's Parameter object itself. A
    pipeline that puts `Head` and `Embedding` on different stages holds two copies of it and
    must keep them equal itself (e.g. sum their gradients across the two stages); an untied
    head's weight is its own.
    """

    def __init__(self, norm: nn.Module, vocab_size: int, n_embd: int,
                 tied_weight: nn.Parameter | None) -> None:
        super().__init__()
        self.ln_f = norm
        self.tied = tied_weight is not None
        self.weight = tied_weight if self.tied else nn.Parameter(torch.empty(vocab_size, n_embd))

    def tied_parameter(self) -> nn.Parameter | None:
        return self.weight if self.tied else None

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln_f(x_BTC), self.weight)


def lm_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all positions (fp32 logits): the model's loss,
    and the one a pipeline's last stage applies (TrainSetup.loss_fn)."""
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten())


class CausalLM(nn.Module):
    """`embed`, `blocks`, `head` of an architecture; forward, counts and init shared."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # the one draw from the global RNG, before anything else and on meta builds too, so
        # a meta build and a real one hold the same seed
        self.init_seed = int(torch.randint(2**62, (1,), device="cpu").item())
        device = torch.get_default_device()
        with torch.device("meta"):  # modules allocate nothing until materialised
            embed, blocks, head = self.build(cfg)
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.head = head
        if device.type != "meta":
            self.materialize(self, device)

    def build(self, cfg: DecoderConfig) -> tuple[Embedding, list[TransformerBlock], Head]:
        """The architecture's (embedding, blocks, head)."""
        raise NotImplementedError

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

        The modules are the model's own (same Parameters), so a pipeline may cut this list
        into contiguous stages. With tied embeddings Embedding and Head share the token
        weight; see ``Head`` for what a pipeline splitting them must do.
        """
        return [self.embed, *self.blocks, self.head]

    # ------------------------------------------------------------------ counts

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count, each shared Parameter once.

        ``non_embedding=True`` counts the parameters that take part in matmuls (the N of
        ``flops_per_token``): without position embeddings, and without the token
        embedding unless it is also the head (tied: its matmul costs compute; nanoGPT's
        convention).
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            if self.embed.wpe is not None:
                n -= self.embed.wpe.weight.numel()
            if not self.head.tied:
                n -= self.embed.wte.weight.numel()
        return n

    def flops_per_token(self) -> int:
        """Training FLOPs per token, PaLM appendix B style: 6N + 12 * L * C * T.

        6N covers forward (2N) and backward (4N) matmuls with N = num_params(non_embedding
        =True); 12 * n_layer * n_embd * seq_len covers the attention score and value
        matmuls at full context (n_head * head_dim = n_embd; grouped-query attention shares
        keys and values between heads but every query head still attends). Divide achieved
        FLOP/s by peak FLOP/s for MFU. Activation checkpointing's recomputation is not
        counted (MFU, not hardware utilisation).
        """
        c = self.cfg
        return 6 * self.num_params(non_embedding=True) + 12 * c.n_layer * c.n_embd * c.seq_len

    # ------------------------------------------------------------------ init

    def enable_activation_checkpointing(self, enabled: bool = True) -> None:
        """Checkpoint every block (`model.activation_checkpointing: blocks`)."""
        for block in self.blocks:
            block.checkpointing = enabled

    @torch.no_grad()
    def init_weights(self, only: nn.Module | None = None) -> None:
        """Fill the parameters (of the modules inside `only`, default all) with their init
        values: each from its own generator keyed by `init_seed` and its name here. A tied
        head's own copy (a pipeline's last stage) takes the token embedding's values."""
        inside = None if only is None else {id(m) for m in only.modules()}
        for prefix, module in self.named_modules():
            if inside is not None and id(module) not in inside:
                continue
            for local, param in module.named_parameters(recurse=False):
                name = f"{prefix}.{local}" if prefix else local
                if isinstance(module, Head) and module.tied:
                    if param is self.embed.wte.weight:
                        continue  # the embedding's own Parameter, filled as such
                    name = "embed.wte.weight"
                _fill(param, self._init_rule(module, local), self._generator(name))

    def _init_rule(self, module: nn.Module, name: str) -> tuple[str, float]:
        """(kind, std) of one parameter's init."""
        if isinstance(module, nn.Linear):
            if name == "bias":
                return "zeros", 0.0
            std = INIT_STD
            if getattr(module, "is_residual_projection", False):
                std /= math.sqrt(2 * self.cfg.n_layer)
            return "normal", std
        if isinstance(module, (nn.Embedding, Head)):
            return "normal", INIT_STD
        if isinstance(module, (nn.LayerNorm, RMSNorm)):
            return ("ones", 0.0) if name == "weight" else ("zeros", 0.0)
        raise TypeError(f"no init rule for {type(module).__name__}.{name}")

    def _generator(self, name: str) -> torch.Generator:
        digest = hashlib.blake2b(f"{self.init_seed}:{name}".encode(), digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))

    def materialize(self, module: nn.Module, device: torch.device | str) -> None:
        """Make `module` (this model or a part of it built on the meta device) real on
        `device`, with the values the whole model's init gives it. No-op when it is real."""
        if not any(p.is_meta for p in module.parameters()):
            return
        module.to_empty(device=device)
        ids = {id(m) for m in module.modules()}
        if id(self.head) in ids and id(self.embed) in ids:
            self.tie_weights()  # to_empty gave each its own tensor
        self.init_weights(module)

    def tie_weights(self) -> None:
        """With tied embeddings, make the head's weight the token embedding's Parameter
        again (after `to_empty` or an assigning load gave each its own tensor)."""
        if self.head.tied:
            self.head.weight = self.embed.wte.weight


def _fill(param: torch.Tensor, rule: tuple[str, float], generator: torch.Generator) -> None:
    """Write the rule's values into `param` (drawn in fp32 on the CPU; a DTensor shard
    takes its slice of them)."""
    kind, std = rule
    values = torch.empty(param.shape, dtype=torch.float32)
    if kind == "normal":
        values.normal_(0.0, std, generator=generator)
    else:
        values.fill_(1.0 if kind == "ones" else 0.0)
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        values = distribute_tensor(values.to(param.device_mesh.device_type), param.device_mesh,
                                   param.placements, src_data_rank=None)
    param.copy_(values)


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


def hidden_matrices(module: nn.Module) -> list[nn.Parameter]:
    """The 2-D weights of the `nn.Linear` modules inside `TransformerBlock`s, in
    `module.parameters()` order: what Muon updates (bench/optim.py) and the memory plan
    counts as Muon's (bench/memory.py)."""
    inside = {id(m.weight) for block in module.modules() if isinstance(block, TransformerBlock)
              for m in block.modules() if isinstance(m, nn.Linear) and m.weight.dim() == 2}
    return [p for p in module.parameters() if id(p) in inside and p.requires_grad]
