"""Pier: DiLoCo with a lazy start (DDP while the outer momentum fills) and scheduled outer steps.

Run it with `commbench run configs/pier-tiny.yaml`; tests: `pytest tests/test_pier.py`.
The math is docs/algorithms.md's Pier section; everything else is DiLoCo
(algorithms/diloco.py).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from algorithms.contract import StepStats, TrainSetup
from algorithms.ddp import make_ddp
from algorithms.diloco import DiLoCo, DiLoCoConfig
from algorithms.outer import WIRE_BYTES, RoundStats
from algorithms.outer_traffic import streaming_traffic
from algorithms.traffic import (
    Traffic,
    Transfer,
    cross_of,
    ddp_buckets,
    fsdp_transfers,
    local_shard_bytes,
    local_update_traffic,
    outer_notes,
    replica_inner,
    replica_of,
)


@dataclass
class PierConfig(DiLoCoConfig):
    name: str = "pier"
    """Pier (arXiv 2511.17849): DDP warmup filling the outer momentum, then DiLoCo with
    momentum-decay and outer-lr schedules (schedules reconstructed from the authors' code)."""
    inner_steps: int = 50
    """H, inner steps per outer round (the authors' GPT-2 runs: 50)."""
    outer_lr: float = 0.7
    """Outer learning rate η, used only with schedule=constant."""
    outer_momentum: float = 0.9
    """Outer momentum μ, used only with schedule=constant."""
    warmup_fraction: float = 0.1
    """T_w, the lazy start: this fraction of all steps is DDP over ALL ranks while the
    outer momentum is filled every H steps (no outer step)."""
    schedule: Literal["cosine", "step", "constant"] = "cosine"
    """Outer schedules: cosine (the authors' latest), step (their earlier one), or
    constant (outer_lr and outer_momentum: DiLoCo after the lazy start)."""
    momentum_max: float = 0.99
    """cosine: μ before the decay (and during the lazy start)."""
    momentum_min: float = 0.9
    """cosine: μ at the end of the decay."""
    momentum_decay_start: float | None = None
    """cosine: fraction of training where μ starts to decay; null = warmup_fraction."""
    momentum_decay_end: float = 1.0
    """cosine: fraction of training where μ reaches momentum_min."""
    outer_lr_peak: float = 1.1
    """cosine/step: η after its linear warmup."""
    outer_lr_final: float = 0.9
    """cosine/step: η at the end (cosine), or after step_lr_drop_at (step)."""
    outer_lr_warmup: float = 0.1
    """cosine/step: η rises linearly from 0 to outer_lr_peak over this fraction of all
    steps, starting at warmup_fraction."""
    step_momentum: list[float] = field(default_factory=lambda: [0.99, 0.95, 0.9])
    """step: μ values, the first until step_momentum_at[0], and so on."""
    step_momentum_at: list[float] = field(default_factory=lambda: [0.15, 0.2])
    """step: fractions of training where μ moves to the next step_momentum value."""
    step_lr_drop_at: float = 0.8
    """step: fraction of training where η drops from outer_lr_peak to outer_lr_final."""

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"strategy.warmup_fraction must be in [0, 1), "
                             f"got {self.warmup_fraction!r}")
        if self.outer_optimizer != "sgd":
            raise ValueError("strategy.outer_optimizer must be 'sgd' for pier (its momentum "
                             f"schedules act on SGD momentum), got {self.outer_optimizer!r}")
        for key in ("outer_lr_peak", "outer_lr_final"):
            if getattr(self, key) <= 0:
                raise ValueError(f"strategy.{key} must be > 0, got {getattr(self, key)!r}")
        for key in ("momentum_max", "momentum_min"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"strategy.{key} must be in [0, 1), got {getattr(self, key)!r}")
        for i, mu in enumerate(self.step_momentum):
            if not 0 <= mu < 1:
                raise ValueError(f"strategy.step_momentum[{i}] must be in [0, 1), got {mu!r}")
        fractions = {"momentum_decay_end": self.momentum_decay_end,
                     "outer_lr_warmup": self.outer_lr_warmup,
                     "step_lr_drop_at": self.step_lr_drop_at}
        if self.momentum_decay_start is not None:
            fractions["momentum_decay_start"] = self.momentum_decay_start
        fractions.update({f"step_momentum_at[{i}]": v for i, v in enumerate(self.step_momentum_at)})
        for key, value in fractions.items():
            if not 0 <= value <= 1:
                raise ValueError(f"strategy.{key} must be in [0, 1], got {value!r}")
        if self.decay_start() >= self.momentum_decay_end:
            raise ValueError(f"strategy.momentum_decay_start ({self.decay_start()}) must be "
                             f"below strategy.momentum_decay_end ({self.momentum_decay_end})")
        if len(self.step_momentum) != len(self.step_momentum_at) + 1:
            raise ValueError(f"strategy.step_momentum needs one value more than "
                             f"strategy.step_momentum_at, got {self.step_momentum} and "
                             f"{self.step_momentum_at}")
        if self.step_momentum_at != sorted(self.step_momentum_at):
            raise ValueError(f"strategy.step_momentum_at must be increasing, "
                             f"got {self.step_momentum_at}")

    def peak_momentum(self) -> float:
        """μ_max, the momentum of the lazy start's fills: momentum_max (cosine), the largest
        step_momentum (step), outer_momentum (constant)."""
        if self.schedule == "cosine":
            return self.momentum_max
        if self.schedule == "step":
            return max(self.step_momentum)
        return self.outer_momentum

    def decay_start(self) -> float:
        if self.momentum_decay_start is None:
            return self.warmup_fraction
        return self.momentum_decay_start


