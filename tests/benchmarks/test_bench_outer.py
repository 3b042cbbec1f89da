"""Outer-step and gossip-round benchmarks on 2 gloo ranks, and torchft's outer step beside ours.

    python tests/benchmarks/gate.py -k "outer or gossip"     # or: tox -e bench

Each hot path is timed inside the ranks on the tiny GPT (barrier before each sample, the
slowest rank kept) and replayed into pytest-benchmark (replay.py), so the gate compares
the step itself, not process start-up. Before each sample every rank moves its weights
by its own seeded noise: the stand-in for the inner steps, so the rounds carry real
pseudo-gradients. test_outer_step_against_torchft runs torchft's DiLoCo (PyPI `torchft`,
the `bench` extra: its Manager, lighthouse and process group) and ours (algorithms/outer.py,
docs/algorithms.md) on the same model, ranks and noise, in one run: it prints ours /
torchft's median outer-step time, checks that both end with the same parameters, and
saves the per-round ratio (the figure the gate compares for this benchmark).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from algorithms.comm import CommLedger, Communicator
from algorithms.gasloc import gossip_mix, mixing_weights, round_peers
from algorithms.outer import OuterOptimizer
from bench.model import GPT, gpt_config
from tests.benchmarks.replay import CLOCK, replay, slowest_rank
from tests.distributed import run_distributed
from tests.helpers import assert_same_params, params_of

pytestmark = pytest.mark.bench

ROUNDS = 40
OUTER = {"lr": 0.7, "momentum": 0.9}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", 256, 128))


@torch.no_grad()
def _inner_steps_stand_in(model: torch.nn.Module, generator: torch.Generator) -> None:
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=generator), alpha=1e-3)


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _outer_step_times(rank, world_size, rounds):
    model = _model()
    comm = Communicator(rank, world_size, "cpu", CommLedger())
    outer = OuterOptimizer(model.parameters(), comm, None, world_size, kind="sgd",
                           nesterov=True, **OUTER)
    noise = torch.Generator().manual_seed(rank + 1)
    times = []
    for _ in range(rounds):
        _inner_steps_stand_in(model, noise)
        times.append(_timed(lambda: outer.step(OUTER["lr"], OUTER["momentum"])))
    return times


def _gossip_round_times(rank, world_size, rounds):
    model = _model()
    params = list(model.parameters())
    comm = Communicator(rank, world_size, "cpu", CommLedger())
    noise = torch.Generator().manual_seed(rank + 1)

    def gossip_round(index):
        weights = mixing_weights(round_peers("random-matching", world_size, 0, index), rank, 1.0)
        mixed = gossip_mix(comm, parameters_to_vector(params).detach(), weights)
        with torch.no_grad():
            vector_to_parameters(mixed, params)

    times = []
    for index in range(rounds):
        _inner_steps_stand_in(model, noise)
        times.append(_timed(lambda: gossip_round(index)))  # noqa: B023 (called at once)
    return times


@pytest.mark.timeout(300)
@pytest.mark.benchmark(timer=CLOCK.now)
def test_outer_step(benchmark):
    replay(benchmark, slowest_rank(run_distributed(_outer_step_times, 2, ROUNDS, timeout=240)))


@pytest.mark.timeout(300)
@pytest.mark.benchmark(timer=CLOCK.now)
def test_gossip_round(benchmark):
    replay(benchmark, slowest_rank(run_distributed(_gossip_round_times, 2, ROUNDS, timeout=240)))


def _torchft_and_ours(rank, world_size, rounds, lighthouse_addr):
    """Both engines on the same model and noise; returns (our times, torchft's, params)."""
    from datetime import timedelta

    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    ours_model, theirs_model = _model(), _model()
    comm = Communicator(rank, world_size, "cpu", CommLedger())
    ours = OuterOptimizer(ours_model.parameters(), comm, None, world_size, kind="sgd",
                          nesterov=True, **OUTER)

    # torchft: each rank is a replica group of one; the lighthouse forms the quorum of 2
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=60)), min_replica_size=world_size,
        load_state_dict=theirs_model.load_state_dict, state_dict=theirs_model.state_dict,
        use_async_quorum=False, rank=0, world_size=1, store_addr="127.0.0.1",
        store_port=store.port, lighthouse_addr=lighthouse_addr, replica_id=f"bench{rank}",
        timeout=timedelta(seconds=60), init_sync=False,
    )
    inner = torch.optim.SGD(theirs_model.parameters(), lr=0.0)  # its step fires the sync
    outer = torch.optim.SGD(theirs_model.parameters(), lr=OUTER["lr"],
                            momentum=OUTER["momentum"], nesterov=True)
    noise = {"ours": torch.Generator().manual_seed(rank + 1),
             "theirs": torch.Generator().manual_seed(rank + 1)}
    times = {"ours": [], "theirs": []}
    with DiLoCo(manager, [theirs_model], inner, outer, sync_every=1):
        for _ in range(rounds):
            _inner_steps_stand_in(ours_model, noise["ours"])
            times["ours"].append(_timed(lambda: ours.step(OUTER["lr"], OUTER["momentum"])))
            _inner_steps_stand_in(theirs_model, noise["theirs"])
            times["theirs"].append(_timed(inner.step))
    manager.shutdown(wait=False)
    return times["ours"], times["theirs"], params_of(ours_model), params_of(theirs_model)


@pytest.mark.timeout(400)
@pytest.mark.benchmark(timer=CLOCK.now)
def test_outer_step_against_torchft(benchmark):
    pytest.importorskip("torchft", reason="torchft is in the bench extra: pip install -e '.[bench]'")
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        results = run_distributed(_torchft_and_ours, 2, ROUNDS + 3, lighthouse.address(),
                                  timeout=300)
    finally:
        lighthouse.shutdown()
    for _, _, ours_params, theirs_params in results:
        assert_same_params(ours_params, theirs_params)  # the same outer math, step for step
    # the first rounds form torchft's quorum and process group: compare the steady state
    ours = slowest_rank([r[0][3:] for r in results])
    theirs = slowest_rank([r[1][3:] for r in results])
    ratio = statistics.median(ours) / statistics.median(theirs)
    benchmark.extra_info.update(ours_over_torchft=ratio, ours_median_s=statistics.median(ours),
                                torchft_median_s=statistics.median(theirs))
    # saved and gated: the per-round ratio, so that the gate follows our cost relative to
    # torchft's on the same machine at the same moment
    replay(benchmark, [o / t for o, t in zip(ours, theirs, strict=True)])
    print(f"\nouter step, ours / torchft's DiLoCo (median of {len(ours)} rounds, 2 gloo ranks, "
          f"tiny GPT): {statistics.median(ours) * 1e3:.2f} ms / "
          f"{statistics.median(theirs) * 1e3:.2f} ms = {ratio:.3f}")
