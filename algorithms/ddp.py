"""DDP, the baseline: gradients all-reduced every step by torch's own DDP (or DeepSpeed ZeRO).

Run it with `commbench run configs/ddp-tiny.yaml`; tests: `pytest tests/test_ddp.py`. The
math is docs/algorithms.md's DDP section. This is not a re-implementation: backend `torch`
wraps the model in `torch.nn.parallel.DistributedDataParallel`, backend `deepspeed` in a
DeepSpeed engine (ZeRO stage 0, 1 or 2; algorithms/zero.py).

How communication is measured (torch backend). A DDP communication hook (`DDPCommHook`)
launches each gradient bucket's all-reduce itself and takes two marks on a `Clock`: when
the bucket is handed to the network and when its all-reduce has completed. A third mark
is taken when `backward()` returns (DDP's backward ends by waiting for every bucket).
After backward the clock is synchronised and read:
- each bucket becomes one ledger record: logical bytes of the bucket, `seconds` from
  launch to completion (overlapping backward), and `lead_s` from its launch to the last
  bucket's launch (the end of backward compute: autograd has no gradient left to make),
  on the clock's `work()` marks: on CPU the rank's own CPU time (algorithms/clocks.py),
  so that the compute a bucket can hide behind is the compute the step's `compute_s`
  counts, not the wall time a rank sharing cores spent waiting for one;
- the step's *exposed* communication is from the last bucket's launch until `backward()`
  returned: the time the rank waited for the network after its compute was done.
The clock is what makes this honest on both devices:
- CPU (gloo): `HostClock`, host `perf_counter` marks. gloo runs compute on the host, the
  hook's completion callback runs when the all-reduce has really finished, and backward
  blocks the host until then, so host times are the real times.
- CUDA (NCCL): `CudaClock`, CUDA events recorded on the current stream. The host runs
  ahead of the GPU and NCCL's future completes at enqueue, so host times would be launch
  times (exposed ≈ 0, the wait landing in compute). Events record where the GPU stream
  is: at the bucket's readiness, after the all-reduce (the completion callback runs with
  the stream ordered after NCCL's work), and after backward's final wait; they are read
  after one `torch.cuda.synchronize()` per step. The code path is the same; only the
  marks differ.
Emulation (`network.emulate`): a bucket's future completes only once a modelled link,
carrying the buckets one after another, has carried it (a timer thread, so backward's
compute goes on meanwhile); the wait then shows in the exposed seconds as on a real link.
On CUDA the link starts when the device has produced the bucket (an event waited on by a
thread), not when the host queued it.
On CUDA the future the hook returns is a CUDA future on the bucket's device
(`device_future`): DDP's wait on it orders its stream after the events `set_result`
records, and the timer thread completes it on the bucket's device and on the stream that
queued the division after NCCL's all-reduce (`on_stream`; a new thread's current device
is device 0 on every rank), so DDP reads the bucket only once the all-reduce has landed.

How communication is measured (deepspeed backend): see algorithms/zero.py.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from algorithms.base import DataParallelStrategy
from algorithms.clocks import Clock, clock_for
from algorithms.contract import StepStats, StrategyConfig, TrainSetup, require_data_parallel
from algorithms.memory import fsdp_terms, require_shard_ranks, shard_terms
from algorithms.traffic import (
    DDP_ASSUMPTION,
    FSDP_ASSUMPTION,
    Traffic,
    ddp_buckets,
    fsdp_step,
)


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

    def check(self, cfg) -> None:
        require_data_parallel(self, cfg)
        if self.backend == "deepspeed" and cfg.parallel.shard != "none":
            raise ValueError(f"parallel.shard={cfg.parallel.shard!r} shards with FSDP2 under "
                             "strategy.backend=torch; DeepSpeed shards with its own ZeRO: use "
                             "strategy.backend=torch, or parallel.shard=none with "
                             "strategy.zero_stage")
        require_shard_ranks(cfg, cfg.parallel.world_size, "parallel.world_size")
        if self.backend == "deepspeed":
            require_deepspeed(cfg, self.zero_stage)


DEEPSPEED_REFUSES = {
    "muon": "Muon + AdamW is two torch optimizers, DeepSpeed wraps one",
    "soap": "ZeRO-1/2 hand the optimizer flat 1-D partitions, on which SOAP's Kronecker "
            "preconditioners of each matrix do not exist",
}
"""Optimizers a DeepSpeed engine cannot run as the schema means them, and why."""


def require_deepspeed(cfg, zero_stage: int = 0, engine: str = "the DeepSpeed engine") -> None:
    """What a DeepSpeed engine (ZeRO, or its pipeline) cannot take: torch.compile (the
    engine runs the forward itself, so compile cannot wrap it as compile(DDP(model)) does),
    and anything but ONE plain torch optimizer (not Muon's pair, not the one-step-delay
    wrapper, not SOAP on ZeRO-1/2's flat partitions)."""
    if cfg.model.compile:
        raise ValueError(f"model.compile=true with strategy.backend=deepspeed: {engine} runs "
                         "the forward itself, so torch.compile cannot wrap it; set "
                         "model.compile=false or strategy.backend=torch")
    name = cfg.optim.name
    if name == "soap" and zero_stage == 0:
        name = None
    if name in DEEPSPEED_REFUSES or cfg.optim.delay:
        why = ("the one-step-delay wrapper is not a torch optimizer" if cfg.optim.delay
               else DEEPSPEED_REFUSES[name])
        raise ValueError(
            f"strategy.backend=deepspeed takes a plain torch optimizer: optim.name "
            f"{cfg.optim.name!r} with optim.delay={cfg.optim.delay} is not supported ({why}); "
            "use strategy.backend=torch, or optim.name adamw/sgd/lion/adan/nadamw (soap: "
            "ZeRO stage 0 only) with optim.delay=0")


def device_future(device: torch.device) -> torch.futures.Future:
    """A future for tensors on `device`: on CUDA one that records events on completion and
    makes its waiters' streams wait for them (a plain future is a CPU future)."""
    if device.type == "cuda":
        return torch.futures.Future(devices=[device])
    return torch.futures.Future()


def current_stream(device: torch.device):
    """The calling thread's current stream on `device` (None on CPU)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def device_reached(device: torch.device):
    """A wait for the device to reach this point of the current stream (an event recorded
    now, waited on by another thread), or None on CPU, where the host runs the work and
    is there already. The emulated link of a bucket starts then: the host queues a bucket
    while the GPU is still computing earlier layers (issue 46)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event.synchronize


@contextlib.contextmanager
def on_stream(device: torch.device, stream):
    """Run the block on `device` and `stream` (another thread's device and stream: CUDA
    state is per thread); a no-op on CPU."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield


# ---------------------------------------------------------------------------- the hook


@dataclass
class _Bucket:
    nbytes: int
    launched: object
    """Clock mark when the bucket was handed to the network."""
    launched_work: object
    """Clock `work()` mark then (how far this rank's compute had got)."""
    done: object = None
    """Clock mark when its all-reduce had completed."""
    link_done: float = 0.0
    """Emulation: host time the modelled link has carried it (queued behind earlier
    buckets by the emulation policy's per-link timeline)."""
    link_known: threading.Event = field(default_factory=threading.Event)
    """Emulation: set once `link_done` is known (on CUDA, once the device reached it)."""


class DDPCommHook:
    """DDP communication hook: all-reduce (mean) each bucket; ledger records after backward.

    `hook` is registered on the DDP wrapper; `end_step(backward_end)` is called once
    backward has returned (with the clock mark taken then) and returns the step's exposed
    seconds (module docstring: the method).
    """

    def __init__(self, comm, group, clock: Clock):
        self.comm, self.group, self.clock = comm, group, clock
        self.pg = None if group is None else group.pg
        self.size = len(comm.group_ranks(group))
        self.pending: list[_Bucket] = []
        """This step's buckets, in launch order (DDP launches them in bucket order)."""
        self._starts: queue.Queue | None = None
        """Emulation on CUDA: buckets waiting for the device to reach them."""

    def hook(self, state, bucket):
        buffer = bucket.buffer()
        nbytes = buffer.numel() * buffer.element_size()
        entry = _Bucket(nbytes, self.clock.mark(), self.clock.work())
        self.pending.append(entry)
        launched = time.perf_counter()
        work = dist.all_reduce(buffer, group=self.pg, async_op=True)
        if self.comm.delay is None:
            def finish(fut):
                entry.done = self.clock.mark()
                return fut.value()[0].div_(self.size)

            return work.get_future().then(finish)
        return self._emulated(work, entry, launched, buffer.device)

    def _emulated(self, work, entry: _Bucket, launched: float,
                  device: torch.device) -> torch.futures.Future:
        """Emulation: the bucket completes once the modelled link has carried it.

        Buckets share one link: the emulation policy queues bucket k behind bucket k-1 on
        its per-link timeline (bench.network.delay_policy), so the seconds it returns run
        from this bucket's launch to its modelled end; on CUDA the launch is when the
        device reached the bucket, not when the host queued it (`device_reached`), else
        the modelled link would carry it while the GPU still computed it (issue 46), and
        DDP would be favoured over methods whose ops synchronise first. The wait runs on
        a timer thread:
        holding the thread that completes the all-reduce would, when it completes at once,
        hold autograd and turn the modelled network time into compute.
        """
        reached = device_reached(device)
        if reached is None:  # CPU: the device is where the host is
            self._start_link(entry, launched)
        else:  # the link starts once the GPU has produced the bucket, in launch order
            self._link_starts().put((entry, reached))
        result = device_future(device)

        def finish(fut):
            try:
                reduced = fut.value()[0].div_(self.size)
            except Exception as err:  # a lost peer: fail the step (unset, DDP waits forever)
                result.set_exception(err)
                return
            stream = current_stream(device)  # the division's, ordered after NCCL's work

            def complete():
                with on_stream(device, stream):
                    entry.done = self.clock.mark()
                    result.set_result(reduced)

            def after_the_link():
                entry.link_known.wait()
                time.sleep(max(0.0, entry.link_done - time.perf_counter()))
                complete()

            if entry.link_known.is_set() and entry.link_done <= time.perf_counter():
                complete()
            else:
                threading.Thread(target=after_the_link, daemon=True).start()

        work.get_future().add_done_callback(finish)
        return result

    def _start_link(self, entry: _Bucket, started: float) -> None:
        seconds = self.comm.modelled_seconds("all_reduce", entry.nbytes, self.group,
                                             started=started)
        entry.link_done = started + seconds
        entry.link_known.set()

    def _link_starts(self) -> queue.Queue:
        """The buckets whose links start when the device reaches them: one thread waits
        for each in launch order, so the per-link timeline queues them as DDP launched
        them."""
        if self._starts is None:
            self._starts = queue.Queue()

            def worker():
                while True:
                    entry, reached = self._starts.get()
                    reached()
                    self._start_link(entry, time.perf_counter())

            threading.Thread(target=worker, daemon=True, name="emulated-link").start()
        return self._starts

    def end_step(self, backward_end) -> float:
        """Record this step's buckets in the ledger; return the exposed seconds."""
        if not self.pending:
            return 0.0
        self.clock.synchronize()
        last = self.pending[-1]
        for b in self.pending:
            self.comm.record("all_reduce", b.nbytes, self.clock.seconds(b.launched, b.done),
                             group=self.group,
                             lead_s=self.clock.seconds(b.launched_work, last.launched_work))
        self.pending = []
        return max(0.0, self.clock.seconds(last.launched, backward_end))


def make_ddp(model, comm, group=None, bucket_cap_mb: float = 25.0):
    """Wrap `model` in torch DDP over `group` (default: all ranks) with the ledger hook.

    Returns (ddp_model, comm_hook): the `DDPCommHook` that records the buckets and
    measures the exposed communication of each step.
    """
    device = model_device(model)
    device_ids = [device.index] if device.type == "cuda" else None
    pg = group.pg if group is not None else None
    ddp_model = DistributedDataParallel(
        model, device_ids=device_ids, process_group=pg, bucket_cap_mb=bucket_cap_mb
    )
    comm_hook = DDPCommHook(comm, group, clock_for(device))
    ddp_model.register_comm_hook(state=None, hook=comm_hook.hook)
    return ddp_model, comm_hook


def model_device(model) -> torch.device:
    return next(model.parameters()).device


class DDP(DataParallelStrategy):
    """Data parallelism with a gradient all-reduce every step (docs/algorithms.md, DDP).

    Identity (tested): over n ranks with local batch b it gives the same parameters, to
    fp tolerance, as one process with batch n*b. `parallel.shard: fsdp` shards the model
    over all ranks with FSDP2 instead of replicating it (algorithms/shard.py): the same
    update, gradients reduce-scattered and parameters all-gathered (tested equal to torch
    DDP).
    """

    Config = DDPConfig

    @classmethod
    def memory_terms(cls, cfg, facts) -> dict[str, int]:
        """torch DDP: + its gradient buckets (a second copy of the gradients). ZeRO-1:
        optimizer state over the ranks (+ the flat fp32 partition); ZeRO-2: gradients too."""
        config, n = cfg.strategy, cfg.parallel.world_size
        if cfg.parallel.shard == "fsdp":  # FSDP2 over every rank
            return {**facts.sharded(n).base_terms(), **fsdp_terms(facts)}
        terms = facts.base_terms()
        if config.backend == "torch":
            if n > 1:
                terms["DDP gradient buckets"] = facts.param_bytes
            return terms
        if config.zero_stage >= 1:
            terms = shard_terms(terms, ("optimizer",), n)
            terms["ZeRO: flat fp32 partition"] = facts.param_bytes // n
        if config.zero_stage >= 2:
            terms = shard_terms(terms, ("gradients",), n)
        return terms

    @classmethod
    def traffic(cls, cfg, facts) -> Traffic:
        """Every step: torch DDP's bucket all-reduces over the world (phase "train"), or
        the sharded replica's FSDP2 collectives; DeepSpeed's engine: what its comms logger
        records (algorithms/zero.py `zero_traffic`)."""
        config = cfg.strategy
        world, M = cfg.parallel.world_size, cfg.parallel.num_microbatches
        if config.backend != "torch":
            from algorithms.zero import zero_traffic

            return zero_traffic(cfg, facts, config.zero_stage)
        if cfg.parallel.shard == "fsdp":
            step, notes = fsdp_step(facts, world, None, "train", M, cfg.optim.grad_clip), \
                [FSDP_ASSUMPTION]
        elif world > 1:
            step, notes = [ddp_buckets(facts, config.bucket_cap_mb, "train", None, M)], \
                [DDP_ASSUMPTION]
        else:
            step, notes = [], []
        return Traffic(cfg.run.steps, lambda rank, s: step, notes=notes)

    def __init__(self, config: DDPConfig, setup: TrainSetup):
        super().__init__(config, setup)
        self.zero = None
        """The DeepSpeed engine (backend deepspeed), else None."""
        if config.backend == "deepspeed":
            from algorithms.zero import ZeroEngine  # imported only when asked for

            self.zero = ZeroEngine(config, setup, self.optimizer)
            self.optimizer = self.zero.optimizer
        elif self.comm.world_size > 1 and self.sharded is None:
            self.train_model, self.comm_hook = self.register_ddp(make_ddp(
                self.model, self.comm, bucket_cap_mb=config.bucket_cap_mb))

    def train_step(self, batch) -> StepStats:
        if self.zero is None:
            return super().train_step(batch)
        self.step_index += 1
        return self.zero.train_step(batch)

    def state_dict(self) -> dict:
        if self.zero is None:
            return super().state_dict()
        return {**self.zero.state_dict(), "step_index": self.step_index}

    def state_scopes(self) -> dict[str, str]:
        """Which ranks hold each `state_dict` key bit-identically (checkpoints write it once
        per scope, bench/run/dcp_state.py): torch DDP's model, optimizer and step count on
        every rank ("world"); ZeRO's and FSDP's are each rank's own shards (not named)."""
        if self.zero is not None or self.sharded is not None:
            return {}
        return {"model": "world", "optimizer": "world", "step_index": "world"}

    def load_state_dict(self, state: dict) -> None:
        if self.zero is None:
            return super().load_state_dict(state)
        self.zero.load_state_dict(state)
        self.step_index = state["step_index"]

    def close(self) -> None:
        if self.zero is not None:
            self.zero.close()