def _cosine(start_value: float, end_value: float, progress: float, start: float,
            end: float) -> float:
    if progress <= start:
        return start_value
    if progress >= end:
        return end_value
    cos = 0.5 * (1 + math.cos(math.pi * (progress - start) / (end - start)))
    return end_value + (start_value - end_value) * cos


def pier_schedule(config: PierConfig, progress: float) -> tuple[float, float]:
    """(outer lr η_t, outer momentum μ_t) at `progress` = step / total steps (in [0, 1])."""
    c = config
    if c.schedule == "constant":
        return c.outer_lr, c.outer_momentum
    peak_at = c.warmup_fraction + c.outer_lr_warmup
    if progress < c.warmup_fraction:  # the lazy start: no outer step is taken
        lr = 0.0
    elif progress < peak_at:
        lr = c.outer_lr_peak * (progress - c.warmup_fraction) / c.outer_lr_warmup
    elif c.schedule == "cosine":
        lr = _cosine(c.outer_lr_peak, c.outer_lr_final, progress, peak_at, 1.0)
    else:
        lr = c.outer_lr_peak if progress < c.step_lr_drop_at else c.outer_lr_final
    if c.schedule == "cosine":
        momentum = _cosine(c.momentum_max, c.momentum_min, progress, c.decay_start(),
                           c.momentum_decay_end)
    else:
        momentum = c.step_momentum[bisect.bisect_right(c.step_momentum_at, progress)]
    return lr, momentum


