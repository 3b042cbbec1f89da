"""The Strategy interface every algorithm implements, and the registry of strategies.

The algorithms themselves (math, defaults, identities) are described in the project's
docs/algorithms.md; this file is the interface the training loop relies on.

The training loop (`bench/run/train.py`, exercised by `commbench run configs/ddp-tiny.yaml`)
knows only this interface: it never branches on an algorithm's name. A strategy is built
from its own config dataclass and a `TrainSetup` (model, communicator, optimizer factory,
...), and the loop calls `train_step`, `evaluate`, `export_state`, `metrics`,
`state_dict`/`load_state_dict`. Those plain data classes (`StrategyConfig`, `TrainSetup`,
`StepStats`, `CriticalPath`) live in algorithms/contract.py; this file holds the registry
(`STRATEGIES`, `strategy_of(cfg)`), the helpers strategies share (`set_lr`, `mean_loss`,
`materialize`, `unwrap`, ...) and the Strategy classes, which also make a config's plans
before launch (`memory_terms`, `traffic`: classmethods).

Data-parallel strategies subclass `DataParallelStrategy`, whose step is
forward/backward -> `after_backward` -> clip -> inner optimizer step -> `after_inner_step`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from algorithms.contract import (
    CriticalPath,
    StepStats,
    StrategyConfig,
    TrainSetup,
    load_registered,
)

# name -> "module:Class". Imported lazily so `commbench --help` stays fast and a broken
# optional backend cannot break the others.
STRATEGIES: dict[str, str] = {
    "ddp": "algorithms.ddp:DDP",
    "diloco": "algorithms.diloco:DiLoCo",
    "pier": "algorithms.pier:Pier",
    "sparseloco": "algorithms.outer_rules.sparseloco:SparseLoCo",
    "noloco": "algorithms.outer_rules.noloco:NoLoCo",
    "demo": "algorithms.outer_rules.demo:DeMo",
    "gasloc": "algorithms.gasloc:GASLoC",
    "gossip": "algorithms.gasloc:Gossip",
    "pipeline": "algorithms.pipeline:Pipeline",
    "pipedream-2bw": "algorithms.pipedream:PipeDream2BW",
}


def strategy_class(name: str) -> type[Strategy]:
    return load_registered(STRATEGIES, name, "strategy.name")


def config_class(name: str) -> type[StrategyConfig]:
    return strategy_class(name).Config


def strategy_of(cfg) -> type[Strategy]:
    """The Strategy class of run config `cfg`'s strategy section, whose classmethods make
    its plans before launch: `strategy_of(cfg).memory_terms(cfg, facts)`, `.traffic(cfg,
    facts)`."""
    return strategy_class(cfg.strategy.name)


def set_lr(optimizer, lr: float) -> None:
    """The schedule's learning rate on every parameter group, times the group's `lr_scale`
    (Muon's matrices run at optim.muon_lr: their group carries muon_lr / lr)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


@torch.no_grad()
def mean_loss(model: nn.Module, batches, device: torch.device,
              autocast: Callable[[], object] | None = None) -> float:
    """Mean loss of a whole model over every position of every rank's `batches`: each
    batch's mean loss weighted by its positions, summed over ranks, over the positions
    (the exact mean whatever the batching and sharding; the reduction goes straight to
    torch.distributed, outside the ledger)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in batches:
        with autocast() if autocast else contextlib.nullcontext():
            _, loss = model(x.to(device), y.to(device))
        total += torch.tensor([loss.item() * y.numel(), y.numel()], dtype=torch.float64,
                              device=device)
    model.train(was_training)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
    return (total[0] / total[1]).item()


def begin_step(optimizer) -> None:
    """Before a step's forward pass: an optimizer that moves the weights where the gradient
    is taken (the delay emulation's `predict` correction, algorithms/delay.py) does so."""
    begin = getattr(optimizer, "begin_step", None)
    if begin is not None:
        begin()


def materialize(model: nn.Module, module: nn.Module, device: torch.device) -> None:
    """Make `module` (`model` itself or a part of it) real on `device` when it was built
    on the meta device, through the model's own `materialize` (bench/model/common.py: the
    values the whole model's init gives that part); a no-op when it is real already."""
    if any(p.is_meta for p in module.parameters()):
        unwrap(model).materialize(module, device)


def unwrap(model: nn.Module) -> nn.Module:
    """The module itself under a torch.compile wrapper (whose state keys are prefixed)."""
    return getattr(model, "_orig_mod", model)


class Strategy:
    """Base of every strategy. Subclasses set `Config` and implement the methods below.

    Before launch, without building anything, the class answers for its config (the run
    config's `cfg.strategy`, plain data: algorithms/contract.py) with its memory plan
    (`memory_terms`) and its traffic description (`traffic`), classmethods beside the code
    whose allocations and records they describe; subclasses extend them through super().
    """

    Config: type[StrategyConfig] = StrategyConfig

    @classmethod
    def memory_terms(cls, cfg, facts) -> dict[str, int]:
        """One rank's memory plan in bytes by term for run config `cfg`, before launch
        (bench/memory.py hands the measured `algorithms.memory.MemoryFacts`). Default:
        parameters, gradients, optimizer state and one microbatch's activations
        (`facts.base_terms()`)."""
        return facts.base_terms()

    @classmethod
    def traffic(cls, cfg, facts):
        """What one rank sends in each step, described without training: an
        `algorithms.traffic.Traffic` built from the run config `cfg` and the model's
        `TrafficFacts` (bench/study/whatif/engine.py prices it for `commbench whatif`). It
        must say what the strategy's own code records in the CommLedger
        (tests/test_whatif.py holds each description against real runs' ledgers).
        Default: not described."""
        raise ValueError(f"strategy.name={cfg.strategy.name!r} has no traffic description "
                         f"({cls.__name__}.traffic, algorithms/base.py Strategy.traffic): "
                         "commbench whatif cannot price it")

    def __init__(self, config: StrategyConfig, setup: TrainSetup):
        self.config = config
        self.setup = setup
        self.comm = setup.comm

    def data_shard(self) -> tuple[int, int]:
        """(shard index, number of shards) of the training stream this rank reads."""
        return self.comm.rank, self.comm.world_size

    def train_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> StepStats:
        raise NotImplementedError

    def set_lr(self, lr: float) -> None:
        raise NotImplementedError

    def eval_model(self) -> nn.Module:
        """The weights that count for validation and downstream evaluation."""
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Mean loss of `eval_model()` over every position of the validation set, of which
        `batches` is this rank's share, the same on every rank: weight each batch by its
        positions, never average batch means (that would depend on the batching).
        Collective over the world (the loop calls it inside comm.phase("eval"); the
        reduction goes straight to torch.distributed, outside the ledger). Default: the
        whole model forwarded on every rank (`mean_loss`).
        """
        return mean_loss(self.eval_model(), batches, self.comm.device, self.setup.autocast)

    def export_state(self) -> dict[str, torch.Tensor]:
        """This rank's share of the eval weights, keyed like the GPT's state_dict (CPU).

        The loop gathers every rank's dict and merges them (the first rank's value of a
        key wins). Called on every rank: `eval_model()` may be a collective (GASLoC's
        average). Default: rank 0 gives the whole `eval_model()`, the others nothing.
        """
        model = self.eval_model()  # on every rank, before any rank returns
        if self.comm.rank != 0:
            return {}
        return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}

    def extra_eval_models(self) -> dict[str, nn.Module]:
        """Further weights to validate besides `eval_model()`, by name (e.g. one worker's own).

        Called on every rank right after `eval_model()`, inside comm.phase("eval"); every
        rank returns the same names holding the same weights. The loop logs each one's
        validation loss as `val_loss_NAME` (and `final_val_loss_NAME` in the summary).
        """
        return {}

    def metrics(self) -> dict[str, float]:
        """Scalars that take communication to compute (e.g. a consensus distance).

        Called on every rank whenever the loop writes a metrics row: outside the timed
        steps, inside comm.phase("metrics") (not training traffic); rank 0's values are
        logged in the row.
        """
        return {}

    def watch_next_step(self) -> None:
        """Called before a step whose metrics row follows, so `metrics()` can report on
        that step (e.g. the delayed optimizer's update norm). What it arms runs inside the
        timed step: keep it cheap. Default: nothing."""

    def warm_up(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Called once per process before its first step (fresh or resumed), outside the
        timed steps, with that step's batch: one-off work that must not land in a timed
        step and must happen the same way whether the run starts or resumes. Changes no
        weights and records no training traffic. Default: nothing."""

    def critical_path(self) -> CriticalPath | None:
        """The step's critical-path shape when its point-to-point traffic overlaps compute
        in a schedule (pipelines); None (default): the projection prices op by op."""
        return None

    def summary_fields(self) -> dict:
        """Fields for summary.json (bench/run/summary.py `Summary`), e.g. a pipeline's
        `bubble_fraction_theory`, per-stage peak memory, activation bytes per boundary.

        Called once on every rank at the end of the run, inside comm.phase("metrics") (it
        may communicate); rank 0's dict is recorded. Default: nothing.
        """
        return {}

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError

    def state_scopes(self) -> dict[str, str]:
        """`state_dict` key -> the ranks holding it bit-identically: "world", "replica@R"
        (R the replica's first rank), "shard@J" (every replica's J-th rank); a checkpoint
        writes such a value once (bench/run/dcp_state.py). Default: none named, every key
        is its rank's own (always correct, written once per rank)."""
        return {}

    def close(self) -> None:
        """Release process groups or engines; called once at the end of the run."""


def _microbatches(batch: tuple[torch.Tensor, torch.Tensor], n: int):
    x, y = batch
    if x.shape[0] % n:
        raise ValueError(
            f"parallel.num_microbatches ({n}) must divide the per-rank batch ({x.shape[0]})"
        )
    return zip(x.chunk(n), y.chunk(n), strict=True)


class DataParallelStrategy(Strategy):
    """A step of forward/backward over microbatches, then the inner optimizer step.

    Subclasses hook communication in at `after_backward` (gradient all-reduce) and
    `after_inner_step` (outer synchronisation, gossip), and may wrap the model in torch
    DDP (`self.train_model, self.comm_hook = make_ddp(...)`, algorithms/ddp.py) in
    `__init__`; gradient-sync skipping and exposed-communication timing then work for
    every subclass. With `setup.shard == "fsdp"` the replica (`replica_group()`) is
    sharded with FSDP2 instead (`self.sharded`, algorithms/shard.py): its collectives are
    recorded, its gradient sync skipped the same way, clipping and evaluation go through it.
    """

    def __init__(self, config: StrategyConfig, setup: TrainSetup):
        super().__init__(config, setup)
        group = self.replica_group()
        self.sharded = None
        """The ShardedReplica (algorithms/shard.py) under parallel.shard=fsdp, else None."""
        if setup.shard == "fsdp":
            from algorithms.shard import ShardedReplica  # FSDP2, only when asked for

            self.sharded = ShardedReplica(setup.model, self.comm, group)
        # every rank keeps the whole model, or its shards of it
        materialize(setup.model, setup.model, setup.comm.device)
        self.model = setup.model
        self.train_model: nn.Module = setup.model
        self.optimizer = setup.make_optimizer(self.model)
        self.step_index = 0
        self.comm_hook = None
        """The DDPCommHook of `train_model` when that is a torch DDP wrapper, else None."""
        self.ddp_wrappers: list[tuple[nn.Module, object]] = []
        """Every torch DDP wrapper of the model, with its hook (`register_ddp`)."""
        self.backward_end = None
        """The comm hook's clock mark when the step's last backward returned."""
        self._compiled: dict[int, tuple[nn.Module, nn.Module]] = {}
        """id(module) -> (module, its compiled form) once `setup.compile` was applied to it."""

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def register_ddp(self, wrapped: tuple[nn.Module, object]) -> tuple[nn.Module, object]:
        """Keep a `make_ddp(...)` result (wrapper, hook) for `warm_up`; returns it."""
        self.ddp_wrappers.append(wrapped)
        return wrapped

    @torch.no_grad()
    def _zero_grads(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def warm_up(self, batch) -> None:
        """One backward through every torch DDP wrapper (one sequence, nothing recorded, no
        update): DDP rebuilds its buckets in gradient-ready order after its first backward,
        so without this the first timed step of a process all-reduces other buckets than
        every later one, and a resumed run on 3 or more ranks sums its first step in
        another order than the uninterrupted run (not bit-exact). With it every timed step,
        fresh or resumed, uses the rebuilt buckets, as DDP means them to be.
        Under `setup.compile`: `warm_up_compiled` instead."""
        if self.setup.compile is not None and self.sharded is None:
            self.warm_up_compiled(batch)
            return
        if not self.ddp_wrappers:
            return
        x, y = (t[:1] for t in batch)
        autocast = self.setup.autocast
        for model, hook in self.ddp_wrappers:
            with autocast() if autocast else contextlib.nullcontext():
                _, loss = model(x, y)
            loss.backward()
            hook.pending = []  # not training traffic
            self._zero_grads()

    def trained_modules(self) -> list[nn.Module]:
        """Every module a step of this process may call (`trained_module`, now or later):
        the DDP wrappers, then `train_model` if it is none of them (Pier switches from its
        world DDP to its group's model at the end of its lazy start)."""
        modules = [model for model, _ in self.ddp_wrappers]
        if all(model is not self.train_model for model in modules):
            modules.append(self.train_model)
        return modules

    def warm_up_compiled(self, batch) -> None:
        """`warm_up` under `setup.compile`: each of `trained_modules()` compiled and run
        forward and backward on the step's first microbatch (its shape, so the timed steps
        reuse the graphs; with several microbatches once under `no_sync` too), so that
        compilation (at a compiled module's first calls) lands in no timed step, e.g. not
        at Pier's switch. DDP's bucket rebuild happens on the way; nothing is recorded or
        updated. Unsharded only (FSDP's collectives record themselves)."""
        n = self.setup.num_microbatches
        x, y = next(iter(_microbatches(batch, n)))
        autocast = self.setup.autocast
        hooks = {id(model): hook for model, hook in self.ddp_wrappers}
        for module in self.trained_modules():
            compiled = self.compiled(module)
            for sync in ([False] if n > 1 else []) + [True]:
                skip = module.no_sync() if not sync and id(module) in hooks else None
                with skip or contextlib.nullcontext():
                    with autocast() if autocast else contextlib.nullcontext():
                        _, loss = compiled(x, y)
                    loss.backward()
                if id(module) in hooks:
                    hooks[id(module)].pending = []  # not training traffic
                self._zero_grads()

    def compiled(self, module: nn.Module) -> nn.Module:
        """`setup.compile(module)`, once per module."""
        if id(module) not in self._compiled:
            self._compiled[id(module)] = (module, self.setup.compile(module))
        return self._compiled[id(module)][1]

    def release(self, module: nn.Module) -> None:
        """Forget a module no step will call again (its DDP wrapper, its compiled form)."""
        self.ddp_wrappers = [w for w in self.ddp_wrappers if w[0] is not module]
        self._compiled.pop(id(module), None)

    def replica_group(self):
        """The ranks holding one replica of the model (algorithms.comm.Group; None = the
        world): what FSDP shards over. Called once in `__init__`, on every rank (subclasses
        create their groups here: group creation is collective)."""
        return None

    def is_ddp_wrapped(self) -> bool:
        """Whether `train_model` is a torch DDP wrapper (gradients sync in backward)."""
        return self.comm_hook is not None

    def trained_module(self) -> nn.Module:
        """What the forward passes call: `train_model` (a DDP wrapper where there is one),
        compiled by `setup.compile` when it is set, once per module: in `warm_up` (after
        every subclass has wrapped its model: compile(DDP(m))), else at the first step."""
        if self.setup.compile is None:
            return self.train_model
        return self.compiled(self.train_model)

    def no_sync(self):
        """Context that skips gradient communication for non-final microbatches."""
        if self.sharded is not None:
            return self.sharded.no_sync()
        if not self.is_ddp_wrapped():
            return contextlib.nullcontext()
        return self.train_model.no_sync()

    def forward_backward(self, batch) -> tuple[float, int]:
        n = self.setup.num_microbatches
        losses = []
        tokens = 0
        autocast = self.setup.autocast
        for i, (x, y) in enumerate(_microbatches(batch, n)):
            sync_context = self.no_sync() if i < n - 1 else contextlib.nullcontext()
            with sync_context:
                with autocast() if autocast else contextlib.nullcontext():
                    _, loss = self.trained_module()(x, y)
                (loss / n).backward()
            losses.append(loss.detach())
            tokens += y.numel()
        if self.is_ddp_wrapped():  # DDP's backward ended by waiting for the last bucket
            self.backward_end = self.comm_hook.clock.mark()
        # microbatches are equal chunks: their mean is the batch loss; one host sync a step
        return torch.stack(losses).mean().item(), tokens

    def after_backward(self) -> float:
        """Gradient communication; returns its exposed seconds.

        With a DDP-wrapped model: the wait from the last gradient bucket being handed to
        the network until `backward()` returned, on the device's clock (method in
        algorithms/ddp.py); the step's bucket records go to the ledger here. Sharded: the
        step's FSDP all-gathers and reduce-scatters (algorithms/shard.py says how timed).
        """
        if self.sharded is not None:
            return self.sharded.end_step()
        if not self.is_ddp_wrapped():
            return 0.0
        return self.comm_hook.end_step(self.backward_end)

    def after_inner_step(self) -> tuple[float, dict[str, float]]:
        """Communication after the optimizer step; returns (exposed seconds, extras)."""
        return 0.0, {}

    def watch_next_step(self) -> None:
        watch = getattr(self.optimizer, "watch_next_step", None)  # algorithms/delay.py
        if watch is not None:
            watch()

    def metrics(self) -> dict[str, float]:
        """The optimizer's diagnostics when it has any (the one-step-delay wrapper: update
        norm and stale-minus-fresh gradient norm of the step just taken)."""
        diagnostics = getattr(self.optimizer, "diagnostics", None)
        return diagnostics() if diagnostics is not None else {}

    def clip_gradients(self) -> None:
        if self.setup.grad_clip > 0 and self.sharded is not None:
            self.sharded.clip(self.setup.grad_clip)  # the norm's all-reduce is recorded
        elif self.setup.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.setup.grad_clip)

    def train_step(self, batch) -> StepStats:
        self.optimizer.zero_grad(set_to_none=True)
        begin_step(self.optimizer)
        loss, tokens = self.forward_backward(batch)
        comm_s = self.after_backward()
        self.clip_gradients()
        self.optimizer.step()
        self.step_index += 1
        outer_s, extras = self.after_inner_step()
        return StepStats(loss=loss, tokens=tokens, comm_s=comm_s + outer_s, extras=extras)

    def eval_model(self) -> nn.Module:
        return self.model

    def eval_weights(self):
        """Sharded runs: a context in which the replica holds the weights that count for
        evaluation (FSDP modules are not copied; DiLoCo swaps its global θ in). Default:
        the replica's own."""
        return contextlib.nullcontext()

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        if self.sharded is None:
            return super().evaluate(batches)
        with self.eval_weights():
            return self.sharded.mean_loss(batches, self.setup.autocast)

    def export_state(self) -> dict[str, torch.Tensor]:
        if self.sharded is None:
            return super().export_state()
        with self.eval_weights():
            state = self.sharded.full_state()  # a collective: every rank gathers
        return state if self.comm.rank == 0 else {}

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step_index": self.step_index,
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_index = state["step_index"]

