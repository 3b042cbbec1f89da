"""Hot-path benchmarks (`tox -e bench`, gated by tests/benchmarks/gate.py against a baseline).

- our DDP step (strategy + ledger hook) / a bare torch DDP step on the same model and
  ranks: a ratio measured in one run, saved and gated like a time (replay.py);
- the ledger, the projection of a 10^5-record ledger, the loop's projection of one step
  (`StepClock.add`: 10^3 and 10^5 records on the default profiles, both overlap modes;
  bench/run/meter.py, Projection cost), a pipeline's step and its replay at settle, the batch
  stream, and the report built from 200 run records, each on its own.

Harness-time targets (issue 44): a DDP step's projection (10^3 buckets) 16 ms -> 0.5 ms,
a pipeline's (8 stages x 32 microbatches) 11 ms (1F1B) + 61 ms of settle replay a step ->
2 ms. Asserted as the speed-ups they are, each against today's work timed in the same
run (machines and their load differ; the gate compares minima, so do these): the DDP
step against the same step priced for the first time (every record on every profile,
what every step cost before), >= 32x; the pipeline step with its settle share against
the replays bench/run/meter.py ran a step, on the interpreter (`simulate`: one per profile
at `add`, one per profile and replica at settle), >= 36x.
The outer step, a gossip round and torchft's outer step are in test_bench_outer.py.
"""

import json
import statistics
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from algorithms.base import CriticalPath, StepStats, TrainSetup
from algorithms.comm import CommLedger, CommRecord, Communicator
from algorithms.ddp import DDP, DDPConfig
from bench.config import load_config
from bench.config.schema import NetworkConfig
from bench.data.batches import BatchStream
from bench.model import GPT, gpt_config
from bench.network import get_profile, project
from bench.network.timeline import pipeline_values
from bench.run.meter import StepClock
from bench.run.train import make_optimizer_factory
from bench.study.report import build_report
from tests.benchmarks.replay import CLOCK, replay
from tests.distributed import run_distributed

pytestmark = pytest.mark.bench

OVERHEAD_LIMIT = 1.03
DDP_SPEEDUP = 32
"""A DDP step's projection (10^3 buckets): 16 ms -> 0.5 ms (the module docstring)."""
PIPELINE_SPEEDUP = 36
"""A pipeline step with its settle share (8 stages x 32 microbatches): 72 ms -> 2 ms."""


def _interleaved_ddp_timing(rank, world_size, rounds, steps_per_round):
    """Ours / bare torch DDP median step time, interleaved in blocks: (overall, per block)."""
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
    block_ratios = []
    step = 0
    for _ in range(rounds):
        block = {}
        for name, fn in (("bare", bare_step), ("ours", ours.train_step)):
            block[name] = []
            for _ in range(steps_per_round):
                batch = stream.batch(step)
                step += 1
                torch.distributed.barrier()
                t0 = time.perf_counter()
                fn(batch)
                block[name].append(time.perf_counter() - t0)
            times[name] += block[name]
        block_ratios.append(statistics.median(block["ours"]) / statistics.median(block["bare"]))
    overall = statistics.median(times["ours"]) / statistics.median(times["bare"])
    return overall, block_ratios


@pytest.mark.timeout(600)
@pytest.mark.benchmark(timer=CLOCK.now)
def test_ddp_step_overhead_vs_bare_torch_ddp(benchmark):
    """The saved "time" of this benchmark is the ratio ours / bare, one sample per block."""
    results = run_distributed(_interleaved_ddp_timing, 2, 20, 10, timeout=500)
    ratio = max(overall for overall, _ in results)
    replay(benchmark, [max(r) for r in zip(*(blocks for _, blocks in results), strict=True)])
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
    records = _records(100_000)
    seconds = benchmark(project, records, get_profile("eth-10g"), 0, 1)
    assert seconds > 0


