"""Hot-path benchmarks (`tox -e bench`): ratios measured in one run, not wall-clock asserts.

- our DDP step (strategy + ledger hook) vs a bare torch DDP loop on the same model/ranks;
- the ledger, the network projection and the batch stream on their own.
"""

import statistics
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from algorithms.base import TrainSetup
from algorithms.comm import CommLedger, CommRecord, Communicator
from algorithms.ddp import DDP, DDPConfig
from bench.config import load_config
from bench.data import BatchStream
from bench.model import GPT, gpt_config
from bench.network import get_profile, project
from bench.train import make_optimizer_factory
from tests.distributed import run_distributed

pytestmark = pytest.mark.bench

OVERHEAD_LIMIT = 1.03


def _interleaved_ddp_timing(rank, world_size, rounds, steps_per_round):
    """Median step time of bare torch DDP and of our DDP strategy, interleaved in blocks."""
    cfg = load_config("configs/ddp-tiny.yaml", [f"parallel.world_size={world_size}"])
    torch.manual_seed(0)
    make_opt = make_optimizer_factory(cfg)
    stream = BatchStream(torch.randint(0, 256, (200_000,)).numpy().astype("uint16"), 128, 8,
                         rank, world_size, seed=0)

    bare_model = GPT(gpt_config("tiny", 256, 128))
    bare = DistributedDataParallel(bare_model)
    bare_opt = make_opt(bare_model)

    ours_model = GPT(gpt_config("tiny", 256, 128))
    comm = Communicator(rank, world_size, "cpu", CommLedger())
    setup = TrainSetup(model=ours_model, comm=comm, make_optimizer=make_opt, total_steps=10**6,
                       grad_clip=cfg.optim.grad_clip, rank_batch_size=8)
    ours = DDP(DDPConfig(), setup)

    def bare_step(batch):
        bare_opt.zero_grad(set_to_none=True)
        _, loss = bare(*batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(bare_model.parameters(), cfg.optim.grad_clip)
        bare_opt.step()
        loss.item()

    times = {"bare": [], "ours": []}
    step = 0
    for _ in range(rounds):
        for name, fn in (("bare", bare_step), ("ours", ours.train_step)):
            for _ in range(steps_per_round):
                batch = stream.batch(step)
                step += 1
                torch.distributed.barrier()
                t0 = time.perf_counter()
                fn(batch)
                times[name].append(time.perf_counter() - t0)
    return statistics.median(times["ours"]) / statistics.median(times["bare"])


@pytest.mark.timeout(600)
def test_ddp_step_overhead_vs_bare_torch_ddp(benchmark):
    ratios = benchmark.pedantic(
        lambda: run_distributed(_interleaved_ddp_timing, 2, 20, 10, timeout=500),
        rounds=1, iterations=1,
    )
    ratio = max(ratios)
    benchmark.extra_info["ours_over_bare_median_step"] = ratio
    print(f"\nour DDP step / bare torch DDP step (median, 2 gloo ranks): {ratio:.4f}")
    assert ratio < OVERHEAD_LIMIT


def _records(n):
    return [CommRecord(step=i // 4, phase="train", op="all_reduce", group_size=4, peers=None,
                       nbytes=4_000_000, seconds=1e-3, tier="inter") for i in range(n)]


def test_ledger_add_and_aggregate(benchmark):
    records = _records(10_000)

    def fill_and_aggregate():
        ledger = CommLedger()
        for r in records:
            ledger.add(r)
        return ledger.aggregate()

    rows = benchmark(fill_and_aggregate)
    assert rows[0]["count"] == 10_000


def test_projection_of_a_long_run(benchmark):
    records = _records(10_000)
    seconds = benchmark(project, records, get_profile("eth-10g"), 0, 1)
    assert seconds > 0


def test_batch_stream(benchmark):
    tokens = torch.randint(0, 256, (2_000_000,)).numpy().astype("uint16")
    stream = BatchStream(tokens, 1024, 16, 0, 8, seed=0)
    counter = iter(range(10**9))
    x, _ = benchmark(lambda: stream.batch(next(counter)))
    assert x.shape == (16, 1024)
