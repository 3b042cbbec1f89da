"""`commbench whatif`'s speed: the planner's sweep of the methods people plan with.

    python tests/benchmarks/gate.py -k whatif     # or: tox -e bench

A 1B model (size-only, 24 equal blocks) on 64 GPUs (8 nodes x 8, one replica a node),
1-400 Gbit/s between the nodes, 41 bandwidths and five target utilisations bisected per
method (bench/study/whatif/report.py `evaluate`): DDP, DiLoCo, Pier, GASLoC (H = 100).
Issue 48 asks for <= 5 s on this 2-core machine; asserted on the fastest of three
evaluations after one that pays the imports (the gate compares minima too).
"""

from __future__ import annotations

import time

import pytest

from bench.study.whatif.report import evaluate
from bench.study.whatif.scenario import load_scenario

pytestmark = pytest.mark.bench

LIMIT_S = 5.0
"""Issue 48's bound on one sweep of the methods below."""
METHODS = {
    "ddp": {"strategy": {"name": "ddp"}},
    "diloco": {"strategy": {"name": "diloco", "inner_steps": 100}},
    "pier": {"strategy": {"name": "pier", "inner_steps": 100}},
    "gasloc": {"strategy": {"name": "gasloc", "inner_steps": 100},
               "parallel": {"group_size": 1}},
    "streaming": {"strategy": {"name": "diloco", "inner_steps": 96, "fragments": 8}},
    "streaming+fp4": {"strategy": {"name": "diloco", "inner_steps": 96, "fragments": 8,
                                   "outer_compression": "fp4"}},
    "streaming+overlap": {"strategy": {"name": "diloco", "inner_steps": 96, "fragments": 8,
                                       "overlap_steps": 1, "mix_alpha": 0.5}},
}


def scenario():
    return load_scenario("configs/whatif/llama1b-8x8.yaml", [
        f"methods={METHODS}", "model_size.num_params=1e9", "model_size.n_layer=24",
        "base.model.n_layer=24"])  # the run config's blocks: fragments <= blocks


def test_whatif_sweep_of_the_planned_methods(benchmark):
    """Every method of METHODS priced over the sweep in <= LIMIT_S."""
    s = scenario()
    evaluate(s)  # imports and first-use costs, not the planner's
    times = []

    def sweep():
        started = time.perf_counter()
        results = evaluate(s)
        times.append(time.perf_counter() - started)
        return results

    results = benchmark.pedantic(sweep, rounds=3, iterations=1)
    assert [r.name for r in results] == list(METHODS)
    benchmark.extra_info["methods"] = len(METHODS)
    assert min(times) <= LIMIT_S, f"whatif sweep of {len(METHODS)} methods: {min(times):.2f} s"
