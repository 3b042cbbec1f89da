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

State: the stored gradient, u(t-1) and the step count are in `state_dict()` next to the
wrapped optimizer's, so a resumed run continues bit-exactly.
"""

from __future__ import annotations

from collections import defaultdict

import torch

CORRECTIONS = ("none", "ef", "predict")


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

    Diagnostics: after a step, `diagnostics()` returns the norm of the stale-minus-fresh
    gradient (g(t-1) - g(t)) and, if `watch_next_step()` was called before that step, the
    norm of the update applied to the weights. Call it before the next `zero_grad()`.
    """

    def __init__(self, optimizer, delay: int = 1, correction: str = "none",
                 ef_lambda: float = 1.0):
        if delay != 1:
            raise ValueError(f"optim.delay must be 1 for a DelayedOptimizer, got {delay!r}")
        self.optimizer = optimizer
        self.correction = DelayCorrection(correction, ef_lambda)
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.stale: list[torch.Tensor | None] | None = None
        """g(t-1) per parameter (None: no gradient); None before the first step."""
        self.num_applied = 0
        """Updates applied so far (= steps taken - 1 once the first step has run)."""
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
    def diagnostics(self) -> dict[str, float]:
        """Norms about the last step: `stale_grad_diff_norm` = ||g(t-1) - g(t)|| (from the
        second step on) and `update_norm` = ||W(t+1) - W(t)|| (only after a watched step).

        Reads the gradients the last step left in `p.grad` (the applied g(t-1)): call it
        after `step()` and before the next `zero_grad()`, outside the timed step.
        """
        out: dict[str, float] = {}
        if self._before is not None:
            squares = [(p.detach() - b).float().pow(2).sum()
                       for p, b in zip(self.params, self._before, strict=True)]
            out["update_norm"] = torch.stack(squares).sum().sqrt().item()
            self._before = None
        if self.num_applied and self.stale is not None:
            squares = [(p.grad - g).float().pow(2).sum()
                       for p, g in zip(self.params, self.stale, strict=True)
                       if p.grad is not None and g is not None]
            if squares:
                out["stale_grad_diff_norm"] = torch.stack(squares).sum().sqrt().item()
        return out

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "stale": None if self.stale is None else [_copy(g) for g in self.stale],
            **self.correction.state_dict(),
            "num_applied": self.num_applied,
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        devices = [p.device for p in self.params]
        self.stale = _to_devices(state["stale"], devices)
        self.correction.load_state_dict(state, devices)
        self.num_applied = state["num_applied"]
        self._shifted, self._watch, self._before = False, False, None


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
