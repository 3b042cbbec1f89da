"""The optimizer component: the `optim.*` config, parameter groups, the schedule, the factory.

    commbench run configs/ddp-tiny.yaml --set optim.name=muon --set optim.delay=1
    pytest tests/test_optim.py tests/test_delay.py

`make_optimizer_factory(cfg)` returns `make(module) -> optimizer`, which every strategy
calls on the module it trains (the whole model, or one pipeline stage). Parameters are
classified by module type, never by name, so the same rule works on any slice of the GPT:
- hidden matrices: the 2-D weights of `nn.Linear` modules inside `TransformerBlock`s, the
  base of every architecture's block (GPT-2: attention qkv and projection, MLP fc and
  projection; Llama: q, k, v, o and the SwiGLU gate, up, down) -> Muon when `optim.name: muon`;
- everything else (token and position embeddings, the tied LM head, LayerNorms, biases) ->
  AdamW under Muon, and under the other optimizers the usual two groups: >= 2-D tensors
  decay, 1-D tensors (biases, norm gains) do not (nanoGPT's rule).
`optim.delay: 1` wraps the optimizer in `algorithms.delay.DelayedOptimizer` (one-step
gradient delay); `optim.delay_correction` corrects a delayed update, the emulation's or
PipeDream-2BW's (algorithms/delay.py `DelayCorrection`; docs/algorithms.md).
`optim.delay_profile: pipeline` gives the wrapper per-parameter delays instead, an
asynchronous pipeline's: the module's `as_layers()` cut into `optim.delay_stages` virtual
stages, stage s of P delayed by optim.delay x (P - 1 - s) steps
(`algorithms.delay.pipeline_delays`; issue 47).
"""

from __future__ import annotations

import math
from collections import ChainMap

import torch
from torch import nn

from algorithms.delay import DelayedOptimizer, pipeline_delays, rebind_parameters
from bench.config.schema import OPTIMIZERS, Config, OptimConfig
from bench.model import hidden_matrices


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to the peak, then cosine (or constant) down to min_lr_ratio * peak."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    span = max(1, cfg.run.steps - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / span)
    floor = o.lr * o.min_lr_ratio
    return floor + 0.5 * (o.lr - floor) * (1 + math.cos(math.pi * progress))


# ---------------------------------------------------------------- parameter groups


def configure_optimizer_groups(model: nn.Module, weight_decay: float,
                               exclude: list[nn.Parameter] = ()) -> list[dict]:
    """Two groups, nanoGPT's rule: >= 2-D tensors (matmul weights and embeddings) decay;
    1-D tensors (biases, LayerNorm gains) do not. `exclude` leaves parameters out."""
    skip = {id(p) for p in exclude}
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in skip]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def muon_param_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(hidden matrices, everything else): Muon's and AdamW's parameters."""
    hidden = hidden_matrices(model)
    hidden_ids = {id(p) for p in hidden}
    return hidden, [p for p in model.parameters() if id(p) not in hidden_ids]


# ---------------------------------------------------------------------- optimizers


class ChainedOptimizer:
    """Several torch optimizers over disjoint parameters, used as one (Muon + AdamW).

    `param_groups` lists every child's groups (the same dicts, so schedules reach them);
    `step`, `zero_grad` and the state dict cover all children in order.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self) -> ChainMap:
        return ChainMap(*(opt.state for opt in self.optimizers))

    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("ChainedOptimizer.step does not take a closure")
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        for opt, sub in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(sub)

    def rebind(self, mapping: dict) -> None:
        """Move every child to other Parameter objects (PipeDream-2BW's version swap)."""
        for opt in self.optimizers:
            rebind_parameters(opt, mapping)


