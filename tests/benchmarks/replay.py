"""Feeding times measured inside gloo ranks to pytest-benchmark, so the gate compares them.

    @pytest.mark.benchmark(timer=CLOCK.now)
    def test_x(benchmark):
        replay(benchmark, samples)        # one round per sample, each lasting that sample

A multi-process hot path (an outer step, a gossip round) is timed inside the ranks, with
a barrier before each sample and the slowest rank's time kept; timing the parent would
measure process start-up. pytest-benchmark reads time from a timer it calls before and
after each round; CLOCK is that timer, advanced by exactly one sample per round, so the
saved statistics (min, median, ...) are those of the samples. The same path carries a
dimensionless ratio (ours / bare torch DDP): the gate then compares the ratio.
"""

from __future__ import annotations


class ReplayClock:
    """A clock that moves only when told to: by one recorded sample per round."""

    def __init__(self):
        self.value = 0.0
        self.samples: list[float] = []

    def now(self) -> float:
        return self.value

    def advance(self) -> None:
        self.value += self.samples.pop(0)


CLOCK = ReplayClock()


def replay(benchmark, samples: list[float]) -> None:
    """Record `samples` as the rounds of `benchmark` (whose timer must be CLOCK.now)."""
    if not samples:
        raise ValueError("replay needs at least one sample")
    CLOCK.samples = list(samples)
    benchmark.pedantic(CLOCK.advance, rounds=len(samples), iterations=1, warmup_rounds=0)


def slowest_rank(per_rank: list[list[float]]) -> list[float]:
    """Sample k of a multi-rank timing: the slowest rank's k-th time (the step's real length)."""
    return [max(column) for column in zip(*per_rank, strict=True)]
