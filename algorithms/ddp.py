"""DDP, the baseline: gradients all-reduced every step by torch's own DDP (or DeepSpeed ZeRO).

Run it with `commbench run configs/ddp-tiny.yaml`. This is not a re-implementation:
backend `torch` wraps the model in `torch.nn.parallel.DistributedDataParallel`, backend
`deepspeed` in a DeepSpeed engine (ZeRO stage 0, 1 or 2).

How communication is measured (torch backend). A DDP communication hook launches each
gradient bucket's all-reduce itself and records it in the CommLedger: logical bytes of the
bucket and the wall time from launch to completion (these overlap the backward pass).
The step's *exposed* communication is the time from the moment the last bucket became
ready (autograd has no more gradients to compute) until `backward()` returned, i.e. the
time the rank waited for the network after its compute was done. On CUDA the hook runs
on the host ahead of the GPU, so the step is synchronised before reading the clock and
the figure is an upper bound.

How communication is measured (deepspeed backend). DeepSpeed's collectives do not pass
through our Communicator; its own comms logger reports each op's size and latency, which
are copied into the ledger after every step. The whole optimizer-step synchronisation is
exposed (ZeRO reduces after backward), so exposed = the logger's summed latency.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from algorithms.base import DataParallelStrategy, StepStats, StrategyConfig, TrainSetup


@dataclass
class DDPConfig(StrategyConfig):
    name: str = "ddp"
    """Plain data parallelism: the baseline every other strategy is compared against."""
    backend: Literal["torch", "deepspeed"] = "torch"
    """torch (DistributedDataParallel) or deepspeed (DeepSpeed engine with ZeRO)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage (0, 1 or 2); backend deepspeed only."""
    bucket_cap_mb: float = 25.0
    """torch DDP gradient bucket size in MiB."""

    def __post_init__(self):
        if self.zero_stage not in (0, 1, 2):
            raise ValueError(f"strategy.zero_stage must be 0, 1 or 2, got {self.zero_stage!r}")
        if self.zero_stage and self.backend != "deepspeed":
            raise ValueError(
                f"strategy.zero_stage={self.zero_stage} needs strategy.backend=deepspeed, "
                f"got backend={self.backend!r}"
            )
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"strategy.bucket_cap_mb must be > 0, got {self.bucket_cap_mb!r}")


def make_ddp(model, comm, group=None, bucket_cap_mb: float = 25.0):
    """Wrap `model` in torch DDP over `group` (default: all ranks) with the ledger hook.

    Returns (ddp_model, timer); `timer.last_ready` is the host time the last bucket was
    handed to the network in the current backward pass.
    """
    device_ids = [model_device(model).index] if model_device(model).type == "cuda" else None
    pg = group.pg if group is not None else None
    ddp_model = DistributedDataParallel(
        model, device_ids=device_ids, process_group=pg, bucket_cap_mb=bucket_cap_mb
    )
    timer = _BucketTimer(comm, group)
    ddp_model.register_comm_hook(state=None, hook=timer.hook)
    return ddp_model, timer


def model_device(model) -> torch.device:
    return next(model.parameters()).device


class _BucketTimer:
    """DDP communication hook: all-reduce (mean) each bucket and record it in the ledger."""

    def __init__(self, comm, group):
        self.comm = comm
        self.group = group
        self.pg = None if group is None else group.pg
        self.size = len(comm.group_ranks(group))
        self.last_ready = 0.0

    def hook(self, state, bucket):
        buffer = bucket.buffer()
        start = time.perf_counter()
        self.last_ready = start
        work = dist.all_reduce(buffer, group=self.pg, async_op=True)

        def finish(fut):
            reduced = fut.value()[0].div_(self.size)
            elapsed = time.perf_counter() - start
            self.comm.record("all_reduce", buffer.numel() * buffer.element_size(), elapsed,
                             group=self.group, started=start)
            return reduced

        return work.get_future().then(finish)


class DDP(DataParallelStrategy):
    """Data parallelism with a gradient all-reduce every step (ALGORITHMS.md, DDP).

    Identity (tested): over n ranks with local batch b it gives the same parameters, to
    fp tolerance, as one process with batch n*b.
    """

    Config = DDPConfig

    def __init__(self, config: DDPConfig, setup: TrainSetup):
        super().__init__(config, setup)
        self.engine = None
        if config.backend == "deepspeed":
            from algorithms.zero import build_engine  # imported only when asked for

            self.engine, self.optimizer = build_engine(config, setup, self.optimizer)
        elif self.comm.world_size > 1:
            self.train_model, self.timer = make_ddp(
                self.model, self.comm, bucket_cap_mb=config.bucket_cap_mb
            )

    def train_step(self, batch) -> StepStats:
        if self.engine is None:
            return super().train_step(batch)
        from algorithms.zero import engine_step

        return engine_step(self, batch)
