"""Synchronous pipeline baselines through existing engines (`strategy.name: pipeline`).

Run them with `commbench run configs/pipeline-1f1b-tiny.yaml` (or gpipe-tiny,
deepspeed-pp-tiny); tested by `pytest tests/test_pipeline.py`. Not re-implementations:
- `backend: torch`: `torch.distributed.pipelining` (`PipelineStage` + `ScheduleGPipe`,
  `Schedule1F1B` or `ScheduleInterleaved1F1B`, the last with `stages_per_rank` model
  chunks per rank, chunk c on stage c mod S).
- `backend: deepspeed`: DeepSpeed's `PipelineModule` and pipeline engine (1F1B with a
  flush), in algorithms/pipeline_deepspeed.py.

Every schedule flushes: the minibatch's gradient (mean over M microbatches) is complete
before the update, so parameters equal one process with gradient accumulation. Bubble
fraction `(S-1)/(M+S-1)` (interleaved: `(S-1)/(V*M+S-1)`).

Ledger (docs/algorithms.md, Pipelines). torch's schedules call `batch_isend_irecv` (via
`schedules._batch_p2p`) themselves. During a step that function is wrapped: each batch is
recorded once it has been waited on, as `send` (bytes sent), `recv` (bytes received) or
`exchange` (both directions, bytes sent), with the time from issue to the end of its
wait; under `network.emulate` the batch is held until its modelled time from issue has
passed (`Communicator.hold`), issue being when the device reached it (a synchronise
first). The time spent blocked in the waits is the step's `idle_s`,
timed on the device's clock (`P2PRecorder`: CUDA events, since NCCL's wait does not block
the host).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from algorithms.base import unwrap
from algorithms.clocks import clock_for
from algorithms.contract import CriticalPath, TrainSetup
from algorithms.pipeline_base import PipelineConfigBase, PipelineStrategy

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


@dataclass
class PipelineConfig(PipelineConfigBase):
    name: str = "pipeline"
    """Synchronous pipeline parallelism (GPipe / 1F1B with a flush) through an engine."""
    schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = "1f1b"
    """gpipe (all forwards, then all backwards), 1f1b, or interleaved-1f1b (torch only)."""
    backend: Literal["torch", "deepspeed"] = "torch"
    """torch (torch.distributed.pipelining) or deepspeed (PipelineModule engine, 1f1b)."""
    stages_per_rank: int = 1
    """Model chunks per rank (interleaved-1f1b needs >= 2; the others exactly 1)."""

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"strategy.schedule must be one of {list(SCHEDULES)}, "
                             f"got {self.schedule!r}")
        if self.backend not in ("torch", "deepspeed"):
            raise ValueError(f"strategy.backend must be 'torch' or 'deepspeed', "
                             f"got {self.backend!r}")
        if self.backend == "deepspeed" and self.schedule != "1f1b":
            raise ValueError(f"strategy.schedule must be '1f1b' with backend deepspeed "
                             f"(its engine runs 1F1B only), got {self.schedule!r}")
        interleaved = self.schedule == "interleaved-1f1b"
        if interleaved and self.stages_per_rank < 2:
            raise ValueError(f"strategy.stages_per_rank must be >= 2 for interleaved-1f1b, "
                             f"got {self.stages_per_rank!r}")
        if not interleaved and self.stages_per_rank != 1:
            raise ValueError(f"strategy.stages_per_rank must be 1 for schedule "
                             f"{self.schedule!r}, got {self.stages_per_rank!r}")

    def critical_path(self, num_stages: int, num_microbatches: int) -> CriticalPath:
        """gpipe: torch's GPipe order; the others: `PipelineConfigBase.critical_path`."""
        if self.schedule == "gpipe":
            return CriticalPath("gpipe", num_stages, num_microbatches)
        return super().critical_path(num_stages, num_microbatches)

    def check(self, cfg) -> None:
        super().check(cfg)
        if self.backend == "deepspeed":
            from algorithms.ddp import require_deepspeed

            require_deepspeed(cfg, engine="DeepSpeed's pipeline engine")
        p = cfg.parallel
        blocks = cfg.model.n_layer
        if blocks is not None and p.num_stages * self.stages_per_rank > blocks:
            raise ValueError(f"parallel.num_stages x strategy.stages_per_rank "
                             f"({p.num_stages} x {self.stages_per_rank}) must be <= the "
                             f"model's number of blocks ({blocks})")


