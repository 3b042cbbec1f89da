"""What every pipeline strategy shares: the process grid, the stage module, the update.

Exercised by `pytest tests/test_pipeline.py` and `commbench run configs/2bw-tiny.yaml`.
The pipelines (algorithms/pipeline.py, algorithms/pipedream.py) subclass
`PipelineStrategy`, which answers the loop's seam (algorithms/base.py: `evaluate`,
`export_state`, `data_shard`, `metrics`, StepStats with `loss=None` off the last stage
and `idle_s`) so the loop never branches on pipelines.

Process grid (docs/algorithms.md, Pipelines): `world_size = num_stages * num_replicas`;
global rank `r = replica * num_stages + stage`, so one replica's stages are neighbouring
ranks. Each stage's gradients are averaged over the replicas (ledger phase `dp`); the
tied token-embedding gradient is summed between the first and the last stage of a
replica when the model ties its head to the embedding (phase `tied`; an untied head
has no partner); gradient clipping needs the global norm over the stages (phase
`clip`). Point-to-point activation traffic is phase `train`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from algorithms.base import Strategy, begin_step, materialize, set_lr, unwrap
from algorithms.clocks import peak_memory_bytes
from algorithms.comm import Communicator, Group
from algorithms.contract import CriticalPath, StepStats, StrategyConfig, TrainSetup
from algorithms.partition import PARTITIONS, split_layers
from algorithms.traffic import Traffic, pipeline_traffic


def default_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (bench.model.lm_loss's formula), used when the
    setup names no `loss_fn` (algorithms do not import bench at module level)."""
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten())


@dataclass
class PipelineConfigBase(StrategyConfig):
    """Checks shared by the pipeline strategies' configs, and the step's schedule
    (`critical_path`); their memory and traffic plans: `PipelineStrategy`."""

    def check(self, cfg) -> None:
        """Cross-field rules on the whole run config; raises ValueError naming the key."""
        p = cfg.parallel
        if getattr(p, "shard", "none") != "none":
            raise ValueError(f"parallel.shard={p.shard!r} is for the data-parallel "
                             f"strategies (ddp, diloco, pier); {self.name} keeps a stage per "
                             "rank: use parallel.shard=none")
        if p.world_size % p.num_stages:
            raise ValueError(f"parallel.world_size ({p.world_size}) must be divisible by "
                             f"parallel.num_stages ({p.num_stages}) for {self.name}")
        if p.group_size != 1:
            raise ValueError(f"parallel.group_size must be 1 for {self.name} (pipelines "
                             f"form their own data-parallel groups), got {p.group_size}")
        if cfg.data.batch_size % p.num_microbatches:
            raise ValueError(f"parallel.num_microbatches ({p.num_microbatches}) must divide "
                             f"data.batch_size ({cfg.data.batch_size})")
        partition = getattr(p, "partition", "layers")
        if partition not in PARTITIONS:
            raise ValueError(f"parallel.partition must be one of {list(PARTITIONS)}, "
                             f"got {partition!r}")
        # more stages than blocks: checked by the harness (bench/config/checks.py), which knows
        # the model; split_layers also refuses it when the stages are built

    def critical_path(self, num_stages: int, num_microbatches: int) -> CriticalPath:
        """torch's 1F1B order (bench/network/pipeline.py), a flush every step. Also how
        DeepSpeed's 1F1B and the interleaved schedule (V chunks per rank: V*M passes on
        S stages) are priced: approximations, not their own orders
        (docs/algorithms.md, Pipelines, "Projection"). Other schedules override it."""
        passes = num_microbatches * getattr(self, "stages_per_rank", 1)
        return CriticalPath("1f1b", num_stages, passes)


@dataclass(frozen=True)
class PipelineGrid:
    """This rank's place in the data x pipeline grid and its groups (None = not needed)."""

    stage: int
    replica: int
    num_stages: int
    num_replicas: int
    pipe: Group
    """This replica's stages (all of them; for engines that need a pipeline group)."""
    dp: Group | None
    """This stage across the replicas; None with one replica."""
    tied: Group | None
    """First and last stage of this replica; None with one stage, on a middle stage, or when
    the head is untied."""

    @property
    def prev(self) -> int | None:
        return None if self.stage == 0 else self.rank - 1

    @property
    def next(self) -> int | None:
        return None if self.stage == self.num_stages - 1 else self.rank + 1

    @property
    def rank(self) -> int:
        return self.replica * self.num_stages + self.stage

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


