"""Streaming DiLoCo's pieces: the model cut into fragments, which fragment syncs when.

    commbench run configs/streaming-diloco-tiny.yaml
    pytest tests/test_streaming.py

The math and its source (Douillard et al. 2025, arXiv 2501.18512) are docs/algorithms.md
("Streaming DiLoCo"); algorithms/diloco.py runs the rounds (`DiLoCo.after_inner_step`),
each fragment with its own `algorithms.outer.OuterOptimizer`. Kept apart from outer.py
because it is one concept of its own: a partition of the parameters and a schedule over
it; with `fragments: 1, overlap_steps: 0` it is DiLoCo's every-H-steps round exactly.

- `fragment_indices(model, P, pattern)`: which parameters form each fragment. Over the
  transformer blocks of `model.as_layers()` (`[embedding, block * L, head]`, the layers
  whose sequential application is the model): `strided` puts block b in fragment b mod P
  (the paper's choice: a fragment spans the depth), `sequential` cuts the blocks into P
  contiguous runs (sizes differ by at most one). The embedding goes with block 0's
  fragment, the head (with the final norm) with block L-1's; a tied head weight is the
  embedding's and goes with it.
- `StreamingSchedule(P, H, tau, T)`: fragment p's sync points are the steps s (steps
  taken, 1-based) with s mod H = floor((p + 1) H / P) mod H, so each fragment syncs every
  H steps, round-robin from fragment 0, one every H/P steps when P divides H; otherwise
  the gaps between consecutive fragments are floor(H/P) or ceil(H/P) (the paper's H = 100
  with P = 8: 12 or 13 steps). With tau > 0 a fragment's exchange is launched at the end
  of step s - tau, if s <= T; tau must be below the shortest gap. At the last step T every
  fragment not synced there syncs too, blocking (the final round: no inner work is lost,
  as DiLoCo's last shorter round).
- `Fragments`: the fragments' outer optimizers seen as one: the replica's parameters and
  the global θ in the model's parameter order (evaluation, checkpoints), and the exchange
  in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from algorithms.base import unwrap
from algorithms.comm import Communicator, Group, Pending
from algorithms.outer import OuterOptimizer

FRAGMENT_PATTERNS = ("strided", "sequential")


def block_fragments(num_blocks: int, fragments: int, pattern: str) -> list[int]:
    """The fragment of each of `num_blocks` transformer blocks."""
    if pattern not in FRAGMENT_PATTERNS:
        raise ValueError(f"strategy.fragment_pattern must be one of {list(FRAGMENT_PATTERNS)}, "
                         f"got {pattern!r}")
    if not 1 <= fragments <= num_blocks:
        raise ValueError(f"strategy.fragments ({fragments}) must be between 1 and the model's "
                         f"number of blocks ({num_blocks})")
    if pattern == "strided":
        return [b % fragments for b in range(num_blocks)]
    return [b * fragments // num_blocks for b in range(num_blocks)]


def fragment_indices(model: nn.Module, fragments: int, pattern: str) -> list[list[int]]:
    """Per fragment, the indices into `list(model.parameters())` of its parameters (module
    docstring). One fragment: all of them, whatever the model."""
    params = list(model.parameters())
    if fragments == 1:
        return [list(range(len(params)))]
    layers = unwrap(model).as_layers()
    of_block = block_fragments(len(layers) - 2, fragments, pattern)
    of_layer = [of_block[0], *of_block, of_block[-1]]  # embedding, blocks, head
    owner: dict[int, int] = {}
    for layer, fragment in zip(layers, of_layer, strict=True):
        for p in layer.parameters():
            owner.setdefault(id(p), fragment)  # a tied weight stays with its first layer
    groups: list[list[int]] = [[] for _ in range(fragments)]
    for i, p in enumerate(params):
        if id(p) not in owner:
            raise ValueError(f"parameter {i} of the model is in none of its layers "
                             "(model.as_layers()): cannot assign it a fragment")
        groups[owner[id(p)]].append(i)
    return groups


def check_fragments(fragments: int, inner_steps: int, overlap_steps: int) -> None:
    """The schedule's rules on `strategy.fragments`, `inner_steps`, `overlap_steps`: at most
    one fragment syncs a step (P <= H), and an exchange is launched after the previous
    fragment's sync (tau below the shortest gap, floor(H / P))."""
    if not 1 <= fragments <= inner_steps:
        raise ValueError(f"strategy.fragments ({fragments}) must be between 1 and "
                         f"strategy.inner_steps ({inner_steps}): one fragment syncs a step "
                         "at most")
    gap = inner_steps // fragments
    if not 0 <= overlap_steps < gap:
        raise ValueError(f"strategy.overlap_steps must be in [0, floor(inner_steps / "
                         f"fragments) = {gap}), got {overlap_steps!r}")