class Pipeline(PipelineStrategy):
    """GPipe / 1F1B / interleaved 1F1B with a flush, run by torch or DeepSpeed."""

    Config = PipelineConfig

    # ------------------------------------------------------------- plans, before launch

    @classmethod
    def traffic(cls, cfg, facts):
        """torch's schedules: `PipelineStrategy.traffic` (interleaved-1f1b: each chunk's
        crossings, priced on 1F1B's critical path of V*M passes as the run projections
        price it); DeepSpeed's engine: what algorithms/pipeline_deepspeed.py records
        (`deepspeed_pipe_traffic`: its p2p one message a record, its own scalars)."""
        if cfg.strategy.backend == "deepspeed":
            from algorithms.pipeline_deepspeed import deepspeed_pipe_traffic

            return deepspeed_pipe_traffic(cfg, facts)
        return super().traffic(cfg, facts)

    @classmethod
    def in_flight(cls, config: PipelineConfig, facts) -> float:
        """gpipe: all M; 1f1b: min(S - s, M); interleaved (V chunks): torch's warm-up of
        (V - 1) S + 2 (S - 1 - s) chunk-microbatches plus one, in units of V chunks."""
        S, s, M = facts.num_stages, facts.stage, facts.num_microbatches
        V = config.stages_per_rank
        if config.schedule == "gpipe":
            return M
        if config.schedule == "interleaved-1f1b":
            return min((V - 1) * S + 2 * (S - 1 - s) + 1, V * M) / V
        return super().in_flight(config, facts)

    @classmethod
    def memory_terms(cls, cfg, facts) -> dict[str, int]:
        """+ the receive buffers torch's PipelineStage allocates for every microbatch
        (activations in, gradients in; V chunks each)."""
        terms = super().memory_terms(cfg, facts)
        if cfg.strategy.backend == "torch":
            ends = (facts.stage > 0) + (facts.stage < facts.num_stages - 1)
            terms["receive buffers (all microbatches)"] = (
                ends * facts.num_microbatches * cfg.strategy.stages_per_rank
                * facts.boundary_bytes)
        return terms

    # ------------------------------------------------------------- the run

    def __init__(self, config: PipelineConfig, setup: TrainSetup):
        super().__init__(config, setup)
        if config.backend == "deepspeed":
            from algorithms.pipeline_deepspeed import DeepSpeedPipe  # only when asked for

            self.engine = DeepSpeedPipe(self)
            return
        self.engine = None
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        M = self.num_microbatches
        chunks = self.eval_chunks()
        stages = [
            PipelineStage(self.compiled(module), c, self.num_chunks, self.comm.device,
                          group=self.grid.pipe.pg)
            for c, module in zip(self.chunk_ids, chunks, strict=True)
        ]
        # the schedules sum microbatch gradients; our loss carries the 1/M itself
        loss_fn = self.scaled_loss
        if config.schedule == "interleaved-1f1b":
            self.schedule = ScheduleInterleaved1F1B(stages, M, loss_fn=loss_fn,
                                                    scale_grads=False)
        else:
            kind = Schedule1F1B if config.schedule == "1f1b" else ScheduleGPipe
            self.schedule = kind(stages[0], M, loss_fn=loss_fn, scale_grads=False)
        self.holds_first = 0 in self.chunk_ids
        self.holds_last = self.num_chunks - 1 in self.chunk_ids

    def scaled_loss(self, logits, targets):
        return self.loss_fn(logits, targets) / self.num_microbatches

    def example(self, chunk: int, batch: int) -> torch.Tensor:
        """An example input of chunk `chunk` (chunk num_chunks: the logits)."""
        cfg = unwrap(self.setup.model).cfg
        device = self.comm.device
        if chunk == 0:
            return torch.zeros(batch, cfg.seq_len, dtype=torch.long, device=device)
        width = cfg.vocab_size if chunk == self.num_chunks else cfg.n_embd
        return torch.zeros(batch, cfg.seq_len, width, device=device)

    def run_schedule(self, batch) -> tuple[float | None, float]:
        if self.engine is not None:
            return self.engine.run(batch)
        x, y = batch
        args = (x,) if self.holds_first else ()
        losses: list[torch.Tensor] = []
        recorder = P2PRecorder(self.comm)
        autocast = self.setup.autocast
        with recorder.active(), autocast() if autocast else contextlib.nullcontext():
            if self.holds_last:
                self.schedule.step(*args, target=y, losses=losses, return_outputs=False)
            else:
                self.schedule.step(*args, return_outputs=False)
        idle_s = recorder.finish()
        loss = torch.stack(losses).sum().item() if self.holds_last else None
        return loss, idle_s

    def apply_update(self) -> float:
        if self.engine is not None:
            return self.engine.update()
        return super().apply_update()


    def bubble_theory(self) -> float:
        """(S-1)/(V*M+S-1): V model chunks per rank (V = 1 but for interleaved-1f1b)."""
        S, M, V = self.grid.num_stages, self.num_microbatches, len(self.chunk_ids)
        return (S - 1) / (V * M + S - 1)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


