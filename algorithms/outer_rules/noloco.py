"""NoLoCo: DiLoCo without the all-reduce: each replica averages with one random peer, and
its outer momentum is pulled toward the pair's mean.

    pytest tests/test_outer_rules.py -k noloco

Kolehmainen, Blagoev, Donaghy, Ersoy, Nies 2025, "NoLoCo: No-all-reduce Low Communication
Training Method for Large Models", arXiv 2506.10911. The math, its identity and our
choices: docs/algorithms.md ("NoLoCo"). Every replica i keeps its own slow weights φ_i
(the `OuterOptimizer`'s global θ, no longer the same on every replica). Per round:

    peer j of i: a random matching of the replicas, from (seed, round) on every rank
    exchange (Δ_i, φ_i) with j                  point to point, phase "outer"
    g_i = (Δ_i + Δ_j)/2 + (γ/η)(φ_i − (φ_i + φ_j)/2)
    m_i ← μ m_i + g_i;  φ_i ← φ_i − η m_i      torch SGD (nesterov: false, the authors')

which is the authors' `v ← μ v − η mean(Δ) − γ (φ_i − mean(φ))`, `φ ← φ + v` with v = −η m.
The evaluated model is the replicas' mean of φ (an all-reduce, phase "eval").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from algorithms.diloco import DiLoCo, DiLoCoConfig
from algorithms.gasloc import round_peers
from algorithms.outer_rules import Sends
from algorithms.outer_rules.sgd import SGDRule
from algorithms.outer_traffic import Exchange, streaming_traffic
from algorithms.traffic import (
    Traffic,
    Transfer,
    local_update_traffic,
    outer_notes,
    replica_inner,
    round_ends,
)


class NoLoCoRule(SGDRule):
    """SGD on φ_i with the pair's mean Δ and the pull toward the pair's mean φ (module
    docstring). A replica left without a peer (odd count) steps on its own Δ_i.

    Not on shards (yet): the evaluated mean and the consensus metric would need the
    replica's shards gathered, and there is no sharded == unsharded test of it."""

    shards = False

    def __init__(self, params, lr: float = 0.7, momentum: float = 0.5, nesterov: bool = False,
                 pull: float | None = None, seed: int = 0):
        super().__init__(params, lr, momentum, nesterov)
        self.pull_ratio = 1.0 if pull is None else pull / lr
        """γ / η: the pull's weight in g_i (the outer lr is constant in NoLoCo)."""
        self.seed = seed
        self.rounds = 0
        """Rounds exchanged so far: round t's pairs come from (seed, t)."""

    @classmethod
    def from_config(cls, params, config) -> NoLoCoRule:
        return cls(params, lr=config.outer_lr, momentum=config.outer_momentum,
                   nesterov=config.nesterov, pull=config.pull, seed=config.seed)

    @classmethod
    def states(cls, config) -> int:
        return int(config.outer_momentum > 0)

    @classmethod
    def sends(cls, config) -> Sends:
        return Sends("exchange", 8.0, peers="pair")  # Δ_i and φ_i in fp32, to one peer

    @classmethod
    def check(cls, config, cfg) -> None:
        super().check(config, cfg)
        refused = {"overlap_steps": (config.overlap_steps, 0),
                   "outer_compression": (config.outer_compression, "none"),
                   "outer_grad_dtype": (config.outer_grad_dtype, "fp32")}
        for key, (value, plain) in refused.items():
            if value != plain:
                raise ValueError(f"strategy.{key}={value!r} with noloco: its exchange is "
                                 f"point to point, blocking, of Δ and φ in fp32; use {key} "
                                 f"{plain!r}")

    def peer(self, replica: int, num_replicas: int) -> int | None:
        """This round's peer of `replica` (None: it sits out, an odd count)."""
        peers = round_peers("random-matching", num_replicas, self.seed, self.rounds)[replica]
        return peers[0] if peers else None

    @torch.no_grad()
    def exchange(self, outer, group, launch):
        assert not launch, "noloco's exchange is blocking (check refuses overlap_steps)"
        ranks = outer.comm.group_ranks(group)
        peer = self.peer(ranks.index(outer.comm.rank), len(ranks))
        self.rounds += 1
        delta = outer.pseudo_gradient(torch.float32)
        if peer is None:
            return delta
        mine = torch.cat([delta, torch.cat([g.reshape(-1) for g in self.params]).to(delta)])
        theirs = torch.empty_like(mine)
        outer.comm.exchange({ranks[peer]: mine}, {ranks[peer]: theirs})
        first, second = (mine, theirs) if outer.comm.rank < ranks[peer] else (theirs, mine)
        mean = (first + second) / 2  # the same bits on both ends of the pair
        n = delta.numel()
        # φ_i − mean(φ): exactly 0 when the pair's φ agree (2 replicas: DiLoCo, bit for bit)
        return mean[:n] + self.pull_ratio * (mine[n:] - mean[n:])

    def warm_up(self, outer, group) -> None:
        """Nothing: the pairs change every round; each connects at its first exchange."""

    def state_dict(self) -> dict:
        return {"optimizer": super().state_dict(), "rounds": self.rounds}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state["optimizer"])
        self.rounds = state["rounds"]


