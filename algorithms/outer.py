"""Outer-optimizer pieces shared by the local-update strategies (DiLoCo, Pier).

Exercised by `pytest tests/test_diloco.py tests/test_streaming.py`; the math is
docs/algorithms.md (DiLoCo, Pier, Streaming DiLoCo). Two things live here (the streaming
schedule over fragments, each with its own `OuterOptimizer`, is algorithms/streaming.py):

- `replica_groups`: the hierarchical layout. `world = num_replicas * group_size`; the
  `group_size` consecutive ranks `[r*g, (r+1)*g)` form replica `r` and run DDP inside it;
  the ranks holding the same position `p` in every replica, `p, p+g, p+2g, ...`, form the
  cross group over which the outer all-reduce runs (each rank reduces the full |θ|, so a
  replica's g ranks run g all-reduces in parallel, one per position).
- `OuterOptimizer`: the global θ, its outer rule (algorithms/outer_rules/: SGD with
  optional Nesterov momentum, Adam, SparseLoCo, NoLoCo, ...), and one outer round:
  `Δ_i = θ − θ_i`, exchanged as the rule says (by default `Δ = mean_i Δ_i` cast to the
  wire dtype and all-reduced as ONE flat buffer, phase "outer"; with a codec,
  algorithms/compress.py, quantized or sparse instead), the rule's step on θ (SGD's, in
  PyTorch's SGD(nesterov=True) form: `m ← μ m + Δ; θ ← θ − η (Δ + μ m)`), and the new θ
  copied back into the replica (or merged with it: `mix_alpha`).

The global θ lives on the model's device, or on the CPU with `offload=True` (large
models: θ and the outer optimizer state then cost no accelerator memory, at the price of
two host-device copies of |θ| per round).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from algorithms.comm import Communicator, Group, Pending
from algorithms.compress import RowQuantizer, TopK
from algorithms.outer_rules import OuterRule, rule_factory

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Pseudo-gradient dtypes on the wire (config value -> torch dtype)."""
WIRE_BYTES = {name: dtype.itemsize for name, dtype in WIRE_DTYPES.items()}


def replica_groups(comm: Communicator, group_size: int) -> tuple[Group | None, Group | None, int]:
    """(intra group, cross group, number of replicas) for this rank.

    A group is None when it is the whole world (no subgroup needed). Every rank must call
    this in the same order (subgroup creation is collective over the world).
    """
    world = comm.world_size
    if group_size < 1 or world % group_size:
        raise ValueError(
            f"parallel.group_size ({group_size}) must divide parallel.world_size ({world})"
        )
    num_replicas = world // group_size
    intra = cross = None
    if 1 < group_size < world:
        intra = comm.split([range(r * group_size, (r + 1) * group_size)
                            for r in range(num_replicas)])
    if 1 < num_replicas < world:
        cross = comm.split([range(p, world, group_size) for p in range(group_size)])
    return intra, cross, num_replicas


@dataclass
class RoundStats:
    """What one outer round (of one fragment) reports (this rank's view)."""

    pseudo_grad_norm: float
    """L2 norm of the averaged pseudo-gradient Δ (as the outer optimizer sees it)."""
    nbytes: int
    """Logical bytes this rank sent in the round's exchange (0 when nothing was sent)."""
    seconds: float
    """Exposed seconds of the exchange (launched ones: the wait at the sync point)."""