class Pier(DiLoCo):
    """Pier (Fan & Zhang 2025, arXiv 2511.17849): lazy start, then scheduled DiLoCo.

    **Reconstruction.** The paper's text was not available; the two changes to DiLoCo are
    read from the authors' public Megatron fork, and every knob is a config field:

    1. Lazy start: the first `round(warmup_fraction * steps)` steps are plain DDP over ALL
       ranks (a second torch DDP wrapper over the world; ledger phase "inner"). At every
       round end in this phase the outer momentum is filled without an outer step,
       `Δ = θ_ref − θ; m ← μ_max m + Δ; θ_ref ← θ`, locally (replicas are identical),
       with μ_max = `PierConfig.peak_momentum()` whatever the schedule says at that step
       (a long lazy start, or a decay starting inside it, must not shrink the fill).
       Sharded replicas (`parallel.shard: fsdp`): FSDP averages the gradient shards in
       the replica, then one all-reduce across the replicas (phase "inner") completes the
       all-rank average.
    2. After it, DiLoCo over groups (DDP inside a group only) with the outer step
       `m ← μ_t m + Δ; θ ← θ_ref − η_t (Δ + μ_t m)` and `μ_t`, `η_t` from `pier_schedule`:
       cosine (μ 0.99 → 0.9 over 10%..100%; η linear 0 → 1.1 over the 10% after T_w, then
       cosine to 0.9) or the earlier step variant (μ 0.99/0.95/0.9 at 15%/20%; η warmup,
       1.1 until 80%, then 0.9).

    Round ends sit on the absolute grid of multiples of H (and the last step), as in
    DiLoCo, so a round may straddle T_w: its first steps are DDP, the rest local.
    Identities (tests/test_pier.py): `warmup_fraction = 0` with schedule constant is
    DiLoCo exactly; during the lazy start the parameters equal a DDP run's.
    """

    Config = PierConfig

    # ------------------------------------------------------------- plans, before launch

    @classmethod
    def outer_states(cls, config: PierConfig) -> int:
        return int(config.peak_momentum() > 0)

    @classmethod
    def memory_terms(cls, cfg, facts) -> dict[str, int]:
        """DiLoCo's, + the lazy start's DDP over all ranks (its buckets beside the group's)."""
        terms = super().memory_terms(cfg, facts)
        replicas = cfg.parallel.world_size // cfg.parallel.group_size
        if cfg.strategy.warmup_fraction > 0 and replicas > 1:
            terms["Pier lazy start: all-rank DDP buckets"] = facts.param_bytes
        return terms

    @classmethod
    def traffic(cls, cfg, facts) -> Traffic:
        """DiLoCo's after the lazy start (fragments, overlap or a codec: Streaming
        DiLoCo's, algorithms/outer_traffic.py `streaming_traffic`). During it (its syncs
        fill the momentum locally, send nothing, launch nothing): DDP over all ranks
        (phase "inner"): the world's buckets, or, sharded, the replica's FSDP2
        collectives, one all-reduce of the gradient shards across the replicas, then the
        clipping norm's."""
        config = cfg.strategy
        p = cfg.parallel
        world, g, M = p.world_size, p.group_size, p.num_microbatches
        inner = replica_inner(cfg, facts, config.bucket_cap_mb)
        if world // g == 1:
            warm = inner
        elif p.shard == "fsdp":
            cache: dict[int, list[Transfer]] = {}

            def warm(rank: int) -> list[Transfer]:
                if rank not in cache:
                    group = replica_of(rank, g, world)
                    clip = [Transfer("clip", "all_reduce", (4,), group)] \
                        if cfg.optim.grad_clip > 0 else []
                    cache[rank] = [*fsdp_transfers(facts, g, group, "inner", M),
                                   Transfer("inner", "all_reduce",
                                            (local_shard_bytes(facts, g, rank % g),),
                                            cross_of(rank, g, world)), *clip]
                return cache[rank]
        else:
            buckets = [ddp_buckets(facts, config.bucket_cap_mb, "inner", None, M)]

            def warm(rank: int) -> list[Transfer]:
                return buckets
        lazy = round(config.warmup_fraction * cfg.run.steps)
        if (config.fragments, config.overlap_steps, config.outer_compression) != (1, 0, "none"):
            return streaming_traffic(config, cfg, facts, WIRE_BYTES[config.outer_grad_dtype],
                                     warmup_steps=lazy, warm_inner=warm,
                                     notes=[f"Pier: the first {lazy} steps DDP over all "
                                            "ranks, their syncs local momentum fills"])
        return local_update_traffic(cfg, config.inner_steps, inner,
                                    lambda rank: cls.outer_transfers(cfg, facts, rank),
                                    lazy, warm, outer_notes(cfg))

    # ------------------------------------------------------------- the run

    def __init__(self, config: PierConfig, setup: TrainSetup):
        super().__init__(config, setup)
        self.warmup_steps = round(config.warmup_fraction * setup.total_steps)
        self.group_model, self.group_hook = self.train_model, self.comm_hook
        self.world_model, self.world_hook = self.train_model, self.comm_hook
        if self.warmup_steps > 0 and 1 < self.num_replicas and self.sharded is None:
            self.world_model, self.world_hook = self.register_ddp(
                make_ddp(self.model, self.comm, None, config.bucket_cap_mb))

    def in_warmup(self) -> bool:
        """Whether the last step taken (or, before a step, the next) belongs to T_w."""
        return self.step_index <= self.warmup_steps

    def trained_modules(self) -> list[torch.nn.Module]:
        """The world DDP (until T_w ends) and the group's model: both compiled in `warm_up`,
        so the switch at T_w compiles nothing inside a timed step."""
        modules = super().trained_modules()
        if self.world_model is not self.group_model and self.step_index >= self.warmup_steps:
            modules = [m for m in modules if m is not self.world_model]  # resumed past T_w
        if all(m is not self.group_model for m in modules):
            modules.append(self.group_model)
        return modules

    def train_step(self, batch) -> StepStats:
        if self.step_index < self.warmup_steps:
            self.train_model, self.comm_hook = self.world_model, self.world_hook
        else:
            self.train_model, self.comm_hook = self.group_model, self.group_hook
            if self.world_model is not None and self.world_model is not self.group_model:
                self.release(self.world_model)  # free the world DDP's buckets
            self.world_model = self.world_hook = None
        return super().train_step(batch)

    def after_backward(self) -> float:
        """Sharded lazy start: FSDP averaged the gradient shards inside the replica; one
        all-reduce of them across the replicas makes it the all-rank DDP average."""
        seconds = super().after_backward()
        if (self.sharded is None or self.step_index >= self.warmup_steps
                or self.num_replicas == 1):
            return seconds
        grads = [g for g in self.sharded.local_gradients() if g is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        ledger = self.comm.ledger
        first = len(ledger)
        self.comm.all_reduce(flat, "avg", self.cross_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return seconds + ledger.totals(start=first)[1]

    def outer_hyperparameters(self) -> tuple[float, float]:
        if self.in_warmup():  # a momentum fill: no step (η 0), μ_max (docs/algorithms.md)
            return 0.0, self.config.peak_momentum()
        return pier_schedule(self.config, self.step_index / self.setup.total_steps)

    def exchanges_at(self, step: int) -> bool:
        return step > self.warmup_steps  # a sync in the lazy start fills momentum locally

    def outer_step(self, fragment: int, lr: float, momentum: float) -> RoundStats:
        if self.in_warmup():  # every step of this round was DDP over all ranks
            return self.outer.parts[fragment].accumulate_momentum(momentum)
        return super().outer_step(fragment, lr, momentum)

    def in_sync(self) -> bool:
        return self.in_warmup() or super().in_sync()  # during T_w the DDP weights are θ
