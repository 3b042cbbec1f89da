"""Clocks for what overlaps a device's work: host marks on CPU, CUDA events on a GPU.

Every device-timed measurement takes its marks on `clock_for(device)`: DDP's buckets
(algorithms/ddp.py, whose docstring says why host times would lie on CUDA), ZeRO's
exposed wait (algorithms/zero.py), FSDP2's collectives (algorithms/shard.py), the
pipelines' point-to-point waits (algorithms/pipeline.py, pipeline_deepspeed.py). Tests:
`pytest tests/test_gpu_path.py -k clock`.

Compute on a CPU device is measured on the rank's own CPU time (`work_clock`), not on the
wall: where ranks share cores (4 gloo ranks on a 2-core laptop) a descheduled rank's wall
time holds its wait for a core, which lands in its compute and, through the peers that
wait for it in a collective, in their exposed communication, in proportions that differ
by method (DDP waits for peers at every bucket; DiLoCo seldom). A thread's CPU time does
not run while it waits for a core, a peer or the network, so it is the same compute
whatever the contention (docs/architecture.md, "Compute clock"). On CUDA the device's
work is on the device, and compute stays the synchronised wall time minus exposed
communication (`WALL`). `run.compute_clock: wall` (the shaped-link lab's setting) asks for
the wall clock on CPU too: the loop calls `set_compute_clock` once, before any strategy
makes a clock, so the loop's compute and the strategies' `work()` marks (DDP's bucket
leads, Streaming DiLoCo's tails) are on one clock. `peak_memory_bytes`: the rank's peak
memory on its device, the other thing the loop measures of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

THREAD_CPU, WALL = "thread_cpu", "wall"
"""`work_clock` names, as summary.json's `compute_clock` records them."""
CONTENTION_FREE = (THREAD_CPU,)
"""The clocks whose compute holds no wait for a core (the report and the what-if ask)."""
COMPUTE_CLOCKS = ("auto", WALL)
"""`run.compute_clock` values: `work_clock`'s choice, or the wall clock whatever the device."""
_requested = "auto"


def set_compute_clock(requested: str) -> None:
    """This process's `run.compute_clock` (one of `COMPUTE_CLOCKS`), for every clock made
    after the call; the loop sets it once, before building its strategy."""
    global _requested
    if requested not in COMPUTE_CLOCKS:
        raise ValueError(f"run.compute_clock: {requested!r}; valid: {list(COMPUTE_CLOCKS)}")
    _requested = requested


def work_clock(device: torch.device) -> tuple[str, Callable[[], float]]:
    """(name, seconds function) of the clock a rank's compute on `device` is measured on.

    CPU: the calling thread's CPU time when torch computes on it alone (one intra-op
    thread: what the loop sets where ranks share the cores). With several intra-op
    threads each rank has cores of its own (bench/run/train.py gives a rank cores / local
    ranks threads), so there is no wait for a core to remove, and the process's CPU time
    would add up its threads (2 threads: twice the compute): the wall clock. CUDA: the
    wall clock (module docstring). The wall clock always after `set_compute_clock("wall")`."""
    if _requested == "auto" and device.type == "cpu" and torch.get_num_threads() == 1:
        return THREAD_CPU, time.thread_time
    return WALL, time.perf_counter


class HostClock:
    """Marks are host `time.perf_counter()` values: right where ops block the host (CPU).
    `work()` marks are on this rank's CPU time (`work_clock`): how far its compute got,
    whatever it waited for in between."""

    waits_cost_work = False
    """A wait (for a peer, the network, a core) advances `work()` marks not at all."""

    def __init__(self):
        self.work: Callable[[], float] = work_clock(torch.device("cpu"))[1]
        """A `work()` mark: the CPU-time function chosen once, as the loop's own (torch's
        threads are set before any strategy makes its clock)."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def synchronize(self) -> None:
        pass


class CudaClock:
    """Marks are CUDA events recorded on the current stream; read after `synchronize`."""

    waits_cost_work = True
    """`work()` is `mark()`: the stream's time, waits included."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def work(self) -> torch.cuda.Event:
        return self.mark()

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


Clock = HostClock | CudaClock


def clock_for(device: torch.device) -> Clock:
    """The clock whose marks follow the work on `device` (module docstring)."""
    return CudaClock(device) if device.type == "cuda" else HostClock()


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak memory: CUDA `max_memory_allocated`, else the peak resident set of
    this process's own address space (Linux `VmHWM`). Not `ru_maxrss`: Linux carries the
    parent's peak RSS across fork/vfork + exec into it, so a rank started by a large
    launcher (a pytest process, torchrun's agent) would report the launcher's peak."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource  # POSIX, not Linux: ru_maxrss (KiB on Linux, bytes on macOS)

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