class OuterOptimizer:
    """The global θ of a local-update strategy (or of one fragment of it) and its outer rule.

    `params` are the replica's parameters θ_i (updated in place at every round). The global
    θ starts as their copy. `rule` builds the outer rule on it (algorithms/outer_rules/,
    `rule_factory(name, config)`: the strategies' one hook); without it `kind` names one
    ("sgd": momentum, optional Nesterov; "adam": betas = (momentum, beta2)) with the
    hyper-parameters given here. The lr and momentum are set per round, so schedules
    (Pier) need nothing else. `codec` (algorithms/compress.py, None = none) compresses the
    default exchange of Δ; a top-k codec keeps this replica's error-feedback buffer.

    A round is `exchange` (Δ_i and what the rule makes of the replicas', or a `Pending`
    one when launched) then `finish(Δ, lr, μ, α)` (the rule's step on θ, then the
    replica's merge); `step` is both, at once.
    """

    def __init__(self, params, comm: Communicator, cross_group: Group | None,
                 num_replicas: int, *, kind: str = "sgd", lr: float = 0.7,
                 momentum: float = 0.9, nesterov: bool = True, beta2: float = 0.999,
                 wire_dtype: str = "fp32", offload: bool = False,
                 codec: RowQuantizer | TopK | None = None,
                 rule: Callable[[list[torch.Tensor]], OuterRule] | None = None):
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"outer wire dtype must be one of {list(WIRE_DTYPES)}, "
                             f"got {wire_dtype!r}")
        self.params = list(params)
        self.comm, self.cross_group, self.num_replicas = comm, cross_group, num_replicas
        self.wire_dtype = WIRE_DTYPES[wire_dtype]
        self.codec = codec
        self.error: torch.Tensor | None = None
        """Top-k: what earlier rounds did not send (error feedback); None before the first."""
        home = torch.device("cpu") if offload else self.params[0].device
        self.global_params = [p.detach().to(home, copy=True) for p in self.params]
        if rule is None:  # the hyper-parameters given here stand for a config's fields
            if kind not in ("sgd", "adam"):
                raise ValueError(f"outer optimizer must be 'sgd' or 'adam', got {kind!r}")
            rule = rule_factory(kind, SimpleNamespace(outer_lr=lr, outer_momentum=momentum,
                                                      nesterov=nesterov, outer_beta2=beta2))
        self.rule = rule(self.global_params)

    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    # ---------------------------------------------------------------- the round

    @torch.no_grad()
    def pseudo_gradient(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """This replica's Δ_i = θ − θ_i, flattened into one buffer of `dtype` (default:
        the wire dtype)."""
        device = self.params[0].device
        flat = torch.empty(self.numel(), dtype=dtype or self.wire_dtype, device=device)
        offset = 0
        for p, g in zip(self.params, self.global_params, strict=True):
            n = p.numel()
            flat[offset:offset + n].copy_((g.to(device) - p).view(-1))
            offset += n
        return flat

    @torch.no_grad()
    def exchange(self, group: Group | None = None, launch: bool = False
                 ) -> torch.Tensor | Pending:
        """The rule's exchange of Δ_i over the replicas (default: their mean through the
        codec; phase: the caller's).

        `group`: the one to exchange on (default: the cross group; a launched exchange
        needs a group only it uses). `launch=True`: return the `Pending` exchange. One
        replica sends nothing, so nothing is compressed (Δ is its own, in the wire dtype;
        launched: a finished `Pending.local`).
        """
        if self.num_replicas == 1:
            flat = self.pseudo_gradient()
            return Pending.local(self.comm, flat) if launch else flat
        group = self.cross_group if group is None else group
        return self.rule.exchange(self, group, launch)

    @torch.no_grad()
    def average(self, group: Group | None, launch: bool = False) -> torch.Tensor | Pending:
        """Δ = mean_i Δ_i over `group`, through the codec: the default exchange."""
        if self.codec is None:
            return self.comm.average(self.pseudo_gradient(), group, launch=launch)
        if isinstance(self.codec, TopK):
            flat = self.pseudo_gradient(torch.float32)
            indices, values, self.error = self.codec.select(flat, self.error)
            return self.comm.average_sparse(indices, values, flat.numel(), group, launch)
        return self.comm.average(self.pseudo_gradient(torch.float32), group, self.codec,
                                 launch)

    @torch.no_grad()
    def warm_up(self, group: Group | None = None) -> None:
        """The round's exchange once, of zeros at its full size (the same collectives on the
        same group as `exchange`: NCCL connects them lazily, at their first call, which
        would land in the first timed outer step), unrecorded; no state changes (the top-k
        error buffer included). Nothing with one replica. Collective over `group`."""
        if self.num_replicas == 1:
            return
        self.rule.warm_up(self, self.cross_group if group is None else group)

    @torch.no_grad()
    def warm_up_average(self, group: Group | None) -> None:
        """`warm_up` of the default exchange (`average`)."""
        numel, device = self.numel(), self.params[0].device
        if isinstance(self.codec, TopK):
            k = self.codec.count(numel)
            indices = torch.zeros(k, dtype=self.codec.index_dtype(numel), device=device)
            values = torch.zeros(k, dtype=self.codec.value_dtype, device=device)
            self.comm.average_sparse(indices, values, numel, group, record=False)
        else:
            dtype = self.wire_dtype if self.codec is None else torch.float32
            self.comm.average(torch.zeros(numel, dtype=dtype, device=device), group,
                              self.codec, record=False)

    @torch.no_grad()
    def finish(self, delta: torch.Tensor, lr: float, momentum: float,
               alpha: float = 0.0) -> float:
        """The rule's step on θ with what the exchange gave (`delta`), then the merge
        `θ_i ← (1 − α) θ + α θ_i` (α = 0: the replica restarts from θ, exactly). Returns
        the norm of `delta`."""
        norm = torch.linalg.vector_norm(delta, dtype=torch.float32).item()
        self.rule.step(delta, lr, momentum)
        if alpha == 0:
            self.copy_global_to(self.params)
        else:  # θ_i + (1 − α)(θ − θ_i)
            for p, g in zip(self.params, self.global_params, strict=True):
                p.lerp_(g.to(p.device), 1 - alpha)
        return norm

    @torch.no_grad()
    def step(self, lr: float, momentum: float, alpha: float = 0.0) -> RoundStats:
        """One outer round at once: exchange Δ (phase "outer"), step θ, merge the replica."""
        ledger = self.comm.ledger
        first = len(ledger)
        with self.comm.phase("outer"):
            delta = self.exchange()
        nbytes, seconds = ledger.totals(("outer",), start=first)
        return RoundStats(self.finish(delta, lr, momentum, alpha), nbytes, seconds)

    @torch.no_grad()
    def accumulate_momentum(self, momentum: float) -> RoundStats:
        """Fill the SGD momentum without stepping: `m ← μ m + Δ; θ ← θ_i` (Pier's lazy start).

        Replicas are identical when this is used (DDP over all ranks), so Δ is local and
        nothing is communicated.
        """
        deltas = [g - p.to(g.device) for p, g in zip(self.params, self.global_params,
                                                      strict=True)]
        norms = [torch.linalg.vector_norm(delta, dtype=torch.float32) for delta in deltas]
        self.rule.fill_momentum(deltas, momentum)
        for p, g in zip(self.params, self.global_params, strict=True):
            g.copy_(p)
        return RoundStats(torch.linalg.vector_norm(torch.stack(norms)).item(), 0, 0.0)

    @torch.no_grad()
    def copy_global_to(self, params) -> None:
        """Copy the global θ into `params` (the replica, or an evaluation copy)."""
        for p, g in zip(params, self.global_params, strict=True):
            p.copy_(g)

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict:
        return {"global_params": [g.detach().clone() for g in self.global_params],
                "optimizer": self.rule.state_dict(),
                "error": None if self.error is None else self.error.clone()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for g, saved in zip(self.global_params, state["global_params"], strict=True):
            g.copy_(saved)
        self.rule.load_state_dict(state["optimizer"])
        error = state.get("error")
        self.error = None if error is None else error.to(self.params[0].device)
