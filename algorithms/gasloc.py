"""GASLoC (decentralized gossip with local steps and outer momentum) and plain gossip.

Run it with `commbench run configs/gasloc-tiny.yaml`, over heterogeneous links with
`commbench run configs/gasloc-hetero-tiny.yaml`; tests: `pytest tests/test_gasloc.py`.
The math (a reconstruction) is docs/algorithms.md's GASLoC section.

No all-reduce during training: every worker (one per rank) holds its own parameters
and, once per round, exchanges them with the round's peers only (batched isend/irecv,
`Communicator.exchange`, phase "gossip"), so a slow link slows only its two endpoints.

Rounds. All workers share one schedule: a round is `H = max_i H_i` loop steps and every
worker gossips after the round's last step (as in DiLoCo, a last, shorter round closes
at the run's final step). Worker i trains on the first `H_i` of its `H` batches of the
round and skips the rest (an idle step: no compute, no tokens, its last loss is
reported again). Every worker thus reads the same shard positions as under
DDP or DiLoCo; a worker with fewer inner steps (a slower machine) consumes fewer of them.

Communication graph of round t. Peers come from `round_peers(topology, n, seed, t)`,
which every rank evaluates identically (the seed is shared, no coordinator):
- `complete`: everyone (p2p with all n-1 peers; equals an all-reduce mean, at n-1 times
  an all-reduce's per-rank bytes);
- `ring`: ranks i-1 and i+1, every round;
- `random-matching` (default): a random perfect matching, one peer each (with n odd one
  worker sits the round out);
- `random-2peer`: a random ring (a random permutation closed into a cycle), two peers.

Mixing matrix. `W = I - alpha * L` with `L = I - M`, M the Metropolis-Hastings weights of
the round's graph: `M_ij = 1 / (1 + max(d_i, d_j))` for peers i, j (d = degree),
`M_ii = 1 - sum_j M_ij`. So `W_ij = alpha M_ij`, `W_ii = 1 - alpha sum_j M_ij`: symmetric
and doubly stochastic, hence the workers' mean is preserved. At alpha = 1 a matched pair
averages with weight 1/2, the complete graph takes the uniform mean (weights 1/n), a
ring weighs self and both neighbours 1/3. alpha = 0 is no mixing (and no traffic): n
independent runs, the control that shows what communication buys. alpha must be in
[0, 1]: above 1 the diagonal may turn negative (over-relaxation, not a mean).
"""

from __future__ import annotations

import copy
import functools
import math
import random
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from algorithms.base import DataParallelStrategy, unwrap
from algorithms.comm import Communicator
from algorithms.contract import StepStats, StrategyConfig, TrainSetup, require_data_parallel
from algorithms.traffic import Traffic, Transfer, round_ends

TOPOLOGIES = ("complete", "ring", "random-matching", "random-2peer")
MIN_WORKERS = {"complete": 1, "ring": 2, "random-matching": 2, "random-2peer": 3}
"""Fewest workers a topology needs: its peers per worker plus one."""