@dataclass
class NoLoCoConfig(DiLoCoConfig):
    name: str = "noloco"
    """NoLoCo (arXiv 2506.10911): DiLoCo with pairwise averaging of random peers instead of
    the all-reduce, and a pull of the outer momentum toward the pair's mean."""
    outer_optimizer: Literal["noloco"] = "noloco"
    """The outer rule (algorithms/outer_rules/noloco.py)."""
    inner_steps: int = 50
    """H (the authors' 100M C4 configs: 50)."""
    outer_lr: float = 0.7
    """η (the authors' configs: 0.7)."""
    outer_momentum: float = 0.5
    """μ (the authors' configs: 0.5)."""
    nesterov: bool = False
    """The authors' code steps φ ← φ + v with v ← μ v − η g (heavy ball): nesterov false.
    true: torch's Nesterov form, as DiLoCo's default."""
    pull: float | None = None
    """γ, the pull of the momentum toward the pair's mean of φ; null = outer_lr (the
    authors' code uses η for both)."""
    seed: int = 0
    """Seed of the random pairs; round t's matching derives from (seed, t) on every rank."""

    def __post_init__(self):
        super().__post_init__()
        if self.pull is not None and self.pull < 0:
            raise ValueError(f"strategy.pull must be >= 0 or null, got {self.pull!r}")


