"""One-step gradient delay around any optimizer, and the delay corrections it shares with
PipeDream-2BW.

    commbench run configs/ddp-tiny.yaml --set optim.delay=1 --set optim.delay_correction=ef
    commbench run configs/2bw-tiny.yaml --set optim.delay_correction=predict
    pytest tests/test_delay.py tests/test_pipeline.py

The emulation (arXiv 2606.30634; docs/algorithms.md, "One-step delay and corrections")
gives PipeDream-2BW's update rule without a pipeline, on one rank or data-parallel:

    W(t+1) = W(t) - opt(g(t-1)),   g(t-1) = grad f(W(t-1); B(t-1))

Which batch meets which weights (steps t = 0, 1, ..., T-1 of the loop, W(0) the init):
- step t runs forward/backward of batch B(t) (the undelayed run's data order) on the
  current weights W(t), giving the fresh gradient g(t) (already all-reduced and clipped by
  the strategy: clipping acts on the fresh gradient, before it is stored);
- step 0 stores g(0) and applies nothing: W(1) = W(0), the optimizer's state is untouched
  (its internal step count stays 0);
- step t >= 1 hands the stored g(t-1) to the optimizer (at step t's learning rate) and
  stores g(t): W(t+1) = W(t) - opt(g(t-1)); the optimizer's state (moments, step count)
  consumes only stale gradients;
- the last gradient g(T-1) is never applied: T steps apply T-1 updates.

Corrections (`DelayCorrection`, the same object in the emulation and in
algorithms/pipedream.py, so the two stay identical on the same data). With u(t) =
W_after - W_before the wrapped optimizer's own update at step t:
- `ef`, error feedback, a RECONSTRUCTION of arXiv 2606.30634's update-level correction
  (its equations were not available): the weights receive ũ(t) = u(t) + λ (u(t) - u(t-1))
  (`ef_correction`; nothing at the first applied step, which has no u(t-1));
- `predict`, weight prediction after SpecTrain (Chen et al. 2018) and PipeMare (Yang et al.
  2021), a RECONSTRUCTION of their optimizer-agnostic form: the gradient of a step is taken
  at the extrapolated weights W(t) + u(t-1) (their W - τ·lr·v with τ = 1 step of delay,
  the last update standing for -lr·v whatever the optimizer). The optimizer still updates
  W(t); the shift is made before the forward pass and undone before the update, as
  `(W + u) - u` in both the emulation and the pipeline (the same rounding in both).
u(t-1) is the one extra model-sized buffer of either correction.

Delay profiles (`optim.delay_profile`, issue 47). `uniform` is the rule above: every
parameter's update uses g(t-1). `pipeline` gives each parameter its own delay, an
asynchronous pipeline's staleness: `model.as_layers()` ([embedding, blocks..., head]) is
cut into P virtual stages with algorithms/partition.py `stage_bounds` (partition
"layers"), and stage s of P is delayed by d = optim.delay x (P - 1 - s) steps
(`stage_delays`; a weight two stages share, GPT-2's tied embedding/head, takes the first
stage's, larger, delay: our choice). With per-parameter delays (`DelayedOptimizer(...,
delays=...)`) step t applies to a parameter of delay d the fresh gradient of step t - d
(d = 0: the step's own), or nothing while t < d (its `grad` is None: the optimizer skips
it); a step where no parameter has a gradient to apply does not call the wrapped
optimizer at all (as the uniform rule's step 0). Each stored gradient is kept exactly
d steps, so the buffers hold sum_i d_i |p_i| numbers (P = 2: the first stage's
gradient; P = 3: about one model). The corrections are defined for one step of delay and
are refused with per-parameter delays.

State: the stored gradient(s), u(t-1) and the step counts are in `state_dict()` next to
the wrapped optimizer's, so a resumed run continues bit-exactly.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from algorithms.partition import stage_bounds

CORRECTIONS = ("none", "ef", "predict")
DELAY_PROFILES = ("uniform", "pipeline")
"""`optim.delay_profile`: every parameter delayed alike, or per virtual pipeline stage."""


def stage_delays(layers: Sequence[nn.Module], num_stages: int,
                 delay: int = 1) -> dict[int, int]:
    """The pipeline profile: `{id(parameter): its delay}` for every parameter of `layers`
    (a model's `as_layers()`), cut into `num_stages` virtual stages by block count
    (`stage_bounds`, partition "layers": the embedding on the first stage, the head on the
    last); stage s of P is delayed by `delay * (P - 1 - s)` steps. A parameter in several
    stages (a tied embedding/head weight) takes the largest, its first stage's, delay.

    Raises ValueError naming optim.delay_stages when the model cannot be cut so.
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 2:
        raise ValueError(f"optim.delay_stages must be an integer >= 2 (the virtual "
                         f"pipeline's stages), got {num_stages!r}")
    try:
        bounds = stage_bounds(layers, num_stages, "layers")
    except ValueError as err:
        raise ValueError(f"optim.delay_stages={num_stages} cannot cut this model into "
                         f"stages: {err}") from err
    delays: dict[int, int] = {}
    for s, (start, stop) in enumerate(bounds):
        d = delay * (num_stages - 1 - s)
        for layer in layers[start:stop]:
            for p in layer.parameters():
                delays[id(p)] = max(delays.get(id(p), 0), d)
    return delays


def pipeline_delays(module: nn.Module, num_stages: int, delay: int = 1) -> dict[int, int]:
    """`stage_delays` of a whole model (it has `as_layers()`), checked to cover every
    parameter of `module`; ValueError naming optim.delay_profile otherwise (a pipeline
    stage, an engine's wrapper: the optimizer does not see the whole model)."""
    as_layers = getattr(module, "as_layers", None)
    if as_layers is None:
        raise ValueError(
            f"optim.delay_profile='pipeline' cuts the whole model's layers "
            f"(model.as_layers()) into virtual stages, but this optimizer is built on a "
            f"{type(module).__name__}, which has none (a pipeline stage, or a wrapper): "
            "valid: a data-parallel strategy, or optim.delay_profile=uniform")
    delays = stage_delays(as_layers(), num_stages, delay)
    missing = [name for name, p in module.named_parameters() if id(p) not in delays]
    if missing:
        raise ValueError(f"optim.delay_profile='pipeline': parameters {missing[:3]} of "
                         f"{type(module).__name__} are in none of its as_layers(): no stage "
                         "and no delay for them")
    return delays


def ef_correction(update: torch.Tensor, previous_update: torch.Tensor,
                  ef_lambda: float) -> torch.Tensor:
    """The corrected update ũ(t) = u(t) + λ (u(t) - u(t-1)) (reconstruction, see module doc).

    Pure: returns a new tensor. Replace this function to try another form of the
    correction; `DelayCorrection` applies whatever update it returns.
    """
    return update + ef_lambda * (update - previous_update)


class DelayCorrection:
    """What a delay correction keeps and does around each delayed optimizer step.

    Shared by `DelayedOptimizer` (the emulation) and `PipeDream2BW`: `shift(params, +1)`
    before a forward pass and `shift(params, -1)` before the update move the weights to and
    from where the gradient is taken (`predict`; a no-op otherwise), and `step(params,
    optimizer_step)` runs the optimizer on `params` (holding W(t) and the gradient to apply)
    and corrects its update (`ef`). See the module docstring for the formulas.
    """

    def __init__(self, kind: str = "none", ef_lambda: float = 1.0):
        if kind not in CORRECTIONS:
            raise ValueError(f"optim.delay_correction must be one of {list(CORRECTIONS)}, "
                             f"got {kind!r}")
        self.kind, self.ef_lambda = kind, float(ef_lambda)
        self.previous: list[torch.Tensor] | None = None
        """u(t-1) per parameter; None before the first applied update (or without a kind)."""

    @torch.no_grad()
    def shift(self, params: list[torch.Tensor], sign: int) -> bool:
        """`predict`: add `sign` x u(t-1) to `params` in place; whether anything moved."""
        if self.kind != "predict" or self.previous is None:
            return False
        for p, u in zip(params, self.previous, strict=True):
            p.add_(u, alpha=sign)
        return True

    @torch.no_grad()
    def step(self, params: list[torch.Tensor], optimizer_step,
             keep_before: bool = False) -> list[torch.Tensor] | None:
        """`optimizer_step()` on `params`, then the correction; returns the weights before
        the step when they were kept (any correction, or `keep_before`), else None."""
        if self.kind == "none" and not keep_before:
            optimizer_step()
            return None
        before = [p.detach().clone() for p in params]
        optimizer_step()
        if self.kind != "none":
            updates = [p.detach() - b for p, b in zip(params, before, strict=True)]
            if self.kind == "ef" and self.previous is not None:
                for p, u, previous in zip(params, updates, self.previous, strict=True):
                    # p is W_before + u; adding (ũ - u) keeps λ = 0 bit-identical to no correction
                    p.add_(ef_correction(u, previous, self.ef_lambda) - u)
            self.previous = updates
        return before

    def state_dict(self) -> dict:
        return {"previous_update": None if self.previous is None
                else [_copy(u) for u in self.previous]}

    def load_state_dict(self, state: dict, devices: list[torch.device]) -> None:
        self.previous = _to_devices(state["previous_update"], devices)


def rebind_parameters(optimizer, mapping: dict) -> None:
    """Point `optimizer` at other Parameter objects: every key of `mapping` is replaced by
    its value in the param groups, and its per-parameter state moves with it.

    For PipeDream-2BW's version swap, whatever the optimizer's structure: a torch optimizer
    is re-keyed here; a composite (Muon + AdamW, the delay wrapper) re-binds itself through
    its own `rebind(mapping)` method, which calls this for its parts.
    """
    own = getattr(optimizer, "rebind", None)
    if own is not None:
        own(mapping)
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"cannot re-bind a {type(optimizer).__name__}: neither a "
                        "torch.optim.Optimizer nor an object with a rebind(mapping) method")
    for group in optimizer.param_groups:
        group["params"] = [mapping.get(p, p) for p in group["params"]]
    optimizer.state = defaultdict(dict, {mapping.get(p, p): state
                                         for p, state in optimizer.state.items()})