@dataclass
class GossipConfig(StrategyConfig):
    name: str = "gossip"
    """Decentralized parameter averaging with local steps (D-PSGD style, no outer step)."""
    inner_steps: int | list[int] = 500
    """Inner steps per round H_i (default as DiLoCo's; short runs use 10..100): one value
    for every worker, or a list of one per worker; a round is max(H_i) steps."""
    topology: Literal["complete", "ring", "random-matching", "random-2peer"] = "random-matching"
    """Communication graph of each round: complete, ring, random-matching or random-2peer."""
    mixing: float = 1.0
    """Mixing weight alpha in W = I - alpha (I - M), M the Metropolis-Hastings weights:
    1 = plain neighbour averaging (1/2 per matched pair), 0 = no mixing. In [0, 1]."""
    seed: int = 0
    """Seed of the random graphs; round t's graph derives from (seed, t) on every rank."""

    def __post_init__(self):
        steps = self.inner_steps if isinstance(self.inner_steps, list) else [self.inner_steps]
        if not steps or any(h < 1 for h in steps):
            raise ValueError(
                f"strategy.inner_steps must be an integer >= 1 or a non-empty list of them, "
                f"got {self.inner_steps!r}"
            )
        if not 0 <= self.mixing <= 1:
            raise ValueError(f"strategy.mixing must be in [0, 1], got {self.mixing!r}")

    def check(self, cfg) -> None:
        require_data_parallel(self, cfg)
        if cfg.parallel.shard != "none":
            raise ValueError(f"parallel.shard={cfg.parallel.shard!r} is not supported for "
                             f"strategy {self.name!r}: its workers are one rank each "
                             "(parallel.group_size 1), so there is no replica to shard; a "
                             "sharded worker (gossip of each rank's shard across workers) is "
                             "not implemented: use parallel.shard=none")
        world_size, group_size = cfg.parallel.world_size, cfg.parallel.group_size
        if group_size != 1:
            raise ValueError(
                f"strategy.name={self.name!r} runs one worker per rank: parallel.group_size "
                f"must be 1, got {group_size}"
            )
        if isinstance(self.inner_steps, list) and len(self.inner_steps) != world_size:
            raise ValueError(
                f"strategy.inner_steps has {len(self.inner_steps)} values but there are "
                f"{world_size} workers (parallel.world_size); give one integer or one value "
                f"per worker"
            )
        if world_size < MIN_WORKERS[self.topology]:
            peers = MIN_WORKERS[self.topology] - 1
            raise ValueError(
                f"strategy.topology={self.topology!r} gives each worker {peers} peer(s) but "
                f"parallel.world_size={world_size} leaves {world_size - 1} other worker(s); "
                f"valid: {[t for t in TOPOLOGIES if MIN_WORKERS[t] <= world_size]}"
            )


@dataclass
class GASLoCConfig(GossipConfig):
    name: str = "gasloc"
    """GASLoC: gossip of momentum-extrapolated outer steps on local progress."""
    outer_lr: float = 0.7
    """Outer learning rate eta (y_i = theta_i + eta g_i)."""
    outer_momentum: float = 0.9
    """Outer momentum gamma (z_i = y_i + gamma (y_i - y_i_prev)), in [0, 1)."""

    def __post_init__(self):
        super().__post_init__()
        if self.outer_lr <= 0:
            raise ValueError(f"strategy.outer_lr must be > 0, got {self.outer_lr!r}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(
                f"strategy.outer_momentum must be in [0, 1), got {self.outer_momentum!r}"
            )