@pytest.mark.parametrize("records", [10**3, 10**5])
def test_projection_of_one_step(benchmark, records):
    """What the loop adds to each step on the host to project it (bench/run/meter.py,
    Projection cost): one step of `records` DDP buckets (4 MB, ready 1 ms before the end
    of backward) priced by `StepClock.add` on the profiles every run projects onto by
    default, overlap-aware and not. A StepClock needs no process group for `add`."""
    profiles = {name: get_profile(name) for name in NetworkConfig().profiles}
    clock = StepClock(profiles, 0, 1, torch.device("cpu"), "gloo")
    step = [CommRecord(step=0, phase="train", op="all_reduce", group_size=4, peers=None,
                       nbytes=4_000_000, seconds=1e-3, tier="inter", lead_s=1e-3)
            for _ in range(records)]
    stats = StepStats(loss=1.0, tokens=1024, comm_s=0.01)
    benchmark.pedantic(clock.add, args=(0.5, stats, step), rounds=5 if records > 10**4 else 50,
                       iterations=1, warmup_rounds=1)
    assert clock.num_steps == (6 if records > 10**4 else 51) and clock.projected[0] > 0.49
    if records == 10**3:  # the target: against the same step priced for the first time
        first = min(_first_pricing_s(profiles, stats, step) for _ in range(5))
        benchmark.extra_info["first_pricing_s"] = first
        print(f"\nDDP step, 10^3 buckets: {benchmark.stats.stats.min * 1e3:.3f} ms, priced "
              f"the first time {first * 1e3:.2f} ms")
        assert benchmark.stats.stats.min * DDP_SPEEDUP <= first


def _first_pricing_s(profiles: dict, stats: StepStats, step: list[CommRecord]) -> float:
    clock = StepClock(profiles, 0, 1, torch.device("cpu"), "gloo")
    start = time.perf_counter()
    clock.add(0.5, stats, step)
    return time.perf_counter() - start


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_projection_of_one_pipeline_step(benchmark, schedule):
    """The same for a deep pipeline stage (8 stages, 32 microbatches: its 64 transfers and
    a tied all-reduce), the same step again: `StepClock.add` prices its records once
    (bench/network/timeline.py `StepPricer`) and replays the schedule (2BW: three steps for
    its steady state) on the profiles whose link clocks pay slow start, once."""
    profiles = {name: get_profile(name) for name in NetworkConfig().profiles}
    clock = StepClock(profiles, 3, 1, torch.device("cpu"), "gloo",
                      critical_path=CriticalPath(schedule, 8, 32))
    stats = StepStats(loss=1.0, tokens=1024, comm_s=0.2)
    benchmark.pedantic(clock.add, args=(0.5, stats, _pipeline_step()), rounds=20,
                       iterations=1, warmup_rounds=1)
    wan = list(profiles).index("wan-1g")  # replayed at add: its link clock pays slow start
    assert clock.num_steps == 21 and clock.projected[wan] > 0.3


def _pipeline_step() -> list[CommRecord]:
    step = [CommRecord(step=0, phase="train", op="exchange", group_size=2, peers=(4,),
                       nbytes=1 << 20, seconds=1e-3, tier="inter", peer_nbytes=(1 << 20,))
            for _ in range(64)]
    step.append(CommRecord(step=0, phase="tied", op="all_reduce", group_size=2,
                           peers=(0, 7), nbytes=1 << 22, seconds=1e-3, tier="inter"))
    return step


def _settle_window(schedule: str, steps: int, ranks: int = 32) -> tuple:
    """A settle window of `ranks` (replicas of 8 stages, 32 microbatches) and `steps`,
    each rank's compute its own: the inputs `pipeline_values` replays."""
    columns = len(NetworkConfig().profiles)
    width = 2 * columns
    robust = torch.zeros(ranks, steps, 2 + 3 * width, dtype=torch.float64)
    robust[:, :, 1] = 0.4 + 0.01 * torch.rand(ranks, steps, dtype=torch.float64)
    robust[:, :, 2::3] = 2e-3  # d
    robust[:, :, 3::3] = 1e-3  # h
    values = torch.zeros(ranks, steps, width, dtype=torch.float64)
    return values, robust, CriticalPath(schedule, 8, 32), columns


