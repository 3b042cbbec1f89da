"""The plain data of the Strategy seam: what crosses between the training loop and a strategy.

    pytest tests/test_ddp.py   (a strategy built from a TrainSetup, its StepStats read back)

- `StrategyConfig`: the base of every strategy's config section. A config is data: its
  fields with their defaults and documentation, `__post_init__` (field-local ranges),
  `check` (cross-section refusals), `update_delay`, and small values derived from its
  fields that the running strategy itself uses (e.g. DiLoCo's `codec()`, `outer_rule()`,
  a pipeline's `critical_path`). The plans made from it before launch live beside the
  strategy, on its class (algorithms/base.py `Strategy.memory_terms`, `Strategy.traffic`,
  classmethods taking the run config; `strategy_of(cfg)` finds the class);
  `require_data_parallel`, the rule data-parallel strategies share;
- `TrainSetup`: everything the harness hands a strategy (model, communicator, optimizer
  factory, batch layout, precision);
- `StepStats`: what one `train_step` reports to the loop;
- `CriticalPath`: a pipeline step's schedule, for the projection that replays it.
The Strategy classes that take and return them, and the registry: algorithms/base.py.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from algorithms.comm import Communicator


@dataclass
class StrategyConfig:
    """Fields common to every strategy; each strategy subclasses this with its own knobs
    (fields, defaults, checks; its memory and traffic plans: its Strategy class)."""

    name: str = "ddp"
    """Which algorithm runs: one of the registered strategy names."""

    def check(self, cfg) -> None:
        """Cross-section validation against the whole run config `cfg` (the `Config` tree of
        bench/config/schema.py: `cfg.parallel`, `cfg.run`, ...), called by the config
        validation before any process starts. Raise ValueError naming the key, the bad value
        and what is valid. Field-local checks belong in `__post_init__`; the default checks
        nothing.
        """

    def update_delay(self, cfg) -> int:
        """Steps by which this strategy's weight updates lag the weights their gradients
        were taken at: `optim.delay` (the emulation) unless the strategy delays updates
        itself (PipeDream-2BW). A delay correction (`optim.delay_correction`) needs >= 1."""
        return cfg.optim.delay


def require_data_parallel(config: StrategyConfig, cfg) -> None:
    """The rule every data-parallel strategy shares: no pipeline stages."""
    if cfg.parallel.num_stages != 1:
        raise ValueError(f"strategy {config.name} is data parallel only: parallel.num_stages "
                         f"must be 1, got {cfg.parallel.num_stages}")


@dataclass
class StepStats:
    """What one `train_step` reports to the loop (all values local to this rank)."""

    loss: float | None
    """Mean training loss of this rank's batch; None where the rank computes no loss
    (a pipeline's non-last stages)."""
    tokens: int
    """Tokens this rank really consumed in the step (0 for an idle step). Ranks that
    share a batch (a pipeline replica's stages) report it on one of them: the loop sums
    this over ranks."""
    comm_s: float = 0.0
    """Exposed (non-overlapped) communication seconds in the step (idle_s included)."""
    idle_s: float = 0.0
    """Seconds spent waiting on point-to-point traffic (a pipeline's bubble); 0 for DP."""
    extras: dict[str, float] = field(default_factory=dict)
    """Algorithm-specific scalars (outer round, pseudo-gradient norm, ...)."""


@dataclass(frozen=True)
class CriticalPath:
    """A pipeline step's schedule, for the projection that replays it on the modelled
    link (bench/network/pipeline.py): `num_stages` stages each running `passes`
    microbatch passes (forward and backward) per step in the order of `schedule`."""

    schedule: str
    """bench/network/pipeline.py's PROGRAMS: 1f1b, gpipe (torch's), ours-1f1b, 2bw (ours)."""
    num_stages: int
    passes: int


@dataclass
class TrainSetup:
    """Everything the harness hands a strategy. Plain objects; no harness imports."""

    model: nn.Module
    """The full model; `model(x, y)` returns (logits, loss). The loop builds it on the meta
    device: a strategy makes real what its rank keeps with `materialize` (the whole model,
    one pipeline stage), on `comm.device`, with the values the whole model's init gives."""
    comm: Communicator
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    """Builds the inner optimizer for a module (param groups and hyper-parameters)."""
    total_steps: int
    grad_clip: float = 0.0
    """Max global gradient norm; 0 disables clipping."""
    group_size: int = 1
    """Ranks per data-parallel replica (hierarchical strategies); 1 = flat."""
    rank_batch_size: int = 1
    """Sequences per rank per step (all microbatches together)."""
    num_microbatches: int = 1
    """Gradient-accumulation microbatches per step (pipelines: microbatches per minibatch)."""
    autocast: Callable[[], object] | None = None
    """Context-manager factory for mixed precision around forward passes."""
    num_stages: int = 1
    """Pipeline stages (`parallel.num_stages`); 1 for every non-pipeline strategy."""
    partition: str = "layers"
    """How a pipeline cuts `model.as_layers()` into stages (`parallel.partition`)."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """(logits, targets) -> mean loss, what `model(x, y)` applies (bench.model.lm_loss);
    a pipeline's last stage applies it to its output."""
    delay_correction: str = "none"
    """`optim.delay_correction`, for strategies that delay updates themselves (2BW); the
    `optim.delay` emulation gets it through `make_optimizer` (algorithms/delay.py)."""
    ef_lambda: float = 1.0
    """`optim.ef_lambda`, the error-feedback correction's weight."""
    compile: Callable[[nn.Module], nn.Module] | None = None
    """`model.compile`: torch.compile, or None (eager). The strategy applies it to what it
    trains AFTER wrapping it: compile(DDP(model)), torch's documented order, which keeps
    DDP's bucket-wise overlap of gradient all-reduces with backward (compiling the bare
    model first gives DDP one backward graph: no overlap, a slower baseline). Pipelines
    compile their stage modules; engines that run the forward themselves refuse it in
    their config check."""
    precision: str = "fp32"
    """`model.precision` (fp32 | bf16), for engines that set mixed precision up
    themselves (DeepSpeed); torch strategies use `autocast`."""
    shard: str = "none"
    """`parallel.shard`: none, or fsdp (each data-parallel replica sharded over its ranks
    with FSDP2; algorithms/shard.py)."""


def load_registered(table: dict[str, str], name: str, key: str):
    """The class a registry row names ("module:Class"), imported only now; ValueError
    naming the config `key` and the valid names for a name the table does not hold."""
    if name not in table:
        raise ValueError(f"{key} must be one of {sorted(table)}, got {name!r}")
    module_name, class_name = table[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)
