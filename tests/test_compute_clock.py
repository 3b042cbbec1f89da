"""A CPU rank's compute is its own CPU time (bench/run/meter.py, Compute clock; issue 50).

Where ranks share cores, a rank's wall time holds its waits for a core, which land in its
compute and, through the peers that wait for it in a collective, in their exposed
communication. The loop-level check (a descheduled rank and its waiting peer) is
tests/test_loop_measures.py `test_a_wait_for_a_core_is_not_compute`; the ratio at 4 ranks on
2 cores is a benchmark (tests/benchmarks/test_bench_contention.py, `tox -e bench`).
"""

import time
from pathlib import Path

import pytest
import torch

from algorithms.clocks import THREAD_CPU, WALL, HostClock, set_compute_clock, work_clock
from algorithms.ddp import DDPCommHook, _Bucket
from bench.env import ranks_per_core
from tests.helpers import burn_cpu


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_work_clock_is_the_threads_cpu_time_with_one_torch_thread(threads):
    threads(1)
    assert work_clock(torch.device("cpu"))[0] == THREAD_CPU
    threads(2)  # cores of its own: CPU time would add up the threads
    assert work_clock(torch.device("cpu"))[0] == WALL
    assert work_clock(torch.device("cuda", 0)) == (WALL, time.perf_counter)


def test_compute_clock_wall_puts_every_work_mark_on_the_wall(threads):
    """`run.compute_clock: wall` (the shaped-link lab's setting) reaches the strategies'
    clocks too: a HostClock made after the loop's `set_compute_clock("wall")` marks a
    sleep as work, where the default marks none of it."""
    threads(1)
    try:
        set_compute_clock("wall")
        assert work_clock(torch.device("cpu"))[0] == WALL
        clock = HostClock()
        start = clock.work()
        time.sleep(0.1)
        assert clock.work() - start >= 0.09
    finally:
        set_compute_clock("auto")
    assert work_clock(torch.device("cpu"))[0] == THREAD_CPU
    with pytest.raises(ValueError, match=r"run.compute_clock: 'cpu'; valid: \['auto', 'wall'\]"):
        set_compute_clock("cpu")


def test_host_clock_work_marks_advance_with_compute_not_with_waits(threads):
    threads(1)
    clock = HostClock()
    start, wall = clock.work(), clock.mark()
    time.sleep(0.2)  # a wait: for a core, a peer, the network
    burn_cpu(0.05)
    worked = clock.seconds(start, clock.work())
    assert 0.05 <= worked < 0.12  # the burn, not the sleep
    assert clock.seconds(wall, clock.mark()) >= 0.25


class _Comm:
    def __init__(self):
        self.records = []

    def group_ranks(self, group):
        return [0, 1]

    def record(self, op, nbytes, seconds, group=None, lead_s=None):
        self.records.append((op, nbytes, seconds, lead_s))


class _Clock:
    """Marks as given (wall seconds; `work` marks are _Bucket's own)."""

    waits_cost_work = False

    def seconds(self, start, end):
        return end - start

    def synchronize(self):
        pass


def test_ddp_bucket_lead_is_the_compute_after_it_not_the_wall_time():
    """The first bucket was launched 0.5 s (wall) before the last, of which 0.1 s was this
    rank's compute (the rest: waiting for a core). It can hide behind 0.1 s of compute,
    the same compute the step's compute_s counts, not behind 0.5 s."""
    comm = _Comm()
    hook = DDPCommHook(comm, None, _Clock())
    hook.pending = [_Bucket(64, launched=0.0, launched_work=10.0, done=0.9),
                    _Bucket(32, launched=0.5, launched_work=10.1, done=1.0)]
    exposed = hook.end_step(backward_end=1.0)
    assert [r[3] for r in comm.records] == [pytest.approx(0.1), 0.0]
    assert [r[2] for r in comm.records] == [pytest.approx(0.9), pytest.approx(0.5)]
    assert exposed == pytest.approx(0.5)  # the wall wait after the last launch


def test_ranks_per_core_on_cpu_only(monkeypatch):
    monkeypatch.setattr("bench.env.cores_available", lambda: 2)
    assert ranks_per_core(4, torch.device("cpu")) == 2.0
    assert ranks_per_core(1, torch.device("cpu")) == 0.5
    assert ranks_per_core(8, torch.device("cuda", 0)) is None


def test_each_rank_gets_its_share_of_the_cores_on_any_device(monkeypatch):
    """Issue 46: a GPU node's ranks start with OMP_NUM_THREADS=1 (torchrun), which left
    DiLoCo's offloaded outer step on one core; main() now shares the cores out on every
    device (it used to on CPU only)."""
    from bench.env import share_cores
    monkeypatch.setattr("bench.env.cores_available", lambda: 16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert share_cores(8) == 2 and torch.get_num_threads() == 2
        assert share_cores(32) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    source = Path(__file__).parents[1].joinpath("bench/run/train.py").read_text()
    main = source[source.index("def main("):]
    assert "share_cores(" in main.split("try:")[0]  # before any device branch