@dataclass(frozen=True)
class StreamingSchedule:
    """Which fragment syncs at the end of which step (module docstring)."""

    num_fragments: int
    inner_steps: int
    overlap_steps: int
    total_steps: int

    def __post_init__(self):
        check_fragments(self.num_fragments, self.inner_steps, self.overlap_steps)

    def offset(self, fragment: int) -> int:
        """Fragment `fragment`'s sync point within a round of H steps (1..H)."""
        return (fragment + 1) * self.inner_steps // self.num_fragments

    def regular(self, step: int) -> int | None:
        """The fragment whose sync point `step` is (None: none)."""
        if step < 1 or step > self.total_steps:
            return None
        within = (step - 1) % self.inner_steps + 1
        p, r = self.num_fragments, self.inner_steps
        fragment = -(-within * p // r) - 1  # the one fragment whose offset could be `within`
        return fragment if self.offset(fragment) == within else None

    def launch(self, step: int) -> int | None:
        """The fragment whose exchange is launched at the end of `step` (overlap only)."""
        if self.overlap_steps == 0:
            return None
        return self.regular(step + self.overlap_steps)

    def syncs(self, step: int) -> list[int]:
        """The fragments synced at the end of `step`: its regular one and, at the last
        step, every other one (the final round)."""
        regular = self.regular(step)
        synced = [] if regular is None else [regular]
        if step == self.total_steps:
            synced += [f for f in range(self.num_fragments) if f != regular]
        return synced

    def syncs_before(self, fragment: int, step: int) -> int:
        """How many times `fragment` synced at the end of the steps before `step` (its
        regular sync points offset, offset + H, ... below `step`; the final round is the
        last step and precedes none): the index of a sync at `step` among the fragment's
        own (NoLoCo's per-fragment round, which seeds its pairs)."""
        return max(0, -(-(step - self.offset(fragment)) // self.inner_steps))

    def all_synced(self, step: int) -> bool:
        """Whether every fragment synced at the end of `step` (or nothing has run yet)."""
        return step == 0 or len(self.syncs(step)) == self.num_fragments


class Fragments:
    """The fragments' outer optimizers over one replica's parameters, seen as one."""

    def __init__(self, parts: list[OuterOptimizer], indices: list[list[int]]):
        self.parts = parts
        order = sorted((i, f, k) for f, idx in enumerate(indices) for k, i in enumerate(idx))
        self.params = [parts[f].params[k] for _, f, k in order]
        """The replica's parameters (or shards), in the model's parameter order."""
        self.global_params = [parts[f].global_params[k] for _, f, k in order]
        """The global θ, in the same order."""
        self.in_flight: tuple[int, Pending] | None = None
        """The fragment whose exchange is launched and not yet finished, and that exchange."""

    def warm_up(self, group: Group | None = None) -> None:
        """`OuterOptimizer.warm_up` of one fragment of each size (each size once)."""
        sizes = set()
        for part in self.parts:
            if part.numel() not in sizes:
                sizes.add(part.numel())
                part.warm_up(group)

    @torch.no_grad()
    def copy_global_to(self, params) -> None:
        """Copy the global θ of every fragment into `params` (model parameter order)."""
        for p, g in zip(params, self.global_params, strict=True):
            p.copy_(g)

    def state_dict(self) -> dict:
        """Each fragment's state, and the exchange in flight (waited for: a checkpoint
        taken while one runs holds its result; the wait is outside the clock)."""
        in_flight = None
        if self.in_flight is not None:
            fragment, pending = self.in_flight
            in_flight = {"fragment": fragment, **pending.state_dict()}
        return {"parts": [part.state_dict() for part in self.parts], "in_flight": in_flight}

    def load_state_dict(self, state: dict | list, comm: Communicator,
                        group: Group | None) -> None:
        if isinstance(state, dict) and "parts" not in state:  # one OuterOptimizer's, older
            state = {"parts": [state], "in_flight": None}
        for part, saved in zip(self.parts, state["parts"], strict=True):
            part.load_state_dict(saved)
        saved = state["in_flight"]
        self.in_flight = None if saved is None else (
            saved["fragment"], Pending.from_state(comm, group, saved))