def make_grid(comm: Communicator, num_stages: int, tied: bool = True) -> PipelineGrid:
    """Build the grid's groups (`tied`: whether the model's head is its token embedding).
    Collective: every rank calls it, in the same order."""
    world = comm.world_size
    if num_stages < 1 or world % num_stages:
        raise ValueError(f"parallel.world_size ({world}) must be divisible by "
                         f"parallel.num_stages ({num_stages})")
    replicas = world // num_stages
    replica, stage = divmod(comm.rank, num_stages)
    pipe = comm.split([[r * num_stages + s for s in range(num_stages)] for r in range(replicas)])
    dp = None
    if replicas > 1:
        dp = comm.split([[r * num_stages + s for r in range(replicas)]
                         for s in range(num_stages)])
    tied_group = None
    if num_stages > 1 and tied:
        for r in range(replicas):  # new_group is collective over the world
            group = comm.new_group([r * num_stages, r * num_stages + num_stages - 1])
            if comm.rank in group.ranks:
                tied_group = group
    return PipelineGrid(stage, replica, num_stages, replicas, pipe, dp, tied_group)


class PipelineStrategy(Strategy):
    """Base of the pipelines: builds the grid and this stage's module; owns the update.

    Subclasses implement `run_schedule(batch) -> (loss or None, idle seconds)`, which
    runs the M microbatches' forward and backward passes and leaves the minibatch's
    gradient (mean over microbatches) in `self.grad_module()`'s `.grad`.
    """

    # ------------------------------------------------------------- plans, before launch

    @classmethod
    def traffic(cls, cfg, facts) -> Traffic:
        """Per step and stage: the microbatches' activations and gradients to and from the
        neighbouring stages (phase "train"; the schedule's batched crossings are
        exchanges, except GPipe's), then the stage's gradients averaged over the replicas
        ("dp"), the tied embedding's summed between the end stages ("tied") and the
        clipping norm over the stages ("clip"). Priced on the critical path."""
        return pipeline_traffic(cfg.strategy, cfg, facts)

    @classmethod
    def in_flight(cls, config: PipelineConfigBase, facts) -> float:
        """Microbatches whose activations stage `facts.stage` holds at once: 1F1B's
        min(S - s, M) (a stage runs S - s forwards before its first backward)."""
        return min(facts.num_stages - facts.stage, facts.num_microbatches)

    @classmethod
    def autocast_regions(cls, in_flight: float) -> float:
        """bf16: autocast regions whose weight copies are alive at once. Torch's pipelines
        run a step's schedule in one region (algorithms/pipeline.py)."""
        return 1

    @classmethod
    def memory_terms(cls, cfg, facts) -> dict[str, int]:
        """The stage's parameters, gradients, optimizer state and the activations of the
        microbatches in flight; + the stage outputs kept for backward and the replicas'
        flat gradient buffer. The rest of the model is never allocated (stage-local)."""
        in_flight = cls.in_flight(cfg.strategy, facts)
        terms = facts.base_terms(in_flight, cls.autocast_regions(in_flight))
        if facts.stage < facts.num_stages - 1:
            terms["stage outputs kept for backward"] = int(in_flight * facts.boundary_bytes)
        if facts.world_size > facts.num_stages:
            terms["data-parallel gradient buffer"] = facts.param_bytes
        return terms

    # ------------------------------------------------------------- the run

    def __init__(self, config: StrategyConfig, setup: TrainSetup):
        super().__init__(config, setup)
        gpt = unwrap(setup.model)
        self.grid = make_grid(self.comm, setup.num_stages, _ties_embeddings(gpt))
        self.loss_fn = setup.loss_fn or default_loss
        S, V = self.grid.num_stages, getattr(config, "stages_per_rank", 1)
        parts = split_layers(gpt.as_layers(), S * V, setup.partition)
        self.chunk_ids = [self.grid.stage + i * S for i in range(V)]
        """Virtual stages on this rank (one unless the schedule is interleaved)."""
        self.num_chunks = S * V
        chunks = [nn.Sequential(*parts[c]) for c in self.chunk_ids]
        self.stage_module = chunks[0] if V == 1 else nn.ModuleList(chunks)
        # only this rank's stages become real (the rest of a meta-built model never does)
        materialize(setup.model, self.stage_module, self.comm.device)
        self.names = _parameter_names(gpt, self.stage_module)
        self.optimizer = setup.make_optimizer(self.stage_module)
        self.step_index = 0
        self.num_microbatches = setup.num_microbatches
        if setup.rank_batch_size % self.num_microbatches:
            raise ValueError(f"parallel.num_microbatches ({self.num_microbatches}) must divide "
                             f"data.batch_size ({setup.rank_batch_size})")
        self.micro_batch = setup.rank_batch_size // self.num_microbatches
        self._compiled: dict[int, nn.Module] = {}
        """id(module) -> its compiled form (`setup.compile`), built on first use."""

    # ------------------------------------------------------------------ the seam

    def data_shard(self) -> tuple[int, int]:
        """Every stage of a replica reads the replica's shard (only ends use it)."""
        return self.grid.replica, self.grid.num_replicas

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def eval_model(self) -> nn.Module:
        """This stage's module (its parameters keep the GPT's own names in `export_state`)."""
        return self.stage_module

    def export_state(self) -> dict[str, torch.Tensor]:
        """This stage's newest weights under the GPT's state_dict keys.

        The union of the dicts of one replica's stages is the full GPT state_dict (a tied
        embedding as `embed.wte.weight` from the first stage and `head.weight` from the
        last, equal copies).
        """
        module = self.eval_model()
        return {self.names[k]: v.detach().clone()
                for k, v in module.named_parameters(remove_duplicate=False)}

    def train_step(self, batch) -> StepStats:
        begin_step(self.optimizer)  # the optim.delay emulation's predict correction
        loss, idle_s = self.run_schedule(batch)
        comm_s = self.apply_update()
        self.step_index += 1
        # a replica's stages share its batch: the first stage reports its tokens
        tokens = batch[1].numel() if self.grid.is_first else 0
        return StepStats(loss=loss, tokens=tokens, comm_s=comm_s + idle_s, idle_s=idle_s,
                         extras=self.step_extras(idle_s))

    def step_extras(self, idle_s: float) -> dict[str, float]:
        return {"bubble_theory": self.bubble_theory()}

    def bubble_theory(self) -> float:
        """The schedule's bubble fraction with a flush: (S-1)/(M+S-1)."""
        S, M = self.grid.num_stages, self.num_microbatches
        return (S - 1) / (M + S - 1)

    def critical_path(self) -> CriticalPath:
        """The config's (`PipelineConfigBase.critical_path`)."""
        return self.config.critical_path(self.grid.num_stages, self.num_microbatches)

    def summary_fields(self) -> dict:
        """bubble_fraction_theory, per-stage peak memory (max over replicas) and the p2p
        bytes sent per step and replica across each stage boundary, forward and backward
        (the ledger's `bytes_sent`; a batch naming several peers split by `peer_nbytes`).
        Collective over the world (all_gather, ledger phase of the caller)."""
        S, stage = self.grid.num_stages, self.grid.stage
        mine = torch.zeros(1 + 2 * max(0, S - 1), dtype=torch.float64, device=self.comm.device)
        mine[0] = peak_memory_bytes(self.comm.device)
        steps = max(1, self.step_index)
        for peer, nbytes in self.comm.ledger.bytes_sent("train").items():
            peer_stage = peer % S
            if peer_stage == stage + 1:  # forward across boundary `stage`
                mine[1 + 2 * stage] += nbytes / steps
            elif peer_stage == stage - 1:  # backward across boundary `stage - 1`
                mine[2 + 2 * (stage - 1)] += nbytes / steps
        rows = torch.stack(self.comm.all_gather(mine))
        peaks = [int(rows[s::S, 0].max().item()) for s in range(S)]
        per_boundary = rows[:, 1:].sum(0) / self.grid.num_replicas
        return {
            "bubble_fraction_theory": self.bubble_theory(),
            "peak_memory_bytes_per_stage": peaks,
            "activation_bytes_per_boundary": [
                {"forward": round(per_boundary[2 * b].item()),
                 "backward": round(per_boundary[2 * b + 1].item())}
                for b in range(S - 1)],
        }

    def run_schedule(self, batch) -> tuple[float | None, float]:
        raise NotImplementedError

    def compiled(self, module: nn.Module) -> nn.Module:
        """`module` (a stage chunk or a weight version) as the forward passes call it:
        compiled by `setup.compile` when it is set (once per module), else itself. The
        parameters stay `module`'s own, so names, optimizer and state are unchanged."""
        if self.setup.compile is None:
            return module
        if id(module) not in self._compiled:
            self._compiled[id(module)] = self.setup.compile(module)
        return self._compiled[id(module)]

    # ------------------------------------------------------------------ the update

    def grad_module(self) -> nn.Module:
        """The module whose `.grad` holds the gradient the optimizer applies now."""
        return self.stage_module

    def sync_gradients(self, module: nn.Module) -> float:
        """Average over replicas, sum the tied weight's two halves, clip; comm seconds."""
        start = len(self.comm.ledger)
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if self.grid.dp is not None and grads:
            with self.comm.phase("dp"):
                flat = torch.cat([g.reshape(-1) for g in grads])
                self.comm.all_reduce(flat, "avg", self.grid.dp)
                _unflatten_into(flat, grads)
        if self.grid.tied is not None:
            tied = _tied_parameter(module)
            with self.comm.phase("tied"):
                self.comm.all_reduce(tied.grad, "sum", self.grid.tied)
        if self.setup.grad_clip > 0:
            self.clip(module)
        return sum(r.seconds for r in self.comm.ledger.records[start:])

    def clip(self, module: nn.Module) -> None:
        """Global-norm clipping over the whole pipeline (the tied weight counted once)."""
        tied = _tied_parameter(module) if self.grid.tied is not None else None
        sq = torch.zeros((), dtype=torch.float32, device=self.comm.device)
        for p in module.parameters():
            if p.grad is not None and not (p is tied and self.grid.is_last):
                sq += p.grad.detach().float().pow(2).sum()
        if self.grid.num_stages > 1:
            with self.comm.phase("clip"):
                self.comm.all_reduce(sq, "sum", self.grid.pipe)
        scale = self.setup.grad_clip / (math.sqrt(sq.item()) + 1e-6)
        if scale < 1:
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)

    def apply_update(self) -> float:
        comm_s = self.sync_gradients(self.stage_module)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return comm_s

    # ------------------------------------------------------------------ evaluation

    def eval_chunks(self) -> list[nn.Module]:
        module = self.eval_model()
        return list(module) if isinstance(module, nn.ModuleList) else [module]

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Mean loss of the newest weights over every position of every replica's
        `batches` (each batch weighted by its positions, as `mean_loss`; every rank gets
        the mean). Collective over the world; forward only, chunk to chunk (ledger phase
        `eval`); only a replica's last stage adds its losses.
        """
        total = torch.zeros(2, dtype=torch.float64, device=self.comm.device)
        chunks = dict(zip(self.chunk_ids, self.eval_chunks(), strict=True))
        S, base = self.grid.num_stages, self.grid.replica * self.grid.num_stages
        for m in chunks.values():
            m.eval()
        autocast = self.setup.autocast  # as data-parallel strategies evaluate (mean_loss)
        with self.comm.phase("eval"), autocast() if autocast else contextlib.nullcontext():
            for x, y in batches:
                x, y = x.to(self.comm.device), y.to(self.comm.device)
                h = x
                for c in range(self.num_chunks):
                    if c not in chunks:
                        continue
                    if c > 0 and (c - 1) % S != self.grid.stage:
                        h = self.comm.recv(self.activation_buffer(x.shape[0]), base + (c - 1) % S)
                    h = chunks[c](h)
                    if c == self.num_chunks - 1:
                        total += torch.tensor([self.loss_fn(h, y).item() * y.numel(),
                                               y.numel()], dtype=torch.float64,
                                              device=total.device)
                    elif (c + 1) % S != self.grid.stage:
                        self.comm.send(h, base + (c + 1) % S)
            self.comm.all_reduce(total, "sum")
        for m in chunks.values():
            m.train()
        return (total[0] / total[1]).item()

    def activation_buffer(self, batch: int, requires_grad: bool = False) -> torch.Tensor:
        """A receive buffer for the hidden states of `batch` sequences."""
        gpt = unwrap(self.setup.model)
        p = next(self.stage_module.parameters())
        return torch.empty(batch, gpt.cfg.seq_len, gpt.cfg.n_embd, dtype=p.dtype,
                           device=p.device, requires_grad=requires_grad)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {"model": self.stage_module.state_dict(),
                "optimizer": self.optimizer.state_dict(), "step_index": self.step_index}

    def load_state_dict(self, state: dict) -> None:
        self.stage_module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_index = state["step_index"]


def _parameter_names(gpt: nn.Module, stage: nn.Module) -> dict[str, str]:
    """Stage parameter name (duplicates kept) -> the GPT's name for it (its state_dict key).

    The tied weight gets the name of the module holding it here: `embed.wte.weight` on
    the first stage, `head.weight` on the last, both with one stage.
    """
    gpt_names = {id(m): name for name, m in gpt.named_modules()}
    names = {}
    for prefix, module in stage.named_modules():
        if id(module) in gpt_names:
            for local, _ in module.named_parameters(recurse=False):
                names[f"{prefix}.{local}"] = f"{gpt_names[id(module)]}.{local}"
    return names


def _ties_embeddings(model: nn.Module) -> bool:
    """Whether the model's head is its token embedding (bench/model: `cfg.tie_embeddings`)."""
    return getattr(getattr(model, "cfg", None), "tie_embeddings", True)


def _tied_parameter(module: nn.Module) -> nn.Parameter:
    """This stage's copy of the tied token-embedding weight: on the first stage the
    embedding's, on the last the head's (modules answering `tied_parameter()`, the model's
    Embedding and Head)."""
    for m in module.modules():
        tied = getattr(m, "tied_parameter", None)
        if tied is not None and tied() is not None:
            return tied()
    raise ValueError("no tied token-embedding weight on this stage")


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
