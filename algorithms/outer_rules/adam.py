"""The outer Adam rule: torch's `Adam` on the global θ with the round's Δ as its gradient.

    pytest tests/test_diloco.py -k adam

betas = (`outer_momentum`, `outer_beta2`); the lr and beta1 are set per round. The math:
docs/algorithms.md, DiLoCo (`outer_optimizer: adam`).
"""

from __future__ import annotations

import torch

from algorithms.outer_rules import OuterRule, set_gradients


class AdamRule(OuterRule):
    """Adam with lr η and betas (μ, beta2); two state tensors per parameter."""

    def __init__(self, params: list[torch.Tensor], lr: float = 0.7, momentum: float = 0.9,
                 beta2: float = 0.999):
        super().__init__(params)
        self.optimizer = torch.optim.Adam(params, lr=lr, betas=(momentum, beta2))

    @classmethod
    def from_config(cls, params, config) -> AdamRule:
        return cls(params, lr=config.outer_lr, momentum=config.outer_momentum,
                   beta2=config.outer_beta2)

    @classmethod
    def states(cls, config) -> int:
        return 2  # first and second moments

    @torch.no_grad()
    def step(self, delta: torch.Tensor, lr: float, momentum: float) -> None:
        set_gradients(self.params, delta)
        group = self.optimizer.param_groups[0]
        group["lr"] = lr
        group["betas"] = (momentum, group["betas"][1])
        self.optimizer.step()
        for g in self.params:
            g.grad = None

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
