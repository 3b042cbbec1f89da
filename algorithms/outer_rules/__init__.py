"""Outer rules: what a local-update strategy (DiLoCo, Pier, Streaming DiLoCo) does with its
replicas' pseudo-gradients at the end of a round.

    pytest tests/test_outer_rules.py

The round's machinery (the global θ, Δ_i = θ − θ_i, the merge into the replica, launched
exchanges, the ledger) is algorithms/outer.py's `OuterOptimizer`; a rule is the part that
varies between methods: how Δ travels between the replicas (`OuterRule.exchange`: by
default the average, through the strategy's codec) and how it moves θ
(`OuterRule.step`). The math of each rule: docs/algorithms.md.

Adding a rule: a file in this folder with an `OuterRule` subclass (and, if the rule has
knobs of its own, a `DiLoCoConfig` subclass holding them and a `DiLoCo` subclass using
it, whose classmethods add its memory terms and, when its round sends otherwise,
`outer_transfers` or `traffic`, as sparseloco.py and noloco.py do), and one row in
`RULES` below. The row's class says, without training:
- `states(config)`: |θ|-sized buffers the rule keeps per parameter (the memory plan);
- `shards`: whether it works on a rank's shards of θ (FSDP2 replicas);
- `sends(config)`: what a round sends (the what-if: the collective, payload bytes per
  element of θ);
- `check(config, cfg)`: the combinations it refuses, with the reason.

The rules themselves are imported lazily (like the strategies of algorithms/base.py), so
that a rule's file may subclass the strategy it plugs into.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from algorithms.contract import load_registered

if TYPE_CHECKING:
    from algorithms.comm import Group, Pending
    from algorithms.outer import OuterOptimizer

RULES: dict[str, str] = {
    "sgd": "algorithms.outer_rules.sgd:SGDRule",
    "adam": "algorithms.outer_rules.adam:AdamRule",
    "sparseloco": "algorithms.outer_rules.sparseloco:SparseLoCoRule",
    "noloco": "algorithms.outer_rules.noloco:NoLoCoRule",
    "demo": "algorithms.outer_rules.demo:DeMoRule",
}
"""Rule name (`strategy.outer_optimizer`) -> "module:Class"."""


def rule_class(name: str) -> type[OuterRule]:
    return load_registered(RULES, name, "strategy.outer_optimizer")


def rule_factory(name: str, config) -> Callable[[list[torch.Tensor]], OuterRule]:
    """global θ (one fragment's tensors) -> the rule `name` built from the strategy's
    config (a `DiLoCoConfig`): the one hook through which DiLoCo, Pier and Streaming
    DiLoCo take their rule (one rule object per fragment: each has its own state)."""
    return functools.partial(rule_class(name).from_config, config=config)


@dataclass(frozen=True)
class Sends:
    """What one round of a rule sends per rank, for the what-if (algorithms/traffic.py)."""

    op: str
    """The ledger op: all_reduce, quantized_all_reduce, all_gather, exchange."""
    bytes_per_element: float
    """Payload bytes per element of this rank's θ (before the collective's own factor)."""
    peers: str = "group"
    """Who it goes to: "group" (every replica, across the cross group) or "pair" (one
    other replica, chosen per round)."""


class OuterRule:
    """One rule over the global θ of one fragment (`params`, updated in place).

    Subclasses implement `step` (and `from_config`); `exchange` and `warm_up` default to
    the replicas' average of Δ through the strategy's codec (`OuterOptimizer.average`).
    """

    shards: ClassVar[bool] = True
    """Works on a rank's shards of θ (each rank's outer step on its own shards)."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params

    @classmethod
    def from_config(cls, params: list[torch.Tensor], config) -> OuterRule:
        raise NotImplementedError

    # ------------------------------------------------------------ what it costs, before launch

    @classmethod
    def states(cls, config) -> int:
        """|θ|-sized tensors of state the rule keeps per parameter (the memory plan)."""
        raise NotImplementedError

    @classmethod
    def sends(cls, config) -> Sends:
        """What a round sends: the average of Δ in the strategy's wire format."""
        ops = {"none": "all_reduce", "topk": "all_gather"}
        return Sends(ops.get(config.outer_compression, "quantized_all_reduce"),
                     config.outer_bytes_per_element())

    @classmethod
    def check(cls, config, cfg) -> None:
        """Refuse, with the reason, what the rule cannot run with (the run config `cfg`)."""
        if cfg.parallel.shard == "fsdp" and not cls.shards:
            raise ValueError(f"strategy.outer_optimizer={config.outer_optimizer!r} does not "
                             "work on shards of θ: parallel.shard must be none")

    # ------------------------------------------------------------ the round

    def exchange(self, outer: OuterOptimizer, group: Group | None, launch: bool
                 ) -> torch.Tensor | Pending:
        """What `step` takes as its gradient, from this replica's Δ_i (`outer`'s
        `pseudo_gradient`) and the other replicas' (collective over `group`)."""
        return outer.average(group, launch)

    def warm_up(self, outer: OuterOptimizer, group: Group | None) -> None:
        """The round's exchange once, unrecorded, changing no state (NCCL connects lazily)."""
        outer.warm_up_average(group)

    def step(self, delta: torch.Tensor, lr: float, momentum: float) -> None:
        """θ ← the rule's update of θ with the flat `delta` (fp32 or the wire dtype)."""
        raise NotImplementedError

    def fill_momentum(self, deltas: list[torch.Tensor], momentum: float) -> None:
        """Pier's lazy start: `m ← μ m + Δ` without a step (SGD only)."""
        raise ValueError("momentum accumulation needs the sgd outer optimizer")

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError


def set_gradients(params: list[torch.Tensor], delta: torch.Tensor) -> None:
    """Hand the flat `delta` to a torch optimizer as the `.grad` of `params`, in order."""
    offset = 0
    for g in params:
        n = g.numel()
        g.grad = delta[offset:offset + n].view_as(g).to(device=g.device, dtype=g.dtype)
        offset += n