def round_peers(topology: str, num_workers: int, seed: int, round_index: int) -> list[list[int]]:
    """Each worker's sorted peers in round `round_index` (a symmetric graph, no self loops)."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {list(TOPOLOGIES)}, got {topology!r}")
    n = num_workers
    if topology == "complete":
        return [[j for j in range(n) if j != i] for i in range(n)]
    order = list(range(n))
    if topology != "ring":
        random.Random(f"{seed}:{round_index}").shuffle(order)  # str seeds hash stably
    if topology == "random-matching":
        edges = list(zip(order[0::2], order[1::2], strict=False))
    else:  # ring or random ring
        edges = [(order[k], order[(k + 1) % n]) for k in range(n)] if n > 1 else []
    peers: list[set[int]] = [set() for _ in range(n)]
    for a, b in edges:
        if a != b:
            peers[a].add(b)
            peers[b].add(a)
    return [sorted(p) for p in peers]


def mixing_weights(peers: list[list[int]], worker: int, alpha: float) -> dict[int, float]:
    """Row `worker` of W = I - alpha (I - M), M Metropolis-Hastings: {j: W_ij} incl. self."""
    if alpha == 0:
        return {worker: 1.0}
    row = {j: alpha / (1 + max(len(peers[worker]), len(peers[j]))) for j in peers[worker]}
    row[worker] = 1.0 - sum(row.values())
    return row


def gossip_mix(comm: Communicator, point: torch.Tensor, weights: dict[int, float]) -> torch.Tensor:
    """sum_j W_ij z_j: exchange `point` (z_i) with the peers in `weights`, return the mix.

    The terms are summed in rank order, so workers with the same row (a matched pair,
    the complete graph) hold bit-identical results.
    """
    peers = [j for j in weights if j != comm.rank]
    received = {j: torch.empty_like(point) for j in peers}
    comm.exchange({j: point for j in peers}, received)
    received[comm.rank] = point
    mixed = torch.zeros_like(point)
    for j in sorted(weights):
        mixed.add_(received[j], alpha=weights[j])
    return mixed


def _flatten(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


@torch.no_grad()
def _assign(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    for p, chunk in zip(params, flat.split([p.numel() for p in params]), strict=True):
        p.copy_(chunk.view_as(p))


class Gossip(DataParallelStrategy):
    """Gossip averaging with local steps: after H_i inner steps, theta_i <- sum_j W_ij theta_j'.

    The baseline for GASLoC (the same rounds, topologies and mixing, no outer step): with
    the complete graph and alpha = 1 it is Local SGD (parameter averaging every H steps).
    The evaluated model is the workers' average (an all-reduce at evaluation time, phase
    "eval"); worker 0's own weights are validated too (`val_loss_worker0`); the consensus
    distance mean_i ||theta_i - mean|| / ||mean|| is logged as `consensus` (phase
    "metrics", when a metrics row is written). None of this is training traffic.
    """

    Config = GossipConfig

    # ------------------------------------------------------------- plans, before launch

    ROUND_BUFFERS = 2
    """Flat |θ| buffers of a round besides the received ones: the point sent and the mix."""

    @classmethod
    def memory_terms(cls, cfg, facts) -> dict[str, int]:
        """+ the anchor θ_i, the two evaluation copies (average, worker 0), and a round's
        flat buffers: the point, one per peer received, the mix (GASLoC: y, z, y_prev)."""
        terms = facts.base_terms()
        theta = facts.param_bytes
        n = cfg.parallel.world_size
        peers = {"complete": n - 1, "ring": min(2, n - 1), "random-matching": 1,
                 "random-2peer": 2}[cfg.strategy.topology]
        terms["gossip: anchor θ_i"] = theta
        terms["evaluation copies (average, worker 0)"] = 2 * theta
        terms["gossip: round buffers"] = (cls.ROUND_BUFFERS + peers) * theta
        return terms

    @classmethod
    def traffic(cls, cfg, facts) -> Traffic:
        """One exchange per round (phase "gossip"): |θ| to each of the round's peers
        (`round_peers`, seeded as the run is); none with mixing 0. Worker i computes the
        first H_i steps of each round and idles through the rest."""
        config = cfg.strategy
        n, steps = cfg.parallel.world_size, cfg.run.steps
        each = (config.inner_steps if isinstance(config.inner_steps, list)
                else [config.inner_steps] * n)
        rounds, theta = max(each), facts.param_bytes
        graph = functools.lru_cache(maxsize=4)(
            lambda index: round_peers(config.topology, n, config.seed, index))

        def transfers(rank: int, step: int) -> list[Transfer]:
            if config.mixing == 0 or not round_ends(step, rounds, steps):
                return []
            peers = tuple(graph(step // rounds)[rank])
            if not peers:
                return []
            return [Transfer("gossip", "exchange", (theta * len(peers),), peers=peers,
                             peer_nbytes=(theta,) * len(peers))]

        return Traffic(steps, transfers, period=rounds,
                       compute_share=lambda rank, step: float(step % rounds < each[rank]))

    # ------------------------------------------------------------- the run

    def __init__(self, config: GossipConfig, setup: TrainSetup):
        super().__init__(config, setup)
        steps = config.inner_steps
        self.round_steps = max(steps) if isinstance(steps, list) else steps
        self.local_steps = steps[self.comm.rank] if isinstance(steps, list) else steps
        self.params = list(self.model.parameters())
        self.anchor = _flatten(self.params)
        """theta_i: this worker's weights at the start of the round (the last gossip result)."""
        self.round = 0
        self.last_loss = math.nan
        base = unwrap(self.model)
        self.average_model = copy.deepcopy(base).requires_grad_(False)
        self.worker_model = copy.deepcopy(base).requires_grad_(False)
        self._consensus: tuple[int, float] | None = None

    # ------------------------------------------------------------------ the round

    def train_step(self, batch) -> StepStats:
        if self.step_index % self.round_steps < self.local_steps:
            stats = super().train_step(batch)
            self.last_loss = stats.loss
            return stats
        self.step_index += 1  # idle: this worker's H_i < H; wait for the round boundary
        comm_s, extras = self.after_inner_step()
        return StepStats(loss=self.last_loss, tokens=0, comm_s=comm_s, extras=extras)

    def after_inner_step(self) -> tuple[float, dict[str, float]]:
        if self.step_index % self.round_steps and self.step_index != self.setup.total_steps:
            return 0.0, {}
        point = self.outer_point(_flatten(self.params))
        n, cfg = self.comm.world_size, self.config
        peers = round_peers(cfg.topology, n, cfg.seed, self.round)
        weights = mixing_weights(peers, self.comm.rank, cfg.mixing)
        ledger = self.comm.ledger
        first = len(ledger)
        with self.comm.phase("gossip"):
            self.anchor = gossip_mix(self.comm, point, weights)
        _, comm_s = ledger.totals(("gossip",), start=first)  # device-synchronised seconds
        _assign(self.params, self.anchor)
        self.round += 1
        return comm_s, {"round": float(self.round), "peers": float(len(weights) - 1)}

    def outer_point(self, current: torch.Tensor) -> torch.Tensor:
        """z_i, the point this worker gossips; plain gossip sends its current weights."""
        return current

    # ------------------------------------------------------------------ evaluation

    def eval_model(self) -> nn.Module:
        average = self.anchor.clone()
        if self.comm.world_size > 1:
            self.comm.all_reduce(average, op="avg")
        _assign(list(self.average_model.parameters()), average)
        return self.average_model

    def extra_eval_models(self) -> dict[str, nn.Module]:
        own = self.anchor.clone()
        if self.comm.world_size > 1:
            self.comm.broadcast(own, src=0)
        _assign(list(self.worker_model.parameters()), own)
        return {"worker0": self.worker_model}

    def metrics(self) -> dict[str, float]:
        if self._consensus is None or self._consensus[0] != self.round:
            mean = self.anchor.clone()
            if self.comm.world_size > 1:
                self.comm.all_reduce(mean, op="avg")
            distance = (self.anchor - mean).norm() / mean.norm().clamp_min(1e-30)
            distance = distance.reshape(1).double()
            if self.comm.world_size > 1:
                self.comm.all_reduce(distance, op="avg")
            self._consensus = (self.round, distance.item())
        return {**super().metrics(), "consensus": self._consensus[1]}

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {**super().state_dict(), "anchor": self.anchor.clone(), "round": self.round,
                "last_loss": self.last_loss}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.anchor = state["anchor"].to(self.anchor.device)
        self.round, self.last_loss = state["round"], state["last_loss"]