class P2PRecorder:
    """Wraps torch.distributed.pipelining's `_batch_p2p` so its traffic reaches the ledger
    and its waits the step's idle seconds.

    Marks are taken on the clock of the rank's device (algorithms/ddp.py): CUDA events on
    the current stream, host times on CPU. On NCCL `wait()` returns at once (it only makes
    the compute stream wait for the transfer), so host times around it would give a bubble
    of ~0 and leave the wait inside compute, where the critical-path projection would
    price the bubble a second time; the events bracket what the compute stream really
    waited. The marks are read once, by `finish()`, after the schedule's step.
    """

    def __init__(self, comm, clock=None):
        self.comm = comm
        self.clock = clock if clock is not None else clock_for(comm.device)
        self.waits: list[tuple[object, object]] = []
        """(mark before, mark after) of each work's first wait."""
        self.batches: list[_Batch] = []
        """Batches fully waited on, in completion order (recorded by `finish`)."""

    @contextlib.contextmanager
    def active(self):
        from torch.distributed.pipelining import schedules

        original = schedules._batch_p2p

        def recorded(p2p_ops, desc=None):
            return self.track(p2p_ops, original(p2p_ops, desc))

        schedules._batch_p2p = recorded
        try:
            yield
        finally:
            schedules._batch_p2p = original

    def track(self, ops: list, works: list) -> list:
        """The works of one batch of p2p `ops`, wrapped to be timed and recorded."""
        batch = _Batch(self, ops, len(works))
        return [_RecordedWork(w, batch) for w in works]

    def completed(self, batch: _Batch) -> None:
        """Every work of `batch` has been waited on: emulation holds it here (on the host,
        until its modelled time from issue), its end is marked."""
        if self.comm.delay is not None:
            batch.held_s = self.comm.hold(batch.kind, batch.nbytes, batch.host_start,
                                          peers=batch.peers)
        batch.end = self.clock.mark()
        self.batches.append(batch)

    def finish(self) -> float:
        """After the step: read the marks, record each batch, return the idle seconds."""
        self.clock.synchronize()
        for b in self.batches:
            seconds = b.held_s if b.held_s is not None else self.clock.seconds(b.start, b.end)
            self.comm.record(b.kind, b.nbytes, seconds, peers=b.peers, **b.extra)
        idle_s = sum(self.clock.seconds(before, after) for before, after in self.waits)
        self.waits, self.batches = [], []
        return idle_s


class _Batch:
    """One `_batch_p2p` call: its record once the last of its works has been waited on."""

    def __init__(self, recorder: P2PRecorder, ops: list, num_works: int):
        self.recorder, self.remaining = recorder, num_works
        if recorder.comm.delay is not None:
            # emulation: the modelled link starts when the device reaches the transfer,
            # not when the host queued it ahead of the GPU (issue 46); a no-op on CPU
            recorder.comm.synchronize()
        self.host_start = time.perf_counter()
        self.start = recorder.clock.mark()
        self.end = None
        self.held_s: float | None = None
        sent = [op for op in ops if op.op is dist.isend]
        received = [op for op in ops if op.op is not dist.isend]
        self.kind = "exchange" if sent and received else ("send" if sent else "recv")
        self.nbytes = sum(_nbytes(op.tensor) for op in (sent if sent else received))
        self.peers = tuple(sorted({op.peer for op in ops}))
        self.extra = {}
        if self.kind == "exchange":
            self.extra["peer_nbytes"] = tuple(
                sum(_nbytes(op.tensor) for op in sent if op.peer == peer) for peer in self.peers)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _RecordedWork:
    """A dist.Work whose first wait is marked (idle) and completes its batch's record."""

    def __init__(self, work, batch: _Batch):
        self.work, self.batch, self.waited = work, batch, False

    def wait(self, *args, **kwargs):
        recorder = self.batch.recorder
        before = recorder.clock.mark()
        result = self.work.wait(*args, **kwargs)
        if not self.waited:
            self.waited = True
            self.batch.remaining -= 1
            if self.batch.remaining == 0:  # an emulated link holds here: idle too
                recorder.completed(self.batch)
            recorder.waits.append((before, recorder.clock.mark()))
        return result

    def __getattr__(self, name):
        return getattr(self.work, name)