def _muon(module: nn.Module, o: OptimConfig):
    hidden = hidden_matrices(module)
    if not hidden:
        raise ValueError(
            "optim.name='muon' needs 2-D hidden matrices (nn.Linear weights inside "
            f"TransformerBlocks), but this {type(module).__name__} has none; use "
            f"another optim.name (one of {list(OPTIMIZERS)})")
    muon = torch.optim.Muon(
        [{"params": hidden, "lr_scale": o.muon_lr / o.lr}], lr=o.muon_lr,
        momentum=o.muon_momentum, nesterov=o.muon_nesterov,
        weight_decay=o.muon_weight_decay)
    rest = [g for g in configure_optimizer_groups(module, o.weight_decay, hidden) if g["params"]]
    return ChainedOptimizer([muon, torch.optim.AdamW(rest, lr=o.lr, betas=o.betas)])


def _from_package(name: str, groups: list[dict], o: OptimConfig):
    try:
        import pytorch_optimizer
    except ImportError as err:
        raise ValueError(f"optim.name={name!r} needs the pytorch-optimizer package "
                         "(pip install pytorch-optimizer)") from err
    if name == "lion":
        return pytorch_optimizer.Lion(groups, lr=o.lr, betas=o.betas)
    if name == "soap":
        return pytorch_optimizer.SOAP(groups, lr=o.lr, betas=o.betas)
    return pytorch_optimizer.Adan(groups, lr=o.lr)


def build_optimizer(module: nn.Module, o: OptimConfig):
    """The optimizer `o` describes for `module`, without the delay wrapper."""
    if o.name == "muon":
        return _muon(module, o)
    groups = configure_optimizer_groups(module, o.weight_decay)
    if o.name == "adamw":
        return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas)
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum)
    if o.name == "nadamw":
        return torch.optim.NAdam(groups, lr=o.lr, betas=o.betas,
                                 momentum_decay=o.nadam_momentum_decay,
                                 decoupled_weight_decay=True)
    if o.name in ("lion", "adan", "soap"):
        return _from_package(o.name, groups, o)
    raise ValueError(f"optim.name must be one of {list(OPTIMIZERS)}, got {o.name!r}")


def make_optimizer_factory(cfg: Config):
    """`make(module) -> optimizer` for the strategies (TrainSetup.make_optimizer)."""
    o = cfg.optim

    def make(module: nn.Module):
        optimizer = build_optimizer(module, o)
        if o.delay:
            delays = None  # the uniform profile: every parameter one step late
            if o.delay_profile == "pipeline":
                delays = pipeline_delays(module, o.delay_stages, o.delay)
            optimizer = DelayedOptimizer(optimizer, o.delay, o.delay_correction, o.ef_lambda,
                                         delays=delays)
        return optimizer

    return make


def describe_optimizer(optimizer, cfg: Config) -> dict | None:
    """What a run's summary records about its optimizer: class names, group sizes, and the
    update delay whichever mechanism makes it (`delayed_by`: the `optim.delay` emulation or
    the strategy itself, PipeDream-2BW) with its correction.

    None for a strategy without a single optimizer object."""
    if optimizer is None or not hasattr(optimizer, "param_groups"):
        return None
    inner = getattr(optimizer, "optimizer", optimizer)
    parts = getattr(inner, "optimizers", [inner])
    info: dict = {
        "optimizers": [type(p).__name__ for p in parts],
        "groups": [{"optimizer": type(p).__name__, "num_tensors": len(g["params"]),
                    "num_params": sum(t.numel() for t in g["params"]),
                    "weight_decay": g.get("weight_decay"), "lr_scale": g.get("lr_scale", 1.0)}
                   for p in parts for g in getattr(p, "param_groups", [])],
    }
    delay = cfg.strategy.update_delay(cfg)
    info.update(delay=delay, delay_correction=cfg.optim.delay_correction if delay else "none")
    if delay:
        info["delayed_by"] = "emulation" if cfg.optim.delay else "strategy"
    if cfg.optim.delay and cfg.optim.delay_profile == "pipeline":
        p = cfg.optim.delay_stages
        info.update(delay_profile="pipeline", delay_stages=p,
                    stage_delays=[cfg.optim.delay * (p - 1 - s) for s in range(p)])
    if info["delay_correction"] == "ef":
        info["ef_lambda"] = cfg.optim.ef_lambda
    return info