class NoLoCo(DiLoCo):
    """NoLoCo (Kolehmainen et al. 2025, arXiv 2506.10911): DiLoCo with the noloco outer
    rule (`NoLoCoRule`; docs/algorithms.md). **Reconstruction** of the outer step from the
    paper's description and the authors' public code (groups of 2, H 50, η 0.7, μ 0.5,
    γ = η); **our choices**: the matching (algorithms/gasloc.py `round_peers`, one replica
    sits out when their count is odd), fp32 on the wire, the evaluated model (the replicas'
    mean of φ). The paper's random routing of activations between pipeline stages is not
    built (data parallel only).

    Identity (tests/test_outer_rules.py): 2 replicas (the peer is everyone) is DiLoCo with
    the same outer SGD step, bit for bit.
    """

    Config = NoLoCoConfig

    @classmethod
    def memory_terms(cls, cfg, facts) -> dict[str, int]:
        """DiLoCo's, + a round's buffers: (Δ_i, φ_i) sent and the peer's received (2 θ
        each), their mean (2 θ) and g_i (θ); the evaluated mean of φ (θ)."""
        terms = super().memory_terms(cfg, facts)
        theta = facts.param_bytes
        terms["noloco: (Δ, φ) sent, received and their mean; g"] = 7 * theta
        terms["noloco: the replicas' mean of φ (evaluation)"] = theta
        return terms

    @classmethod
    def traffic(cls, cfg, facts) -> Traffic:
        """Every step the replica's inner traffic (phase "inner"); a round's last step adds
        one exchange (phase "outer") of Δ_i and φ_i in fp32 (2 |θ|) with the round's peer
        (`pair_exchange`). With fragments: Streaming DiLoCo's schedule
        (algorithms/outer_traffic.py), each sync that exchange of the fragment's (Δ, φ),
        paired by the fragment's own round count."""
        config = cfg.strategy
        if config.fragments > 1:  # overlap and codecs: refused (NoLoCoRule.check)
            return streaming_traffic(config, cfg, facts, 4, exchange=cls.pair_exchange(cfg),
                                     notes=["noloco: each fragment's (Δ, φ) exchanged with "
                                            "its round's peer; a fragment's k-th sync "
                                            "pairs as round k"])
        cls.require_plain_outer(config)
        p = cfg.parallel
        g, world, steps, H = p.group_size, p.world_size, cfg.run.steps, config.inner_steps
        inner, exchange = replica_inner(cfg, facts, config.bucket_cap_mb), cls.pair_exchange(cfg)

        def transfers(rank: int, step: int) -> list[Transfer]:
            out = inner(rank)
            if world == g or not round_ends(step, H, steps):
                return out
            return [*out, *exchange(rank, 0, step // H, facts.param_bytes // 4, 0)]

        plain = local_update_traffic(cfg, H, inner, lambda rank: [], notes=outer_notes(cfg))
        return Traffic(steps, transfers, period=plain.period, phases=plain.phases,
                       notes=plain.notes)

    @classmethod
    def pair_exchange(cls, cfg) -> Exchange:
        """A round's exchange of (Δ_i, φ_i) in fp32 (2 x 4 bytes per element) with the
        peer of `rank`'s replica in that round's matching (`round_peers`, seeded as the
        run is; each fragment's rule counts its own rounds): the rank holding the same
        position in the paired replica; nothing when the replica sits out."""
        config, p = cfg.strategy, cfg.parallel
        g, replicas = p.group_size, p.world_size // p.group_size

        def exchange(rank: int, fragment: int, round_: int, numel: int, overlap: int):
            peers = round_peers("random-matching", replicas, config.seed, round_)[rank // g]
            if not peers:
                return []
            nbytes = 8 * numel
            return [Transfer("outer", "exchange", (nbytes,), peers=(peers[0] * g + rank % g,),
                             peer_nbytes=(nbytes,))]
        return exchange

    def in_sync(self) -> bool:
        return False  # each replica its own φ: the evaluated model is their mean

    def evaluated_global(self) -> list[torch.Tensor]:
        """The replicas' mean of φ (an all-reduce over the cross group, phase: the
        caller's, "eval" in the loop), in the model's parameter order."""
        flat = torch.cat([g.reshape(-1) for g in self.outer.global_params])
        if self.num_replicas > 1:
            self.comm.all_reduce(flat, "avg", self.cross_group)
        out, offset = [], 0
        for g in self.outer.global_params:
            out.append(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return out

    def metrics(self) -> dict[str, float]:
        """+ `consensus`: mean over replicas of ‖φ_i − φ̄‖ / ‖φ̄‖ (as GASLoC's; phase
        "metrics" in the loop)."""
        phi = torch.cat([g.reshape(-1) for g in self.outer.global_params])
        mean = self.evaluated_global()
        mean = torch.cat([g.reshape(-1) for g in mean])
        distance = ((phi - mean).norm() / mean.norm().clamp_min(1e-30)).reshape(1).double()
        if self.num_replicas > 1:
            self.comm.all_reduce(distance, "avg", self.cross_group)
        return {**super().metrics(), "consensus": distance.item()}
