"""Sharded replicas (`parallel.shard: fsdp`): one replica's parameters, gradients and
optimizer state spread over its ranks with FSDP2 (`torch.distributed.fsdp.fully_shard`).

    commbench run configs/ddp-tiny.yaml --set parallel.shard=fsdp
    commbench run configs/diloco-tiny.yaml --set parallel.shard=fsdp --set parallel.group_size=2
    pytest tests/test_shard.py

Layout. The replica's ranks (all ranks for DDP; a DiLoCo/Pier replica's `group_size`
ranks) form a 1-D device mesh; every `TransformerBlock` is its own FSDP unit and the root
(embedding, head, a tied weight) another, so a block's parameters are gathered just
before it runs and freed after (`reshard_after_forward`). The model arrives on the meta
device and is sharded first, then each rank materialises only its shards, with the values
the whole model's init gives them (bench/model/common.py), so no rank ever holds |θ|.

What reaches the ledger (algorithms/comm.py), and how:
- FSDP's own collectives, through its public hooks (`set_custom_all_gather`,
  `set_custom_reduce_scatter`): every all-gather (logical bytes = this rank's shard of the
  unit, the contribution) and every reduce-scatter (bytes = the unit's full gradient
  buffer, what the rank hands in), in the phase current when it runs ("train"/"inner" in
  steps, "eval" in validation), with its seconds on the device's clock (host time on the
  CPU, where gloo blocks the calling thread; CUDA events around the op on FSDP's
  communication stream, read after the step). They carry no `lead_s`: the network model
  prices them as exposed. On the CPU that is what happens (gloo runs them synchronously);
  on a GPU FSDP2 overlaps them with compute, which the projection does not credit. Under
  `network.emulate` each op synchronises the device first, so its modelled time starts
  when the device reaches it.
- Gradient clipping's global norm: one all-reduce of a scalar (phase "clip").
- NOT recorded: the full-state gathers that write `final.pt` (end of run, `export_state`)
  and checkpoints' local copies (no communication).
The step's exposed communication (`comm_s`) is the recorded ops' seconds where they block
the host (CPU; any device under emulation); on a GPU it is 0 and the step's compute is the
whole step, an upper bound, as is the projection built on it (`_Recorder`).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)
from torch.distributed.tensor import DTensor

from algorithms.clocks import clock_for
from algorithms.comm import Communicator, Group

SHARDS = ("none", "fsdp")


class _Recorder:
    """Times FSDP's collectives; their ledger records are written by `flush` (after a
    device synchronise on CUDA).

    What counts as the step's exposed communication (the module docstring): the ops'
    seconds where they block the host (the CPU, where gloo runs them synchronously, and
    any device under `network.emulate`, whose modelled link holds the host); none on a GPU
    otherwise, where FSDP2 overlaps them with compute on its own stream and how much of
    them was exposed is not measured. There the step's compute is an upper bound (the
    whole step) and the projection, pricing every op as exposed, one too; subtracting the
    ops' durations instead would understate compute and make every projection of a
    sharded run optimistic (issue 46)."""

    def __init__(self, comm: Communicator, group: Group | None):
        self.comm, self.group = comm, group
        self.clock = clock_for(comm.device)
        self.pending: list[tuple[str, int, float, str, int]] = []
        self.marks: list[tuple[object, object]] = []
        """The device clock's (start, end) of each pending op not timed on the host."""

    @property
    def blocking(self) -> bool:
        """Whether the ops hold the host (their seconds are exposed communication)."""
        return self.comm.device.type == "cpu" or self.comm.delay is not None

    def timed(self, op: str, nbytes: int, call):
        if self.comm.delay is not None:
            # emulation: the modelled link starts when the device reaches the op, not when
            # the host queues it (it would otherwise overlap kernels that have not run)
            self.comm.synchronize()
            start_host = time.perf_counter()
            work = call()
            if work is not None:
                work.wait()
            self.comm.synchronize()
            seconds = self.comm.hold(op, nbytes, start_host, self.group)
            self.pending.append((op, nbytes, seconds, self.comm.current_phase, self.comm.step))
            return None
        start = self.clock.mark()
        work = call()
        if work is not None:  # an explicitly asynchronous op: its wait ends it
            work.wait()
        self.marks.append((start, self.clock.mark()))
        self.pending.append((op, nbytes, -1.0, self.comm.current_phase, self.comm.step))
        return None

    def flush(self) -> float:
        """Write the pending records to the ledger; return the step's exposed seconds: the
        current phase's ops' seconds where they block the host, else 0 (class docstring)."""
        if not self.pending:
            return 0.0
        self.clock.synchronize()
        marks = iter(self.marks)
        phase, seconds = self.comm.current_phase, 0.0
        for op, nbytes, elapsed, op_phase, step in self.pending:
            if elapsed < 0:
                elapsed = self.clock.seconds(*next(marks))
            with self.comm.phase(op_phase):
                saved, self.comm.step = self.comm.step, step
                self.comm.record(op, nbytes, elapsed, self.group)
                self.comm.step = saved
            if op_phase == phase:
                seconds += elapsed
        self.pending, self.marks = [], []
        return seconds if self.blocking else 0.0