class GASLoC(Gossip):
    """GASLoC (arXiv 2606.11081, "Unifying Local Communications and Local Updates").

    **Reconstruction**: only the abstract and secondary write-ups were available, so the
    update below is our reading of them (docs/algorithms.md, GASLoC), with every coefficient
    configurable (outer_lr eta, outer_momentum gamma, mixing alpha, inner_steps H_i,
    topology). Per round, on worker i, from theta_i:

        H_i inner steps (AdamW)          -> theta_i'
        g_i = theta_i' - theta_i          (local progress)
        y_i = theta_i + eta g_i           (outer step)
        z_i = y_i + gamma (y_i - y_prev)  (momentum extrapolation); y_prev <- y_i
        theta_i <- sum_j W_ij z_j          (gossip with the round's peers)

    y_prev starts at the initial weights; then the complete graph with alpha = 1 equals
    DiLoCo with outer SGD(lr=eta, momentum=gamma, nesterov=True), and alpha = 0 equals n
    independent single-worker runs (both tested). Inner optimizer state is per worker,
    never synchronised. Rounds, topologies, mixing and metrics as in `Gossip`.
    """

    Config = GASLoCConfig

    ROUND_BUFFERS = 5
    """The current weights, y, z (sent), the mix, and y_prev kept between rounds."""

    def __init__(self, config: GASLoCConfig, setup: TrainSetup):
        super().__init__(config, setup)
        self.y_prev = self.anchor.clone()

    def outer_point(self, current: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        y = self.anchor.add(current - self.anchor, alpha=cfg.outer_lr)
        z = y.add(y - self.y_prev, alpha=cfg.outer_momentum)
        self.y_prev = y
        return z

    def state_dict(self) -> dict:
        return {**super().state_dict(), "y_prev": self.y_prev.clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.y_prev = state["y_prev"].to(self.y_prev.device)
