"""The outer SGD rule, with momentum and optionally Nesterov's: DiLoCo's (arXiv 2311.08105).

    pytest tests/test_diloco.py tests/test_outer_rules.py

torch's `SGD` on the global θ with the round's Δ as θ's gradient; in its
`SGD(nesterov=True)` form the step is `m ← μ m + Δ; θ ← θ − η (Δ + μ m)` (without Nesterov
`θ ← θ − η m`). The math: docs/algorithms.md, DiLoCo. Pier's lazy start fills the momentum
without a step (`fill_momentum`).
"""

from __future__ import annotations

import torch

from algorithms.outer_rules import OuterRule, set_gradients


class SGDRule(OuterRule):
    """SGD with momentum μ (Nesterov's when `nesterov`) and lr η, both set per round."""

    def __init__(self, params: list[torch.Tensor], lr: float = 0.7, momentum: float = 0.9,
                 nesterov: bool = True):
        super().__init__(params)
        self.nesterov = nesterov
        # torch rejects nesterov without momentum; with μ = 0 the two are the same step
        self.optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum,
                                         nesterov=nesterov and momentum > 0)

    @classmethod
    def from_config(cls, params, config) -> SGDRule:
        return cls(params, lr=config.outer_lr, momentum=config.outer_momentum,
                   nesterov=config.nesterov)

    @classmethod
    def states(cls, config) -> int:
        return int(config.outer_momentum > 0)  # the momentum buffer

    def set_hyperparameters(self, lr: float, momentum: float) -> None:
        group = self.optimizer.param_groups[0]
        group["lr"] = lr
        group["momentum"] = momentum
        group["nesterov"] = self.nesterov and momentum > 0

    @torch.no_grad()
    def step(self, delta: torch.Tensor, lr: float, momentum: float) -> None:
        set_gradients(self.params, delta)
        self.set_hyperparameters(lr, momentum)
        self.optimizer.step()
        for g in self.params:
            g.grad = None

    @torch.no_grad()
    def fill_momentum(self, deltas: list[torch.Tensor], momentum: float) -> None:
        for g, delta in zip(self.params, deltas, strict=True):
            state = self.optimizer.state[g]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = delta  # torch SGD's first step: m = Δ
            else:
                state["momentum_buffer"].mul_(momentum).add_(delta)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