class _RecordedAllGather(DefaultAllGather):
    def __init__(self, recorder: _Recorder):
        self.recorder = recorder

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        nbytes = input_tensor.numel() * input_tensor.element_size()
        return self.recorder.timed("all_gather", nbytes, lambda: super(
            _RecordedAllGather, self).__call__(output_tensor, input_tensor, group, async_op))


class _RecordedReduceScatter(DefaultReduceScatter):
    def __init__(self, recorder: _Recorder):
        self.recorder = recorder

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        nbytes = input_tensor.numel() * input_tensor.element_size()
        return self.recorder.timed("reduce_scatter", nbytes, lambda: super(
            _RecordedReduceScatter, self).__call__(output_tensor, input_tensor, group, op,
                                                   async_op))


assert issubclass(_RecordedAllGather, AllGather)
assert issubclass(_RecordedReduceScatter, ReduceScatter)


class ShardedReplica:
    """A model sharded with FSDP2 over one replica's ranks (`group`; None = the world)."""

    def __init__(self, model: nn.Module, comm: Communicator, group: Group | None):
        self.model, self.comm, self.group = model, comm, group
        pg = dist.group.WORLD if group is None else group.pg
        self.mesh = DeviceMesh.from_group(pg, comm.device.type)
        self.size = len(comm.group_ranks(group))
        self.recorder = _Recorder(comm, group)
        units = [m for m in model.modules() if _is_block(m)]
        for unit in units:
            fully_shard(unit, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        for unit in [*units, model]:
            unit.set_custom_all_gather(_RecordedAllGather(self.recorder))
            unit.set_custom_reduce_scatter(_RecordedReduceScatter(self.recorder))

    # ------------------------------------------------------------------ steps

    def no_sync(self):
        """Skip the gradient reduce-scatter (non-final microbatches): gradients accumulate
        unsharded until the last microbatch's backward reduces them."""
        @contextlib.contextmanager
        def context():
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)
        return context()

    def end_step(self) -> float:
        """The step's FSDP records into the ledger; the seconds they took."""
        return self.recorder.flush()

    @torch.no_grad()
    def clip(self, max_norm: float) -> None:
        """Global-norm clipping: the squared norms of this rank's gradient shards, summed
        over the replica with one recorded all-reduce (phase "clip")."""
        grads = [local(p.grad) for p in self.model.parameters() if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float32, device=self.comm.device)
        for g in grads:
            sq += g.float().pow(2).sum()
        if self.size > 1:
            with self.comm.phase("clip"):
                self.comm.all_reduce(sq, "sum", self.group)
        scale = max_norm / (sq.sqrt().item() + 1e-6)
        if scale < 1:
            for g in grads:
                g.mul_(scale)

    @torch.no_grad()
    def mean_loss(self, batches, autocast=None) -> float:
        """`algorithms.base.mean_loss` for a sharded replica: every forward all-gathers
        across the replica, so a rank with fewer batches than another of its replica runs
        forwards on a one-token input (not counted) until they have all finished."""
        was_training = self.model.training
        self.model.eval()
        device = self.comm.device
        count = torch.tensor([len(batches)], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)  # harness reduction, outside the ledger
        total = torch.zeros(2, dtype=torch.float64, device=device)
        filler = torch.zeros(1, 1, dtype=torch.long, device=device)
        for i in range(int(count.item())):
            with autocast() if autocast else contextlib.nullcontext():
                if i < len(batches):
                    x, y = batches[i]
                    _, loss = self.model(x.to(device), y.to(device))
                    total += torch.tensor([loss.item(), 1.0], dtype=torch.float64,
                                          device=device)
                else:
                    self.model(filler)
        self.model.train(was_training)
        dist.all_reduce(total)
        return (total[0] / total[1]).item()

    # ------------------------------------------------------------------ state

    @torch.no_grad()  # to_local() without autograd: the shard's own tensor
    def local_parameters(self) -> list[torch.Tensor]:
        """This rank's shards of the parameters (plain tensors sharing the shards' storage;
        in place writes update the model), in `model.parameters()` order."""
        return [local(p) for p in self.model.parameters()]

    @torch.no_grad()
    def local_gradients(self) -> list[torch.Tensor | None]:
        """This rank's shards of the gradients (None where a parameter has none)."""
        return [None if p.grad is None else local(p.grad) for p in self.model.parameters()]

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model's state, gathered (collective; not recorded: end of run)."""
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                for k, v in self.model.state_dict().items()}

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's shards by state key (checkpoints: same layout on resume)."""
        return {k: local(v).detach().clone() for k, v in self.model.state_dict().items()}

    @torch.no_grad()
    def load_local_state(self, state: dict[str, torch.Tensor]) -> None:
        for k, v in self.model.state_dict().items():
            local(v).copy_(state[k])


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _is_block(module: nn.Module) -> bool:
    """The FSDP units below the root: the model's transformer blocks (bench/model's
    `TransformerBlock`, found by its `block_forward`: algorithms/ does not import bench)."""
    return hasattr(module, "block_forward") and not isinstance(module, FSDPModule)