class DelayedOptimizer:
    """Applies each step's gradient one step late through the wrapped optimizer.

    Looks like a torch optimizer to the strategies: `step()`, `zero_grad()`,
    `param_groups` (the wrapped optimizer's, so learning-rate schedules reach it),
    `state_dict()`/`load_state_dict()`, plus `begin_step()`, which a strategy calls before
    the step's forward pass (the `predict` correction moves the weights there). See the
    module docstring for the exact rule.

    `delays` (optional, `{id(parameter): steps}` for every parameter, e.g.
    `pipeline_delays`): per-parameter delays instead of the uniform one-step rule (module
    docstring, "Delay profiles"); no correction then. Without it the uniform rule runs,
    unchanged.

    Diagnostics: after a step, `diagnostics()` returns the norm of the stale-minus-fresh
    gradient (g(t-1) - g(t); per-parameter delays: g(t-d) - g(t) over the delayed
    parameters given one) and, if `watch_next_step()` was called before that step, the
    norm of the update applied to the weights. Call it before the next `zero_grad()`.
    """

    def __init__(self, optimizer, delay: int = 1, correction: str = "none",
                 ef_lambda: float = 1.0, delays: Mapping[int, int] | None = None):
        if delay != 1:
            raise ValueError(f"optim.delay must be 1 for a DelayedOptimizer, got {delay!r}")
        self.optimizer = optimizer
        self.correction = DelayCorrection(correction, ef_lambda)
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.stale: list[torch.Tensor | None] | None = None
        """g(t-1) per parameter (None: no gradient); None before the first step."""
        self.num_applied = 0
        """Updates applied so far (= steps taken - 1 once the first step has run)."""
        self.delays: list[int] | None = None
        """Per-parameter delays (in `params` order), or None: the uniform rule."""
        self.queue: list[list[torch.Tensor | None]] = []
        """Per-parameter delays: the last max(delays) steps' stored gradients, oldest
        first (queue[-d] holds g(t-d) at step t); an entry is dropped (None) once used."""
        if delays is not None:
            self.delays = _delays_of(self.params, delays)
            if self.correction.kind != "none":
                raise ValueError(
                    f"optim.delay_correction={correction!r} is defined for one step of "
                    "delay; with per-parameter delays (optim.delay_profile='pipeline') it "
                    "is not: valid: optim.delay_correction=none, or "
                    "optim.delay_profile=uniform")
        self._shifted = False
        self._watch = False
        self._before: list[torch.Tensor] | None = None

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def watch_next_step(self) -> None:
        """Keep what `diagnostics()` needs for the update norm of the next step."""
        self._watch = True

    def begin_step(self) -> None:
        """Before the step's forward pass: `predict` takes the gradient at W(t) + u(t-1)."""
        if not self._shifted:
            self._shifted = self.correction.shift(self.params, +1)

    def rebind(self, mapping: dict) -> None:
        self.params = [mapping.get(p, p) for p in self.params]
        rebind_parameters(self.optimizer, mapping)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("DelayedOptimizer.step does not take a closure")
        if self.delays is not None:
            self._step_per_parameter()
            return
        fresh = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
        if self._shifted:  # back to W(t), the weights the update applies to
            self.correction.shift(self.params, -1)
            self._shifted = False
        watch, self._watch, self._before = self._watch, False, None
        if self.stale is None:  # step 0: store g(0), apply nothing
            self.stale = fresh
            if watch:
                self._before = [p.detach().clone() for p in self.params]
            return
        for p, stale in zip(self.params, self.stale, strict=True):
            if stale is None:
                p.grad = None
            elif p.grad is None:
                p.grad = stale.clone()
            else:
                p.grad.copy_(stale)  # in place: gradient buffers may be views (DDP buckets)
        self.stale = fresh
        before = self.correction.step(self.params, self.optimizer.step, keep_before=watch)
        self.num_applied += 1
        self._before = before if watch else None

    @torch.no_grad()
    def _step_per_parameter(self) -> None:
        """Step t with per-parameter delays: a parameter of delay d gets g(t - d), or no
        gradient while t < d; the wrapped optimizer steps only if some parameter has one."""
        watch, self._watch, self._before = self._watch, False, None
        fresh = [None if d == 0 or p.grad is None else p.grad.detach().clone()
                 for p, d in zip(self.params, self.delays, strict=True)]
        applying = False
        for i, (p, d) in enumerate(zip(self.params, self.delays, strict=True)):
            if d == 0:  # the step's own gradient, where it is
                applying = applying or p.grad is not None
                continue
            stored = None
            if d <= len(self.queue):
                stored, self.queue[-d][i] = self.queue[-d][i], None  # used once: dropped
            if stored is None:
                p.grad = None
            elif p.grad is None:
                p.grad = stored
            else:
                p.grad.copy_(stored)  # in place: gradient buffers may be views (DDP buckets)
            applying = applying or stored is not None
        self.queue.append(fresh)
        # entries older than the largest delay have been used by every parameter
        del self.queue[:max(0, len(self.queue) - max(self.delays))]
        if watch:
            self._before = [p.detach().clone() for p in self.params]
        if applying:
            self.optimizer.step()
            self.num_applied += 1

    @torch.no_grad()
    def diagnostics(self) -> dict[str, float]:
        """Norms about the last step: `stale_grad_diff_norm` = ||g(t-1) - g(t)|| (from the
        second step on; per-parameter delays: ||g(t-d) - g(t)|| over the delayed parameters
        given a gradient) and `update_norm` = ||W(t+1) - W(t)|| (only after a watched step).

        Reads the gradients the last step left in `p.grad` (the applied g(t-1)): call it
        after `step()` and before the next `zero_grad()`, outside the timed step.
        """
        out: dict[str, float] = {}
        if self._before is not None:
            squares = [(p.detach() - b).float().pow(2).sum()
                       for p, b in zip(self.params, self._before, strict=True)]
            out["update_norm"] = torch.stack(squares).sum().sqrt().item()
            self._before = None
        latest = self.stale if self.delays is None else (self.queue[-1] if self.queue
                                                              else None)
        if self.num_applied and latest is not None:
            squares = [(p.grad - g).float().pow(2).sum()
                       for p, g in zip(self.params, latest, strict=True)
                       if p.grad is not None and g is not None]
            if squares:
                out["stale_grad_diff_norm"] = torch.stack(squares).sum().sqrt().item()
        return out

    def state_dict(self) -> dict:
        if self.delays is not None:
            return {"optimizer": self.optimizer.state_dict(), "delays": list(self.delays),
                    "queue": [[_copy(g) for g in entry] for entry in self.queue],
                    "num_applied": self.num_applied}
        return {
            "optimizer": self.optimizer.state_dict(),
            "stale": None if self.stale is None else [_copy(g) for g in self.stale],
            **self.correction.state_dict(),
            "num_applied": self.num_applied,
        }

    def load_state_dict(self, state: dict) -> None:
        if (self.delays is None) != ("delays" not in state) or \
                ("delays" in state and list(state["delays"]) != self.delays):
            raise ValueError(
                f"delayed-optimizer state of per-parameter delays "
                f"{_summary(state.get('delays'))}, this run's are "
                f"{_summary(self.delays)}: not this run's checkpoint (optim.delay_profile "
                "or optim.delay_stages differ)")
        self.optimizer.load_state_dict(state["optimizer"])
        devices = [p.device for p in self.params]
        if self.delays is not None:
            self.queue = [_to_devices(entry, devices) for entry in state["queue"]]
        else:
            self.stale = _to_devices(state["stale"], devices)
            self.correction.load_state_dict(state, devices)
        self.num_applied = state["num_applied"]
        self._shifted, self._watch, self._before = False, False, None


def _delays_of(params: list[torch.Tensor], delays: Mapping[int, int]) -> list[int]:
    """`delays` ({id(parameter): steps}) in `params` order, each an integer >= 0."""
    out = []
    for i, p in enumerate(params):
        d = delays.get(id(p))
        if d is None:
            raise ValueError(f"per-parameter delays: the optimizer's parameter {i} "
                             f"({tuple(p.shape)}) has no delay")
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"per-parameter delays must be integers >= 0, got {d!r} "
                             f"for parameter {i}")
        out.append(d)
    return out


def _summary(delays: list[int] | None) -> str:
    """Per-parameter delays in a few words: 'none' (uniform) or their values."""
    return "none (uniform)" if delays is None else str(sorted(set(delays)))


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def _to_devices(tensors, devices) -> list | None:
    if tensors is None:
        return None
    if len(tensors) != len(devices):
        raise ValueError(f"delayed-optimizer state holds {len(tensors)} tensors, the model "
                         f"has {len(devices)} parameters: not this model's checkpoint")
    return [None if t is None else t.detach().clone().to(d) for t, d in zip(tensors, devices,
                                                                          strict=True)]
