"""Pricing a pipeline step on its critical path, not op by op.

Used by bench/meter.py's StepClock for the overlap-aware projection of strategies that
describe their step's critical path (`Strategy.critical_path()`, algorithms/base.py:
the pipelines); tested by `pytest tests/test_pipeline.py -k critical_path`. The model
(docs/algorithms.md, Pipelines, "Projection"):

    t_step = slots * max(c, 2 * tau) + hops * tau + t_other

- `c` = the rank's measured compute per microbatch slot: its compute seconds of the step
  (step_s - comm_s, the bubble and transfers excluded) over `work_slots` (M);
- `tau` = the modelled seconds of one activation transfer on the profile: the largest of
  the step's point-to-point records (send / recv / exchange) priced by `pricer`;
  inside a slot the forward activation and the backward gradient of other microbatches
  travel while the stage computes, so a slot lasts `max(c, 2 tau)`;
- `slots` = the schedule's length in slots: M + S - 1 with a flush (1F1B, GPipe), M
  without one (PipeDream-2BW's steady state);
- `hops` = transfers that no compute hides: with a flush, the first microbatch's
  activation crosses S - 1 boundaries forward and the last one's gradient S - 1 back
  (2 (S - 1)); 0 without a flush;
- `t_other` = every other record of the step (data-parallel and tied-weight all-reduces,
  the clipping norm) priced as the plain projection does, after the last backward.

The per-record projection instead adds a rank's every transfer to its compute and
leaves the bubble out: it over-prices transfers that overlap compute (2M per end stage
instead of 2(S - 1)) and under-prices a flushed schedule by its (S - 1) idle slots.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from algorithms.comm import CommRecord
from bench.network.costs import P2P
from bench.network.model import pricer
from bench.network.profiles import Profile


def critical_path_step_s(compute_s: float, records: Iterable[CommRecord], profile: Profile,
                         slots: int, work_slots: int, hops: int, rank: int = 0,
                         ranks_per_node: int = 1, *, backend: str | None = None) -> float:
    """Modelled seconds of one pipeline step of this rank (module docstring's formula)."""
    tau, other = critical_path_inputs(records, pricer(profile, rank, ranks_per_node,
                                                      backend=backend))
    return critical_path_time(compute_s, tau, other, slots, work_slots, hops)


def critical_path_inputs(records: Iterable[CommRecord],
                         price: Callable[[CommRecord], float]) -> tuple[float, float]:
    """(tau, t_other) of a step's records: the largest point-to-point transfer's modelled
    seconds and every other record's, summed (`price`: `bench.network.model.pricer`)."""
    p2p, other = [], 0.0
    for r in records:
        if r.op in P2P:
            p2p.append(price(r))
        else:
            other += price(r)
    return max(p2p, default=0.0), other


def critical_path_time(compute_s: float, tau: float, other: float, slots: int,
                       work_slots: int, hops: int) -> float:
    """slots * max(c, 2 tau) + hops * tau + t_other, c = compute_s / work_slots."""
    if work_slots < 1 or slots < work_slots or hops < 0:
        raise ValueError(f"critical path: need 1 <= work_slots <= slots and hops >= 0, got "
                         f"slots={slots}, work_slots={work_slots}, hops={hops}")
    return slots * max(compute_s / work_slots, 2 * tau) + hops * tau + other
