"""Compute that means the same for every method when ranks share cores (issue 50).

4 gloo ranks on 2 cores: DDP's and DiLoCo's compute per rank-step (medians of 3 runs)
agree within 10%, and each is within 15% of the same run at 2 ranks, where no rank waits
for a core. On the wall clock they did not: DDP's waits for descheduled peers landed in
its exposed communication and everyone else's in compute (DDP 26-29 ms against DiLoCo
40-42 ms a rank-step at 4 ranks). Ratios measured in one session, saved with the
benchmark (`tox -e bench`); needs 2 cores to mean what it says.
"""

import statistics
from pathlib import Path

import pytest
import torch

from bench.config import load_config
from bench.env import cores_available
from bench.run.train import Trainer
from tests.benchmarks.replay import CLOCK, replay
from tests.distributed import run_distributed

pytestmark = pytest.mark.bench

STEPS = 40
AGREE, AGAINST_2_RANKS = 0.10, 0.15
KIND = {"ddp": "train:all_reduce", "diloco": "no traffic"}
"""The steps compared: DDP's every step, DiLoCo's inner steps (its outer ones add work)."""


def _compute_per_step(rank, world_size, method, run_dir):
    cfg = load_config(f"configs/{method}-tiny.yaml", [
        f"run.steps={STEPS}", "run.val_every=0", "run.log_every=10", "run.val_sequences=8",
        "checkpoint.final=false", "checkpoint.every=0", f"parallel.world_size={world_size}"])
    summary = Trainer(cfg, Path(run_dir) / f"{method}-{world_size}", torch.device("cpu"),
                      "gloo").run()
    return statistics.median(summary["compute_per_step"][KIND[method]]["median_s"])


@pytest.mark.timeout(900)
@pytest.mark.benchmark(timer=CLOCK.now)
def test_compute_per_rank_step_agrees_across_methods_when_ranks_share_cores(benchmark,
                                                                            tmp_path):
    if cores_available() > 2:
        pytest.skip("4 ranks must share 2 cores: run on a 2-core machine")
    medians = {}
    for world in (2, 4):
        for method in KIND:
            runs = [run_distributed(_compute_per_step, world, method, str(tmp_path / str(i)),
                                    timeout=300)[0] for i in range(3)]
            medians[method, world] = statistics.median(runs)
    ratio_4 = medians["diloco", 4] / medians["ddp", 4]
    replay(benchmark, [ratio_4])
    for (method, world), seconds in medians.items():
        benchmark.extra_info[f"{method}_{world}_ranks_compute_ms"] = 1e3 * seconds
    benchmark.extra_info["diloco_over_ddp_4_ranks"] = ratio_4
    print("\ncompute per rank-step (ms, medians of 3):",
          {f"{m} x{w}": round(1e3 * s, 1) for (m, w), s in medians.items()})
    assert abs(ratio_4 - 1) <= AGREE, medians
    for method in KIND:
        assert abs(medians[method, 4] / medians[method, 2] - 1) <= AGAINST_2_RANKS, medians
