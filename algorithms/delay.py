"""One-step gradient delay around any torch optimizer, with an error-feedback correction.

    commbench run configs/ddp-tiny.yaml --set optim.delay=1 --set optim.delay_correction=ef
    pytest tests/test_delay.py

The emulation (arXiv 2606.30634; docs/algorithms.md, "One-step delay and error feedback")
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
So g(0) and g(1) are both taken at W(0), and for t >= 1 the gradient applied at step t
was taken one update earlier than the weights it is applied to.

Error feedback (`correction="ef"`) is a RECONSTRUCTION: the paper describes an update-level
correction that mixes two consecutive delayed updates with one extra model-sized buffer;
its equations were not available. Ours: with u(t) = W_after - W_before the optimizer's own
update at step t, apply ũ(t) = u(t) + λ (u(t) - u(t-1)) instead (`ef_correction`; no
correction at the first applied step, which has no u(t-1)). u(t-1) is the extra buffer.

State: the stored gradient, u(t-1) and the step count are in `state_dict()` next to the
wrapped optimizer's, so a resumed run continues bit-exactly.
"""

from __future__ import annotations

import torch

CORRECTIONS = ("none", "ef")


def ef_correction(update: torch.Tensor, previous_update: torch.Tensor,
                  ef_lambda: float) -> torch.Tensor:
    """The corrected update ũ(t) = u(t) + λ (u(t) - u(t-1)) (reconstruction, see module doc).

    Pure: returns a new tensor. Replace this function to try another form of the
    correction; the wrapper applies whatever update it returns.
    """
    return update + ef_lambda * (update - previous_update)


class DelayedOptimizer:
    """Applies each step's gradient one step late through the wrapped optimizer.

    Looks like a torch optimizer to the strategies: `step()`, `zero_grad()`,
    `param_groups` (the wrapped optimizer's, so learning-rate schedules reach it),
    `state_dict()`/`load_state_dict()`. See the module docstring for the exact rule.

    Diagnostics: after a step, `diagnostics()` returns the norm of the stale-minus-fresh
    gradient (g(t-1) - g(t)) and, if `watch_next_step()` was called before that step, the
    norm of the update applied to the weights. Call it before the next `zero_grad()`.
    """

    def __init__(self, optimizer, delay: int = 1, correction: str = "none",
                 ef_lambda: float = 1.0):
        if delay != 1:
            raise ValueError(f"optim.delay must be 1 for a DelayedOptimizer, got {delay!r}")
        if correction not in CORRECTIONS:
            raise ValueError(f"optim.delay_correction must be one of {list(CORRECTIONS)}, "
                             f"got {correction!r}")
        self.optimizer = optimizer
        self.correction = correction
        self.ef_lambda = float(ef_lambda)
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.stale: list[torch.Tensor | None] | None = None
        """g(t-1) per parameter (None: no gradient); None before the first step."""
        self.previous_update: list[torch.Tensor] | None = None
        """u(t-1) per parameter (error feedback); None before the first applied update."""
        self.num_applied = 0
        """Updates applied so far (= steps taken - 1 once the first step has run)."""
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

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("DelayedOptimizer.step does not take a closure")
        fresh = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
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
        ef = self.correction == "ef"
        before = [p.detach().clone() for p in self.params] if (ef or watch) else None
        self.optimizer.step()
        if ef:
            self._apply_ef(before)
        self.num_applied += 1
        self._before = before if watch else None

    def _apply_ef(self, before: list[torch.Tensor]) -> None:
        updates = [p.detach() - b for p, b in zip(self.params, before, strict=True)]
        if self.previous_update is not None:
            pairs = zip(self.params, updates, self.previous_update, strict=True)
            for p, update, previous in pairs:
                # p is W_before + u; adding (ũ - u) keeps λ = 0 bit-identical to no correction
                p.add_(ef_correction(update, previous, self.ef_lambda) - update)
        self.previous_update = updates

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
            "previous_update": (None if self.previous_update is None
                                else [_copy(u) for u in self.previous_update]),
            "num_applied": self.num_applied,
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        devices = [p.device for p in self.params]
        self.stale = _to_devices(state["stale"], devices)
        self.previous_update = _to_devices(state["previous_update"], devices)
        self.num_applied = state["num_applied"]
        self._watch, self._before = False, None


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
