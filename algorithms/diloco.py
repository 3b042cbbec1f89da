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

Streaming DiLoCo (arXiv 2501.18512; `strategy.fragments`, `overlap_steps`, `mix_alpha`)
and compressed outer communication (`strategy.outer_compression`) are options of this
strategy (and so of Pier): the fragments and their schedule are algorithms/streaming.py,
the codecs algorithms/compress.py, the compressed and the launched exchanges
algorithms/comm.py. Defaults (1 fragment, no overlap, α = 0, none) are DiLoCo exactly.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from algorithms.base import DataParallelStrategy, unwrap
from algorithms.compress import QUANTIZERS, bytes_per_element, make_codec
from algorithms.contract import StepStats, StrategyConfig, TrainSetup, require_data_parallel
from algorithms.ddp import clock_for, make_ddp
from algorithms.memory import HOST, fsdp_terms, require_shard_ranks
from algorithms.outer import WIRE_BYTES, WIRE_DTYPES, OuterOptimizer, RoundStats, replica_groups
from algorithms.outer_rules import OuterRule, rule_class, rule_factory
from algorithms.streaming import (
    Fragments,
    StreamingSchedule,
    check_fragments,
    fragment_indices,
)
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
    """Outer rule applied to the global θ with the pseudo-gradient as its gradient
    (algorithms/outer_rules/: sgd, momentum and Nesterov as below; adam). Rules with knobs
    of their own (sparseloco, noloco) are strategies of their own, on this one."""
    outer_beta2: float = 0.999
    """Adam's beta2 for outer_optimizer=adam."""
    outer_grad_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Dtype of the pseudo-gradient on the wire (bf16/fp16 halve the outer bytes)."""
    offload_outer: bool = False
    """Keep the global θ and the outer optimizer state in CPU memory (large models)."""
    bucket_cap_mb: float = 25.0
    """Bucket size in MiB of the intra-group DDP gradient all-reduce (group_size > 1)."""
    fragments: int = 1
    """Streaming DiLoCo (arXiv 2501.18512): P, the fragments the model is cut into (over
    its transformer blocks, by fragment_pattern). One fragment syncs every H/P inner steps,
    round-robin, so each syncs every H steps (gaps of floor(H/P) or ceil(H/P) steps when P
    does not divide H; P <= H) and a sync sends about |θ|/P. 1 = DiLoCo (the whole model
    every H steps)."""
    fragment_pattern: Literal["strided", "sequential"] = "strided"
    """Which blocks form a fragment: strided (block b in fragment b mod P, the paper's) or
    sequential (P contiguous runs of blocks). The embedding goes with block 0's fragment,
    the head and final norm with the last block's."""
    overlap_steps: int = 0
    """τ: a fragment's pseudo-gradient is taken τ steps before its sync point and its
    exchange runs during those τ inner steps (only the wait at the sync point is exposed);
    0 <= τ < inner_steps / fragments; 0 = blocking exchange."""
    mix_alpha: float = 0.0
    """α in [0, 1]: at a sync, θ_i ← (1 − α) θ_global + α θ_i, θ_i the replica's fragment
    then (it has trained τ steps past its pseudo-gradient). 0 = restart from θ_global
    (DiLoCo); the paper's overlapped runs use 0.5."""
    outer_compression: Literal["none", "int8", "fp8", "fp4", "topk"] = "none"
    """How the pseudo-gradient travels: none (outer_grad_dtype), int8, fp8 (e4m3), fp4
    (e2m1) with per-row absmax scales (all-to-all, fp32 reduce, all-gather), or topk
    (topk_fraction of the entries with error feedback, all-gathered)."""
    compression_row: int = 128
    """int8/fp8/fp4: elements of the flat pseudo-gradient sharing one fp32 absmax scale
    (even; the buffer is zero-padded to whole rows per replica)."""
    topk_fraction: float = 0.05
    """topk: fraction of the entries sent per round (values in outer_grad_dtype, int32
    indices); the rest is fed back into the next round (error feedback)."""

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
        if self.fragments < 1:
            raise ValueError(f"strategy.fragments must be >= 1, got {self.fragments!r}")
        check_fragments(self.fragments, self.inner_steps, self.overlap_steps)
        if not 0 <= self.mix_alpha <= 1:
            raise ValueError(f"strategy.mix_alpha must be in [0, 1], got {self.mix_alpha!r}")
        if self.compression_row < 2 or self.compression_row % 2:
            raise ValueError(f"strategy.compression_row must be an even number >= 2, "
                             f"got {self.compression_row!r}")
        if not 0 < self.topk_fraction <= 1:
            raise ValueError(f"strategy.topk_fraction must be in (0, 1], "
                             f"got {self.topk_fraction!r}")
        if self.outer_compression in QUANTIZERS and self.outer_grad_dtype != "fp32":
            raise ValueError(f"strategy.outer_grad_dtype={self.outer_grad_dtype!r} with "
                             f"strategy.outer_compression={self.outer_compression!r}: the "
                             "codec sets the wire format (fp32 in, its own codes out); use "
                             "outer_grad_dtype fp32 (topk sends its values in outer_grad_dtype)")

    def check(self, cfg) -> None:
        # group_size dividing world_size is bench.config.validate's general rule; more
        # fragments than the model has blocks is checked there too (it knows the model)
        require_data_parallel(self, cfg)
        self.rule().check(self, cfg)
        require_shard_ranks(cfg, cfg.parallel.group_size, "parallel.group_size")
        device = cfg.parallel.device
        if self.overlap_steps > 0 and (device == "cuda" or (device == "auto"
                                                            and torch.cuda.is_available())):
            raise ValueError(
                f"strategy.overlap_steps={self.overlap_steps} on CUDA (parallel.device "
                f"{device!r}): not supported yet. The loop and the clocks synchronise the "
                "whole device every step, which would wait for the exchange on its side "
                "stream and count it as compute; use overlap_steps 0 on GPUs, or "
                "parallel.device cpu")

    def codec(self):
        """The codec of outer_compression (algorithms/compress.py; None for none)."""
        return make_codec(self.outer_compression, self.compression_row, self.topk_fraction,
                          WIRE_DTYPES[self.outer_grad_dtype])

    def outer_bytes_per_element(self) -> float:
        """Payload bytes one element of the pseudo-gradient costs in an outer exchange
        (before the collective's own factor): the wire dtype, or the codec's."""
        return bytes_per_element(self.outer_compression, self.compression_row,
                                 self.topk_fraction, WIRE_BYTES[self.outer_grad_dtype])

    def rule(self) -> type[OuterRule]:
        """The outer rule's class (algorithms/outer_rules/ `RULES[outer_optimizer]`)."""
        return rule_class(self.outer_optimizer)

    def outer_rule(self):
        """global θ -> the outer rule on it, built from this config: the hook through which
        DiLoCo, Pier and Streaming DiLoCo (one rule per fragment) take their rule."""
        return rule_factory(self.outer_optimizer, self)


class DiLoCo(DataParallelStrategy):
    """DiLoCo (Douillard et al. 2023, arXiv 2311.08105), with hierarchical replica groups,
    and Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) as its options.

    Every replica starts a round from the global θ, runs H inner optimizer steps on its
    own shard (inner optimizer state is per replica, never synchronised, never reset), then
    `Δ = mean_i(θ − θ_i)` is all-reduced once and `θ ← OuterOpt(θ, Δ)`; the replica
    restarts from the new θ. The evaluated model is the global θ. Nothing is reconstructed:
    this is the paper's algorithm; the hierarchical groups (DDP inside a replica) are the
    paper's "replica" made of several ranks. Our one choice: when the run's steps are not
    a multiple of H, a last, shorter round closes at the final step (no inner work is lost).

    Streaming (docs/algorithms.md): the same round per fragment, one fragment every H/P
    steps, each with its own outer optimizer state; with overlap τ the fragment's Δ is
    taken and its exchange launched τ steps before its sync point; at the sync point:
    wait, outer step from the backup (the fragment's global θ, untouched meanwhile), which
    becomes the new θ, then the merge θ_i ← (1 − α) θ + α θ_i. The inner optimizer's
    state is untouched. At the last step every fragment syncs (blocking, after the one in
    flight). Our choices: the fragment pattern's treatment of embedding and head
    (algorithms/streaming.py), the final round, round-robin from fragment 0.

    Identities (tests/test_diloco.py, tests/test_streaming.py): outer lr 1, momentum 0 ==
    Local SGD (parameter averaging every H steps); H = 1, outer lr 1, momentum 0, inner SGD
    == DDP with SGD; fragments 1, overlap 0 (any α = 0) == DiLoCo bit for bit.
    """

    Config = DiLoCoConfig

    # ------------------------------------------------------------- plans, before launch

    @classmethod
    def outer_states(cls, config: DiLoCoConfig) -> int:
        """|θ|-sized tensors of outer rule state per parameter (SGD's momentum, Adam's
        two, SparseLoCo's error feedback, ...: the rule's `states`)."""
        return config.rule().states(config)

    @classmethod
    def memory_terms(cls, cfg, facts) -> dict[str, int]:
        """+ the global θ and its outer state (on the CPU with offload_outer), the round's
        pseudo-gradient in the wire dtype (and its fp32 copy as θ's gradient when the two
        differ), the evaluation copy of θ, and intra-group DDP buckets. Sharded (FSDP2 in
        each replica): the replica's shards and FSDP's gathered units, θ and its outer
        state per shard (|θ| / group_size), θ swapped in for evaluation instead of a copy."""
        config = cfg.strategy
        sharded = cfg.parallel.shard == "fsdp"
        if sharded:
            facts = facts.sharded(cfg.parallel.group_size)
        terms = facts.base_terms()
        if sharded:
            terms.update(fsdp_terms(facts))
        theta = facts.param_bytes // facts.shard  # each rank steps its own shard of θ
        host = HOST if config.offload_outer else ""
        terms[f"{host}outer: global θ"] = theta
        terms[f"{host}outer: optimizer state"] = cls.outer_states(config) * theta
        wire = WIRE_BYTES[config.outer_grad_dtype]
        terms["outer: pseudo-gradient buffer"] = theta * wire // 4
        if wire != 4 or config.offload_outer:
            terms[f"{host}outer: θ's gradient (fp32 copy)"] = theta
        terms["evaluation: the replica's shard kept while θ is swapped in" if sharded
              else "evaluation copy of θ"] = theta
        if cfg.parallel.group_size > 1 and not sharded:
            terms["DDP gradient buckets (inside the replica)"] = facts.param_bytes
        terms.update(cls.streaming_terms(config, facts, theta))
        return terms

    @classmethod
    def streaming_terms(cls, config: DiLoCoConfig, facts, theta: int) -> dict[str, int]:
        """Compression and overlap: the codec's buffers (a fragment's coded Δ sent and
        received, its fp32 decode, the top-k error feedback of all of θ); an exchange in
        flight (its Δ and result, the largest fragment's)."""
        terms: dict[str, int] = {}
        blocks = max(1, (facts.param_bytes - facts.root_param_bytes)
                     // max(1, facts.unit_param_bytes))
        largest = min(theta, (facts.root_param_bytes + -(-blocks // config.fragments)
                              * facts.unit_param_bytes) // facts.shard)
        if config.outer_compression != "none":
            coded = int(largest // 4 * config.outer_bytes_per_element())
            terms["outer: coded pseudo-gradient (sent, received)"] = 2 * coded
            terms["outer: fp32 pseudo-gradient being coded"] = largest
        if config.outer_compression == "topk":
            terms["outer: top-k error feedback"] = theta
        if config.overlap_steps > 0:
            terms["outer: exchange in flight (Δ and its result)"] = 2 * largest
        return terms

    @classmethod
    def require_plain_outer(cls, config: DiLoCoConfig) -> None:
        """The traffic description covers DiLoCo's whole-model, uncompressed outer round
        only: Streaming DiLoCo's fragments, overlap and compressed exchanges are refused
        rather than priced as that round (which would over-state their bytes)."""
        streaming = {"fragments": (config.fragments, 1),
                     "overlap_steps": (config.overlap_steps, 0),
                     "outer_compression": (config.outer_compression, "none")}
        for key, (value, plain) in streaming.items():
            if value != plain:
                raise ValueError(f"strategy.{key}={value!r} has no traffic description yet "
                                 f"({cls.__name__}.traffic): commbench whatif cannot price "
                                 f"it; {key}={plain!r} can be")

    @classmethod
    def traffic(cls, cfg, facts) -> Traffic:
        """Every step the replica's inner traffic (phase "inner"); a round's last step
        adds `outer_transfers` (algorithms/traffic.py). Fragments, overlap or a codec:
        algorithms/outer_traffic.py `streaming_traffic` (the default exchange's; a
        subclass with an exchange of its own, `outer_transfers`, is refused them)."""
        config = cfg.strategy
        streams = (config.fragments, config.overlap_steps,
                   config.outer_compression) != (1, 0, "none")
        if streams and cls.outer_transfers.__func__ is DiLoCo.outer_transfers.__func__:
            from algorithms.outer_traffic import streaming_traffic

            return streaming_traffic(config, cfg, facts, WIRE_BYTES[config.outer_grad_dtype])
        cls.require_plain_outer(config)
        return local_update_traffic(cfg, config.inner_steps,
                                    replica_inner(cfg, facts, config.bucket_cap_mb),
                                    lambda rank: cls.outer_transfers(cfg, facts, rank),
                                    notes=outer_notes(cfg))

    @classmethod
    def outer_transfers(cls, cfg, facts, rank: int) -> list[Transfer]:
        """What `rank` sends when a round closes: one all-reduce of its θ in the wire dtype
        (the one place an outer step says what it sends, e.g. fragments, compression)."""
        return outer_all_reduce(cfg, facts, rank, WIRE_BYTES[cfg.strategy.outer_grad_dtype])

    # ------------------------------------------------------------- the run

    def __init__(self, config: DiLoCoConfig, setup: TrainSetup):
        super().__init__(config, setup)
        if setup.group_size > 1 and self.sharded is None:
            self.train_model, self.comm_hook = self.register_ddp(
                make_ddp(self.model, self.comm, self.group, config.bucket_cap_mb))
        # sharded: each rank's outer step works on its shards, |θ| / group_size
        params = list(self.model.parameters() if self.sharded is None
                      else self.sharded.local_parameters())
        indices = fragment_indices(self.model, config.fragments, config.fragment_pattern)
        codec = config.codec()
        rule = config.outer_rule()
        self.outer = Fragments([OuterOptimizer(
            [params[i] for i in part], self.comm, self.cross_group, self.num_replicas,
            wire_dtype=config.outer_grad_dtype, offload=config.offload_outer, codec=codec,
            rule=rule,
        ) for part in indices], indices)
        self.schedule = StreamingSchedule(config.fragments, config.inner_steps,
                                          config.overlap_steps, setup.total_steps)
        self.clock = clock_for(self.comm.device)
        self.round = 0
        """Fragment syncs so far (outer rounds, one model's worth every P of them)."""
        self._eval_copy: nn.Module | None = None

    def replica_group(self):
        self.group, self.cross_group, self.num_replicas = replica_groups(
            self.comm, self.setup.group_size)
        self.launch_group = None
        """The cross group again, for launched exchanges only (a thread of their own issues
        them: no other op may share their group)."""
        if self.config.overlap_steps > 0 and self.num_replicas > 1:
            g, world = self.setup.group_size, self.comm.world_size
            self.launch_group = self.comm.split([range(p, world, g) for p in range(g)])
        return self.group

    # ------------------------------------------------------------- inner steps

    def train_step(self, batch) -> StepStats:
        with self.comm.phase("inner"):
            return super().train_step(batch)

    def warm_up(self, batch) -> None:
        """DDP's (base class), then every fragment's outer exchange once at full size,
        unrecorded, on each group it will run on (the cross group; with overlap the launch
        group too): NCCL connects a collective lazily, at its first call of a kind and
        size, which would otherwise land in the first timed outer step."""
        super().warm_up(batch)
        self.outer.warm_up(self.cross_group)
        if self.launch_group is not None:
            self.outer.warm_up(self.launch_group)

    # ------------------------------------------------------------- outer rounds

    def in_sync(self) -> bool:
        """Whether the replica's weights equal the global θ (before the first step, and
        right after every fragment synced with α = 0)."""
        return self.config.mix_alpha == 0 and self.schedule.all_synced(self.step_index)

    def outer_hyperparameters(self) -> tuple[float, float]:
        """(outer lr, outer momentum) for the syncs at the current step."""
        return self.config.outer_lr, self.config.outer_momentum

    def exchanges_at(self, step: int) -> bool:
        """Whether a sync at `step` exchanges pseudo-gradients (Pier: not in its lazy start,
        where the momentum fill is local), i.e. whether overlap launches one before it."""
        return True

    def outer_step(self, fragment: int, lr: float, momentum: float) -> RoundStats:
        """One blocking sync of `fragment`: exchange, outer step, merge."""
        return self.outer.parts[fragment].step(lr, momentum, self.config.mix_alpha)

    def after_inner_step(self) -> tuple[float, dict[str, float]]:
        step, alpha = self.step_index, self.config.mix_alpha
        launch = self.schedule.launch(step)
        if launch is not None and self.exchanges_at(step + self.config.overlap_steps):
            with self.comm.phase("outer"):  # Δ now, its exchange during the next τ steps
                self.outer.in_flight = launch, self.outer.parts[launch].exchange(
                    self.launch_group, launch=True)
        syncs = self.schedule.syncs(step)
        if not syncs:
            return 0.0, {}
        lr, momentum = self.outer_hyperparameters()
        done: list[tuple[int, RoundStats]] = []
        finished = None
        if self.outer.in_flight is not None and self.outer.in_flight[0] in syncs:
            fragment, pending = self.outer.in_flight  # first: its link is then free
            self.outer.in_flight = None
            delta = pending.wait()
            after = self.clock.work()
            norm = self.outer.parts[fragment].finish(delta, lr, momentum, alpha)
            done.append((fragment, RoundStats(norm, pending.nbytes, pending.exposed_s)))
            finished = pending, after
        waited = done[0][0] if done else None
        for fragment in syncs:
            if fragment != waited:
                done.append((fragment, self.outer_step(fragment, lr, momentum)))
        if finished is not None:  # recorded now: the work after its wait is known
            pending, after = finished
            end = self.clock.work()
            self.clock.synchronize()
            # the other fragments' blocking exchanges, where waits cost work (CUDA's clock)
            blocking_s = (sum(stats.seconds for _, stats in done[1:])
                          if self.clock.waits_cost_work else 0.0)
            with self.comm.phase("outer"):
                pending.record(tail_s=max(0.0, self.clock.seconds(after, end) - blocking_s))
        self.round += len(done)
        seconds = sum(stats.seconds for _, stats in done)
        fragment, last = done[-1]
        return seconds, {
            "outer_round": self.round, "outer_fragment": fragment, "outer_lr": lr,
            "outer_momentum": momentum, "pseudo_grad_norm": last.pseudo_grad_norm,
            "outer_bytes": sum(stats.nbytes for _, stats in done), "outer_s": seconds,
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
        evaluated = self.evaluated_global()
        with torch.no_grad():
            for p, g in zip(self.outer.params, evaluated, strict=True):
                p.copy_(g)
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
        evaluated = self.evaluated_global()
        with torch.no_grad():
            for p, g in zip(self._eval_copy.parameters(), evaluated, strict=True):
                p.copy_(g)
        return self._eval_copy

    def evaluated_global(self) -> list[torch.Tensor]:
        """The weights evaluated when the replica is not θ, in the model's parameter order:
        the global θ (NoLoCo: the replicas' mean of their own)."""
        return self.outer.global_params

    def state_dict(self) -> dict:
        return {**super().state_dict(), "outer": self.outer.state_dict(),
                "round": self.round}

    def state_scopes(self) -> dict[str, str]:
        """Which ranks hold each `state_dict` key bit-identically (checkpoints write it once
        per scope, bench/run/dcp_state.py). The inner model and optimizer differ between
        replicas: a replica's ranks share them unsharded ("replica@R", R its first rank),
        under FSDP each rank holds its own shards. The outer state (global θ, outer
        momentum) is every replica's: the whole on every rank ("world"), under FSDP the
        J-th shard on each replica's J-th rank ("shard@J"). Named for plain DiLoCo only (one
        fragment, no overlap, no codec, outer sgd or adam); any other state, and any
        subclass's, is each rank's own (always correct, only not deduplicated)."""
        g, rank = self.setup.group_size, self.comm.rank  # replicas: ranks [r g, (r + 1) g)
        scopes = {"round": "world"}
        if self.sharded is None:
            first = rank - rank % g
            scopes.update(model=f"replica@{first}", optimizer=f"replica@{first}")
        plain = (type(self) is DiLoCo and self.config.fragments == 1
                 and self.config.overlap_steps == 0 and self.config.codec() is None
                 and self.config.outer_optimizer in ("sgd", "adam"))
        if plain:
            scopes["outer"] = ("world" if self.sharded is None
                               else f"shard@{rank % g}")
        return scopes

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.outer.load_state_dict(state["outer"], self.comm, self.launch_group)
        self.round = state["round"]