def test_pipeline_replay_at_settle(benchmark):
    """What `StepClock.settle` adds for a pipeline (bench/network/timeline.py
    `pipeline_values`): a 10-step window of 32 ranks (4 replicas of 8 stages, 32
    microbatches) replayed per replica with each stage's compute, on every default
    profile."""
    values, robust, path, columns = _settle_window("1f1b", 10)
    got = benchmark.pedantic(pipeline_values, args=(values, robust, path, columns), rounds=3,
                             iterations=1)
    assert (got[:, :, :columns] > 0.4).all() and (got[:, :, columns:] == 0).all()


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
@pytest.mark.benchmark(timer=CLOCK.now)
def test_pipeline_step_with_its_settle(benchmark, schedule):
    """A pipeline rank's host time a step, as a run spends it (issue 44's target): 10 steps
    whose measured compute differs (no replay priced twice), `StepClock.add` each, then
    the settle point's replay of the window's 32 ranks (`pipeline_values`); the saved
    time is per step."""
    profiles = {name: get_profile(name) for name in NetworkConfig().profiles}
    clock = StepClock(profiles, 3, 1, torch.device("cpu"), "gloo",
                      critical_path=CriticalPath(schedule, 8, 32))
    stats, records = StepStats(loss=1.0, tokens=1024, comm_s=0.2), _pipeline_step()
    window = _settle_window(schedule, 10)
    counter = iter(range(10**6))

    def steps():
        start = time.perf_counter()
        for _ in range(10):
            clock.add(0.5, stats, records, compute_s=0.4 + next(counter) * 1e-6)
        pipeline_values(*window)
        return (time.perf_counter() - start) / 10

    replay(benchmark, [steps() for _ in range(10)])
    values, _, path, columns = window
    replays = columns + columns * values.shape[0] // path.num_stages  # before, a step
    before = replays * min(_interpreted_replay_s(path) for _ in range(3))
    benchmark.extra_info["before_s"] = before
    print(f"\n{schedule} step with its settle share: {benchmark.stats.stats.min * 1e3:.3f} ms, "
          f"before (interpreted replays) {before * 1e3:.1f} ms")
    assert benchmark.stats.stats.min * PIPELINE_SPEEDUP <= before


def _interpreted_replay_s(path: CriticalPath) -> float:
    """One replay of a step on the interpreter (`simulate`), as bench/run/meter.py ran each."""
    from bench.network.pipeline import programs, replayed_steps, simulate

    stages = programs(path.schedule, path.num_stages, path.passes, replayed_steps(path))
    f, b = [0.4 / 3 / path.passes] * path.num_stages, [0.8 / 3 / path.passes] * path.num_stages
    start = time.perf_counter()
    simulate(stages, f, b, 2e-3, 1e-3, 0.0)
    return time.perf_counter() - start


def test_batch_stream(benchmark):
    tokens = torch.randint(0, 256, (2_000_000,)).numpy().astype("uint16")
    stream = BatchStream(tokens, 1024, 16, 0, 8, seed=0)
    counter = iter(range(10**9))
    x, _ = benchmark(lambda: stream.batch(next(counter)))
    assert x.shape == (16, 1024)


def test_report_on_200_runs(benchmark, tmp_path):
    from tests.test_report import write_run

    sweep_dir = tmp_path / "results" / "big"
    sweep = {"name": "big", "target_loss": None, "runs": {}}
    variants = [("ddp", "ddp", 1.0), ("diloco-H10", "diloco", 0.5), ("pier", "pier", 0.5),
                ("gasloc", "gasloc", 0.6)]
    for lr in (1e-3, 2e-3, 3e-3, 4e-3, 6e-3):
        for seed in range(10):
            for name, strategy, seconds in variants:
                write_run(sweep_dir, sweep, name, strategy, seed,
                          [4.0 - seed / 100, 3.0, 2.5, 2.0 + lr], seconds, point={"optim.lr": lr})
    (sweep_dir / "sweep.json").write_text(json.dumps(sweep))
    assert len(sweep["runs"]) == 200
    counter = iter(range(10**6))
    html = benchmark.pedantic(lambda: build_report(sweep_dir, tmp_path / f"out{next(counter)}"),
                              rounds=3, iterations=1)
    assert html.exists() and "gasloc" in html.read_text()
