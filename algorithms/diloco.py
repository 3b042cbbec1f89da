"""DiLoCo: H local inner steps per replica, then one outer optimizer step on the average.

Run it with `commbench run configs/diloco-tiny.yaml`; tests: `pytest tests/test_diloco.py`.
The math is docs/algorithms.md's DiLoCo section; the outer pieces live in
algorithms/outer.py.

Layout: `parallel.group_size` ranks form one replica and all-reduce gradients inside it
every step with torch DDP (ledger phase "inner"); the `world_size / group_size` replicas
talk only at outer steps, one all-reduce of |θ| in the wire dtype across the ranks with the
same position in their groups (phase "outer"). The communicator records each op's tier,
so the network model prices intra-group and cross-group traffic on their own links.
With `parallel.shard: fsdp` a replica is one FSDP2 group instead of a DDP group
(algorithms/shard.py): inner steps sharded inside it, and each rank's outer step on its
own shards across the replicas, so a rank's outer all-reduce carries |θ| / group_size.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from algorithms.base import (
    DataParallelStrategy,
    StepStats,
    StrategyConfig,
    TrainSetup,
    require_data_parallel,
    unwrap,
)
from algorithms.ddp import make_ddp
from algorithms.memory import HOST, fsdp_terms, require_shard_ranks
from algorithms.outer import WIRE_BYTES, OuterOptimizer, RoundStats, replica_groups
from algorithms.traffic import (
    Traffic,
    Transfer,
    local_update_traffic,
    outer_all_reduce,
    outer_notes,
    replica_inner,
)


@dataclass
class DiLoCoConfig(StrategyConfig):
    name: str = "diloco"
    """DiLoCo (arXiv 2311.08105): local inner steps, outer Nesterov step every H steps."""
    inner_steps: int = 500
    """H, inner steps per outer round (paper: 500; scale with the run: 10..100 for short
    runs). A last, shorter round closes at the final step so no inner work is lost."""
    outer_lr: float = 0.7
    """Outer learning rate η."""
    outer_momentum: float = 0.9
    """Outer momentum μ (sgd), or Adam's beta1 (adam)."""
    nesterov: bool = True
    """Nesterov momentum in the outer SGD step (PyTorch's SGD(nesterov=True) form)."""
    outer_optimizer: Literal["sgd", "adam"] = "sgd"
    """Outer optimizer applied to the global θ with the pseudo-gradient as its gradient."""
    outer_beta2: float = 0.999
    """Adam's beta2 for outer_optimizer=adam."""
    outer_grad_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Dtype of the pseudo-gradient on the wire (bf16/fp16 halve the outer bytes)."""
    offload_outer: bool = False
    """Keep the global θ and the outer optimizer state in CPU memory (large models)."""
    bucket_cap_mb: float = 25.0
    """Bucket size in MiB of the intra-group DDP gradient all-reduce (group_size > 1)."""

    def __post_init__(self):
        if self.inner_steps < 1:
            raise ValueError(f"strategy.inner_steps must be >= 1, got {self.inner_steps!r}")
        if self.outer_lr <= 0:
            raise ValueError(f"strategy.outer_lr must be > 0, got {self.outer_lr!r}")
        for key in ("outer_momentum", "outer_beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"strategy.{key} must be in [0, 1), got {getattr(self, key)!r}")
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"strategy.bucket_cap_mb must be > 0, got {self.bucket_cap_mb!r}")

    def check(self, cfg) -> None:
        # group_size dividing world_size is bench.config.validate's general rule
        require_data_parallel(self, cfg)
        require_shard_ranks(cfg, cfg.parallel.group_size, "parallel.group_size")

    def outer_states(self) -> int:
        """Tensors of outer optimizer state per parameter (SGD momentum, Adam's two)."""
        return 2 if self.outer_optimizer == "adam" else int(self.outer_momentum > 0)

    def memory_terms(self, cfg, facts) -> dict[str, int]:
        """+ the global θ and its outer state (on the CPU with offload_outer), the round's
        pseudo-gradient in the wire dtype (and its fp32 copy as θ's gradient when the two
        differ), the evaluation copy of θ, and intra-group DDP buckets. Sharded (FSDP2 in
        each replica): the replica's shards and FSDP's gathered units, θ and its outer
        state per shard (|θ| / group_size), θ swapped in for evaluation instead of a copy."""
        sharded = cfg.parallel.shard == "fsdp"
        if sharded:
            facts = facts.sharded(cfg.parallel.group_size)
        terms = facts.base_terms()
        if sharded:
            terms.update(fsdp_terms(facts))
        theta = facts.param_bytes // facts.shard  # each rank steps its own shard of θ
        host = HOST if self.offload_outer else ""
        terms[f"{host}outer: global θ"] = theta
        terms[f"{host}outer: optimizer state"] = self.outer_states() * theta
        wire = WIRE_BYTES[self.outer_grad_dtype]
        terms["outer: pseudo-gradient buffer"] = theta * wire // 4
        if wire != 4 or self.offload_outer:
            terms[f"{host}outer: θ's gradient (fp32 copy)"] = theta
        terms["evaluation: the replica's shard kept while θ is swapped in" if sharded
              else "evaluation copy of θ"] = theta
        if cfg.parallel.group_size > 1 and not sharded:
            terms["DDP gradient buckets (inside the replica)"] = facts.param_bytes
        return terms

    def traffic(self, cfg, facts) -> Traffic:
        """Every step the replica's inner traffic (phase "inner"); a round's last step
        adds `outer_transfers` (algorithms/traffic.py)."""
        return local_update_traffic(cfg, self.inner_steps,
                                    replica_inner(cfg, facts, self.bucket_cap_mb),
                                    lambda rank: self.outer_transfers(cfg, facts, rank),
                                    notes=outer_notes(cfg))

    def outer_transfers(self, cfg, facts, rank: int) -> list[Transfer]:
        """What `rank` sends when a round closes: one all-reduce of its θ in the wire dtype
        (the one place an outer step says what it sends, e.g. fragments, compression)."""
        return outer_all_reduce(cfg, facts, rank, WIRE_BYTES[self.outer_grad_dtype])


class DiLoCo(DataParallelStrategy):
    """DiLoCo (Douillard et al. 2023, arXiv 2311.08105), with hierarchical replica groups.

    Every replica starts a round from the global θ, runs H inner optimizer steps on its
    own shard (inner optimizer state is per replica, never synchronised, never reset), then
    `Δ = mean_i(θ − θ_i)` is all-reduced once and `θ ← OuterOpt(θ, Δ)`; the replica
    restarts from the new θ. The evaluated model is the global θ. Nothing is reconstructed:
    this is the paper's algorithm; the hierarchical groups (DDP inside a replica) are the
    paper's "replica" made of several ranks. Our one choice: when the run's steps are not
    a multiple of H, a last, shorter round closes at the final step (no inner work is lost).

    Identities (tests/test_diloco.py): outer lr 1, momentum 0 == Local SGD (parameter
    averaging every H steps); H = 1, outer lr 1, momentum 0, inner SGD == DDP with SGD.
    """

    Config = DiLoCoConfig

    def __init__(self, config: DiLoCoConfig, setup: TrainSetup):
        super().__init__(config, setup)
        if setup.group_size > 1 and self.sharded is None:
            self.train_model, self.comm_hook = self.register_ddp(
                make_ddp(self.model, self.comm, self.group, config.bucket_cap_mb))
        # sharded: each rank's outer step works on its shards, |θ| / group_size
        params = (self.model.parameters() if self.sharded is None
                  else self.sharded.local_parameters())
        self.outer = OuterOptimizer(
            params, self.comm, self.cross_group, self.num_replicas,
            kind=config.outer_optimizer, lr=config.outer_lr, momentum=config.outer_momentum,
            nesterov=config.nesterov, beta2=config.outer_beta2,
            wire_dtype=config.outer_grad_dtype, offload=config.offload_outer,
        )
        self.round = 0
        self._eval_copy: nn.Module | None = None

    def replica_group(self):
        self.group, self.cross_group, self.num_replicas = replica_groups(
            self.comm, self.setup.group_size)
        return self.group

    # ------------------------------------------------------------- inner steps

    def train_step(self, batch) -> StepStats:
        with self.comm.phase("inner"):
            return super().train_step(batch)

    # ------------------------------------------------------------- outer rounds

    def round_ends(self) -> bool:
        """Whether the step just taken closes an outer round (every H, and the last step)."""
        return (self.step_index % self.config.inner_steps == 0
                or self.step_index == self.setup.total_steps)

    def in_sync(self) -> bool:
        """Whether the replica's weights equal the global θ (before the first step, and
        right after a round)."""
        return self.round_ends()

    def outer_hyperparameters(self) -> tuple[float, float]:
        """(outer lr, outer momentum) for the round closing now."""
        return self.config.outer_lr, self.config.outer_momentum

    def outer_step(self, lr: float, momentum: float) -> RoundStats:
        return self.outer.step(lr, momentum)

    def after_inner_step(self) -> tuple[float, dict[str, float]]:
        if not self.round_ends():
            return 0.0, {}
        lr, momentum = self.outer_hyperparameters()
        stats = self.outer_step(lr, momentum)
        self.round += 1
        return stats.seconds, {
            "outer_round": self.round, "outer_lr": lr, "outer_momentum": momentum,
            "pseudo_grad_norm": stats.pseudo_grad_norm, "outer_bytes": stats.nbytes,
            "outer_s": stats.seconds,
        }

    # ------------------------------------------------------------- evaluation, state

    @contextlib.contextmanager
    def eval_weights(self):
        """Sharded: the global θ swapped into the replica's shards for the evaluation (the
        replica's own weights restored after), unless they are θ already."""
        if self.in_sync():
            yield
            return
        own = [p.clone() for p in self.outer.params]
        self.outer.copy_global_to(self.outer.params)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, saved in zip(self.outer.params, own, strict=True):
                    p.copy_(saved)

    def eval_model(self) -> nn.Module:
        """The global θ: the replica itself right after a round, else a copy holding θ."""
        if self.in_sync():
            return self.model
        if self._eval_copy is None:
            self._eval_copy = copy.deepcopy(unwrap(self.model))
        self.outer.copy_global_to(self._eval_copy.parameters())
        return self._eval_copy

    def state_dict(self) -> dict:
        return {**super().state_dict(), "outer": self.outer.state_dict(),
                "round": self.round}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.outer.load_state_dict(state["outer"])
        self.round = state["round"]
