"""Clocks for what overlaps a device's work: host marks on CPU, CUDA events on a GPU.

Every device-timed measurement takes its marks on `clock_for(device)`: DDP's buckets
(algorithms/ddp.py, whose docstring says why host times would lie on CUDA), ZeRO's
exposed wait (algorithms/zero.py), FSDP2's collectives (algorithms/shard.py), the
pipelines' point-to-point waits (algorithms/pipeline.py, pipeline_deepspeed.py). Tests:
`pytest tests/test_gpu_path.py -k clock`.
"""

from __future__ import annotations

import time

import torch


class HostClock:
    """Marks are host `time.perf_counter()` values: right where ops block the host (CPU)."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def synchronize(self) -> None:
        pass


class CudaClock:
    """Marks are CUDA events recorded on the current stream; read after `synchronize`."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


Clock = HostClock | CudaClock


def clock_for(device: torch.device) -> Clock:
    """The clock whose marks follow the work on `device` (module docstring)."""
    return CudaClock(device) if device.type == "cuda" else HostClock()
