"""The Communicator: the algorithms' only path to the network, feeding the CommLedger.

Exercised by `pytest tests/test_comm.py` (2 and 4 gloo ranks). Every op goes through
torch.distributed (gloo on CPU, NCCL on GPU); nothing here re-implements a collective.
Each op appends one `CommRecord` to the ledger (algorithms/ledger.py: the records, their
conventions, the ledger). `average` and `average_sparse` run their work from
algorithms/collectives.py (plain, quantized and sparse means). How the strategies' traffic
is accounted is described in docs/algorithms.md.

Ops that span steps (`launch` -> `Pending.wait` -> `Pending.record`): started at the end
of one step, waited for some steps later (Streaming DiLoCo's overlapped outer exchange).
The work runs where the calling thread's compute cannot wait for it: on the CPU on a
thread of its own (gloo blocks the thread that calls it), on CUDA on a side stream (the
host only enqueues). On CUDA this is not enabled yet: the loop and the clocks synchronise
the whole device every step (bench/env.py `synchronize`), which would wait for the side
stream, so `strategy.overlap_steps > 0` is refused there (algorithms/diloco.py); the
CUDA branch is unexercised until they synchronise the current stream. It must run on a group no
other thread uses (collectives on one group must be issued in the same order on every
rank). The record is made at the wait, in the waiting step, with `launch_step` and
`tail_s` (CommRecord): the network model prices its overlap with the compute of the steps
in between (docs/network-model.md, "Ops that span steps").
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from algorithms.collectives import (
    gathered_average,
    mean_in_place,
    quantized_average,
    sparse_average,
    tensor_bytes,
)
from algorithms.ledger import CommLedger, CommRecord


@dataclass(frozen=True)
class Group:
    """A process group: its global ranks (sorted) and the torch ProcessGroup handle."""

    ranks: tuple[int, ...]
    pg: object


class Communicator:
    """Wraps the already-initialised default process group; records every op in the ledger.

    `delay(record) -> seconds` is the optional emulation policy (bench.network.delay_policy):
    an op that finishes faster than the modelled time sleeps for the remainder, so the op
    takes at least that long and the recorded seconds include the sleep.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device | str,
        ledger: CommLedger | None = None,
        delay: Callable[[CommRecord], float] | None = None,
        ranks_per_node: int | None = None,
    ) -> None:
        if ranks_per_node is not None and ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1 or None, got {ranks_per_node!r}")
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.ledger = ledger if ledger is not None else CommLedger()
        self.delay = delay
        self.ranks_per_node = ranks_per_node or 1
        self.step = 0
        self._phase = "train"
        self.groups: list[Group] = []
        """Every group made by `new_group`, in creation order (the same on every rank)."""
        self._side_stream = None
        """CUDA: the stream launched ops run on (made at the first launch)."""

    # ------------------------------------------------------------------ bookkeeping

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Tag the records made inside the block with phase `name` (default phase: train)."""
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous

    @property
    def current_phase(self) -> str:
        return self._phase

    def group_ranks(self, group: Group | None) -> tuple[int, ...]:
        return tuple(range(self.world_size)) if group is None else group.ranks

    def tier(self, ranks: Iterable[int]) -> str:
        node = self.rank // self.ranks_per_node
        same = all(r // self.ranks_per_node == node for r in ranks)
        return "intra" if same else "inter"

    def record(self, op: str, nbytes: int, seconds: float, group: Group | None = None,
               peers: Sequence[int] | None = None, **extra) -> CommRecord:
        """Append a record for traffic timed elsewhere (e.g. the DDP comm hook).

        `extra` sets the optional CommRecord fields (`lead_s`, `peer_nbytes`). The
        emulation delay is not applied here: call `hold` where the op completes.
        """
        rec = self._make_record(op, nbytes, seconds, group, peers, **extra)
        self.ledger.add(rec)
        return rec

    def modelled_seconds(self, op: str, nbytes: int, group: Group | None = None,
                         peers: Sequence[int] | None = None,
                         started: float | None = None) -> float:
        """Seconds from launch the emulation policy says this op takes (0 without a policy).

        `started` is the op's launch (`time.perf_counter()`); the policy queues ops that
        share a link on its own timeline (bench.network.delay_policy), so it must learn when
        each op was launched: it is given a record whose seconds are the time since then.
        """
        if self.delay is None:
            return 0.0
        elapsed = 0.0 if started is None else time.perf_counter() - started
        return self.delay(self._make_record(op, nbytes, elapsed, group, peers))

    def hold(self, op: str, nbytes: int, started: float, group: Group | None = None,
             peers: Sequence[int] | None = None) -> float:
        """Emulation: sleep until the op launched at `started` (a `time.perf_counter()`
        value) has taken its modelled time; return the host seconds since `started`.

        Without an emulation policy it only returns the elapsed seconds.
        """
        remaining = self.modelled_seconds(op, nbytes, group, peers, started) - (
            time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        return time.perf_counter() - started

    def _make_record(self, op, nbytes, seconds, group, peers, **extra) -> CommRecord:
        if peers is not None:
            peers = tuple(sorted(peers))
            involved, size = peers, len(peers) + 1
        else:
            involved = self.group_ranks(group)
            size = len(involved)
            peers = None if group is None else involved
        return CommRecord(step=self.step, phase=self._phase, op=op, group_size=size,
                          peers=peers, nbytes=int(nbytes), seconds=float(seconds),
                          tier=self.tier(involved), **extra)

    @contextmanager
    def _timed(self, op: str, nbytes: int, group: Group | None = None,
               peers: Sequence[int] | None = None, **extra) -> Iterator[None]:
        """Time the block (device-synchronised), apply the emulation delay, record it."""
        self.synchronize()
        start = time.perf_counter()
        yield
        self.synchronize()
        seconds = self.hold(op, nbytes, start, group, peers)
        self.record(op, nbytes, seconds, group, peers, **extra)

    def synchronize(self) -> None:
        """Wait for this rank's queued device work (a no-op on CPU): a host clock started
        after it does not count the rank's own compute."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _pg(self, group: Group | None):
        if group is None:
            return None
        if self.rank not in group.ranks:
            raise ValueError(f"rank {self.rank} is not in group {group.ranks}")
        return group.pg

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, tensor: torch.Tensor, op: str = "avg",
                   group: Group | None = None) -> torch.Tensor:
        """In place: sum or mean of `tensor` over the group; returns `tensor`."""
        if op not in ("avg", "sum"):
            raise ValueError(f"all_reduce op must be 'avg' or 'sum', got {op!r}")
        if op == "avg" and not tensor.is_floating_point():
            raise TypeError(f"all_reduce op='avg' needs a floating tensor, got {tensor.dtype}")
        pg = self._pg(group)
        with self._timed("all_reduce", tensor_bytes(tensor), group):
            if op == "avg":
                mean_in_place(tensor, pg, len(self.group_ranks(group)))
            else:
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=pg)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group | None = None) -> torch.Tensor:
        """In place: `tensor` on every rank of the group becomes global rank `src`'s."""
        pg = self._pg(group)
        if src not in self.group_ranks(group):
            raise ValueError(f"broadcast src must be in {self.group_ranks(group)}, got {src}")
        with self._timed("broadcast", tensor_bytes(tensor), group):
            dist.broadcast(tensor, src=src, group=pg)
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: Group | None = None) -> list[torch.Tensor]:
        """Every group member's `tensor` (same shape everywhere), in group-rank order."""
        pg = self._pg(group)
        out = [torch.empty_like(tensor) for _ in self.group_ranks(group)]
        with self._timed("all_gather", tensor_bytes(tensor), group):
            dist.all_gather(out, tensor.contiguous(), group=pg)
        return out

    def average(self, flat: torch.Tensor, group: Group | None = None, codec=None,
                launch: bool = False, record: bool = True) -> torch.Tensor | Pending:
        """The mean of the flat float tensor `flat` over the group, in the format `codec`
        (None: an all-reduce of `flat` as it is, in place; an `algorithms.compress.
        RowQuantizer`: the quantized exchange of the module docstring, into a new fp32
        tensor). `launch=True`: start it and return a `Pending` (ops that span steps).
        `record=False`: run it untimed and unrecorded, without emulation (a warm-up: NCCL
        sets up what a collective needs at its first call of that kind and size)."""
        size = len(self.group_ranks(group))
        if codec is None:
            op, nbytes = "all_reduce", tensor_bytes(flat)
            work = functools.partial(mean_in_place, flat, size=size)
        else:
            op, nbytes = "quantized_all_reduce", codec.coded_bytes(flat.numel(), size)
            work = functools.partial(quantized_average, flat, codec, size=size)
        return self._run(op, nbytes, work, group, launch, inputs=(flat,), record=record)

    def average_sparse(self, indices: torch.Tensor, values: torch.Tensor, numel: int,
                       group: Group | None = None, launch: bool = False, record: bool = True
                       ) -> torch.Tensor | Pending:
        """The mean over the group of every rank's sparse tensor (`indices`, `values`: the
        same count on every rank) as a dense fp32 tensor of `numel`: one all-gather of the
        values and indices, summed in rank order. `launch`, `record` as in `average`."""
        size = len(self.group_ranks(group))
        work = functools.partial(sparse_average, indices, values, numel, size=size)
        return self._run("all_gather", tensor_bytes(indices) + tensor_bytes(values), work, group,
                         launch, inputs=(indices, values), record=record)

    def average_coded(self, payload: torch.Tensor, decode: Callable[[torch.Tensor], torch.Tensor],
                      group: Group | None = None, launch: bool = False, record: bool = True
                      ) -> torch.Tensor | Pending:
        """The mean over the group of what each rank's `payload` (flat uint8, the same size
        on every rank) decodes to (`decode(payload) -> dense fp32`): one all-gather, the
        decoded payloads summed in rank order. Recorded as an `all_gather` of this rank's
        payload bytes. `launch`, `record` as in `average`."""
        size = len(self.group_ranks(group))
        work = functools.partial(gathered_average, payload, decode, size=size)
        return self._run("all_gather", tensor_bytes(payload), work, group, launch,
                         inputs=(payload,), record=record)

    def _run(self, op: str, nbytes: int, work: Callable, group: Group | None,
             launch: bool, inputs: tuple[torch.Tensor, ...], record: bool = True
             ) -> torch.Tensor | Pending:
        if launch:
            return self.launch(op, nbytes, work, group, inputs)
        pg = self._pg(group)
        if not record:
            result = work(pg)
            self.synchronize()
            return result
        with self._timed(op, nbytes, group):
            result = work(pg)
        return result

    def launch(self, op: str, nbytes: int, work: Callable[[object], torch.Tensor],
               group: Group | None = None, inputs: tuple[torch.Tensor, ...] = ()) -> Pending:
        """Start `work(process group)` (raw torch.distributed calls returning a tensor) and
        return at once (module docstring: ops that span steps). `group` must be one only
        this op uses; `inputs` are the tensors `work` reads (kept alive for the side stream
        on CUDA). Nothing is recorded until `Pending.record`."""
        pg = self._pg(group)
        pending = Pending(self, op, nbytes, group, self.step, time.perf_counter())
        if self.device.type == "cuda":
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(self.device)
            stream = self._side_stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
            for t in inputs:
                t.record_stream(stream)
            pending.start_event = torch.cuda.Event(enable_timing=True)
            pending.done_event = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                pending.start_event.record()
                pending.result = work(pg)
                pending.done_event.record()
            return pending

        def run():
            try:
                pending.result = work(pg)
            except BaseException as err:  # re-raised by wait, on the calling thread
                pending.error = err
            pending.done_at = time.perf_counter()

        pending.thread = threading.Thread(target=run, name=f"commbench-{op}", daemon=True)
        pending.thread.start()
        return pending

    def barrier(self, group: Group | None = None) -> None:
        """Wait for every rank of the group; not recorded (see the module docstring)."""
        dist.barrier(group=self._pg(group))

    def new_group(self, ranks: Sequence[int]) -> Group:
        """A subgroup of global `ranks`.

        Collective over the WORLD: every rank must call `new_group` for every subgroup, in
        the same order, even ranks that are not members (torch.distributed's rule).
        """
        members = tuple(sorted(set(ranks)))
        if not members or members[0] < 0 or members[-1] >= self.world_size:
            raise ValueError(f"group ranks must be in [0, {self.world_size}), got {list(ranks)}")
        group = Group(ranks=members, pg=dist.new_group(list(members)))
        self.groups.append(group)
        return group

    def warm_up(self) -> None:
        """Create the communicators of the world and of every group now, outside the steps.

        NCCL creates a group's communicator lazily, at its first collective: a one-off cost
        (up to seconds at scale) inside whichever step first uses the group, e.g. DiLoCo's
        cross-replica group at its first outer step. One one-element all-reduce per group
        this rank is in, in creation order, each waited for (the same order on every rank,
        so no two ranks wait on each other's groups), then one on the world; not recorded.
        Collective over the world. (Point-to-point pairs are created at their first
        send/receive; a pipeline's are in every step, so its first, warm-up step holds them.)
        """
        probe = torch.zeros(1, device=self.device)
        for group in [*self.groups, None]:
            if group is None or self.rank in group.ranks:
                dist.all_reduce(probe, group=None if group is None else group.pg)
                self.synchronize()

    def split(self, partition: Sequence[Sequence[int]]) -> Group:
        """Create one group per block of `partition` (on every rank); return this rank's."""
        flat = [r for block in partition for r in block]
        if len(flat) != len(set(flat)):
            raise ValueError(f"partition blocks must be disjoint, got {list(map(list, partition))}")
        mine = None
        for block in partition:
            group = self.new_group(block)
            if self.rank in group.ranks:
                mine = group
        if mine is None:
            raise ValueError(f"rank {self.rank} is in no block of {list(map(list, partition))}")
        return mine

    # ------------------------------------------------------------------ point to point

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        with self._timed("send", tensor_bytes(tensor), peers=(dst,)):
            dist.send(tensor.contiguous(), dst=dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into `tensor` (recorded with the received payload's bytes)."""
        with self._timed("recv", tensor_bytes(tensor), peers=(src,)):
            dist.recv(tensor, src=src)
        return tensor

    def start_p2p(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]
                  ) -> tuple[list[dist.P2POp], list]:
        """(ops, works) of point-to-point transfers started now: not waited for, not
        recorded, no device synchronise (on CUDA the host only queues them). The caller
        waits for each work and records the batch on the device's clock
        (algorithms/pipeline.py `P2PRecorder`, as torch's pipeline schedules are). One
        transfer alone is a plain isend/irecv (what `send`/`recv` wait for), more a batch,
        receives first (as `exchange`)."""
        ops = [dist.P2POp(dist.irecv, t, p) for p, t in sorted(recvs.items())]
        ops += [dist.P2POp(dist.isend, t.contiguous(), p) for p, t in sorted(sends.items())]
        if len(ops) == 1:
            (op,) = ops
            return ops, [op.op(op.tensor, op.peer)]
        return ops, dist.batch_isend_irecv(ops)

    def exchange(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> None:
        """Batched isend/irecv: send `sends[peer]` to each peer, receive into `recvs[peer]`.

        Each pair of peers must call it with matching shapes. Recorded as ONE record whose
        peers are all ranks sent to or received from, whose `nbytes` are the bytes sent,
        and whose `peer_nbytes` are the bytes sent to each of those peers.

        The receives are posted before the sends. On gloo each receive sends the peer a
        ready-to-receive notice over the pair's one TCP connection, and a send whose
        peer is already waiting writes its whole payload at once: posted send first, a
        rank arriving after its peer queued its notice behind its own payload, so the
        peer's data only started once all of it had crossed (measured on shaped links:
        2 latencies + 2 S/beta instead of 2 latencies + S/beta; docs/network-model.md,
        "Two-way exchange"). gloo's own ring all-reduce posts its receive first too.
        """
        peers = set(sends) | set(recvs)
        if not peers:
            return
        if self.rank in peers:
            raise ValueError(f"exchange peers must not include this rank {self.rank}")
        ops = [dist.P2POp(dist.irecv, t, p) for p, t in sorted(recvs.items())]
        ops += [dist.P2POp(dist.isend, t.contiguous(), p) for p, t in sorted(sends.items())]
        peer_nbytes = tuple(tensor_bytes(sends[p]) if p in sends else 0 for p in sorted(peers))
        with self._timed("exchange", sum(peer_nbytes), peers=peers, peer_nbytes=peer_nbytes):
            for work in dist.batch_isend_irecv(ops):
                work.wait()


class Pending:
    """An op started by `Communicator.launch`: `wait()` for its result (where the caller
    needs it), then `record(tail_s)` once the caller's work after the wait is done."""

    def __init__(self, comm: Communicator, op: str, nbytes: int, group: Group | None,
                 step: int, started: float):
        self.comm, self.op, self.nbytes, self.group = comm, op, nbytes, group
        self.step, self.started = step, started
        self.result: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.done_at: float | None = None
        self.start_event = self.done_event = None
        self.seconds: float | None = None
        """After `wait`: launch to completion (emulation: at least the modelled time)."""
        self.exposed_s = 0.0
        """After `wait`: how long the caller waited (CUDA: its stream stalled)."""

    def wait(self) -> torch.Tensor:
        """Block the caller (CUDA: its stream) until the op has finished; its result. A
        second wait (after `state_dict`, or restored by `from_state`) waits for nothing."""
        if self.seconds is not None:
            self.exposed_s = 0.0
            return self.result
        comm, cuda = self.comm, self.comm.device.type == "cuda"
        if cuda:
            current = torch.cuda.current_stream(comm.device)
            before = torch.cuda.Event(enable_timing=True)
            before.record()
            current.wait_event(self.done_event)
        else:
            before = time.perf_counter()
            self.thread.join()
            if self.error is not None:
                raise self.error
        modelled = comm.modelled_seconds(self.op, self.nbytes, self.group,
                                         started=self.started)
        remaining = self.started + modelled - time.perf_counter()
        if remaining > 0:  # emulation: the op takes its modelled time from launch
            time.sleep(remaining)
        if cuda:
            after = torch.cuda.Event(enable_timing=True)
            after.record()
            after.synchronize()
            self.exposed_s = before.elapsed_time(after) / 1e3
            measured = self.start_event.elapsed_time(self.done_event) / 1e3
            self.result.record_stream(current)
        else:
            self.exposed_s = time.perf_counter() - before
            measured = self.done_at - self.started
        self.seconds = max(measured, modelled)
        return self.result

    def state_dict(self) -> dict:
        """What a checkpoint keeps of it: its record's fields and its result (waited for)."""
        result = self.wait()
        return {"op": self.op, "nbytes": self.nbytes, "step": self.step,
                "seconds": self.seconds, "result": result.detach().clone()}

    @classmethod
    def local(cls, comm: Communicator, result: torch.Tensor) -> Pending:
        """A launched op with nothing to send (one replica): finished, never recorded."""
        return cls.from_state(comm, None, {"op": None, "nbytes": 0, "step": comm.step,
                                           "seconds": 0.0, "result": result})

    @classmethod
    def from_state(cls, comm: Communicator, group: Group | None, state: dict) -> Pending:
        """A finished op restored from `state_dict` (resume): waiting for it is free."""
        pending = cls(comm, state["op"], state["nbytes"], group, state["step"], 0.0)
        pending.seconds = state["seconds"]
        pending.result = state["result"].to(comm.device)
        return pending

    def record(self, tail_s: float = 0.0) -> CommRecord | None:
        """The op's ledger record, made now (this step, the current phase); None for a
        `local` one."""
        if self.op is None:
            return None
        return self.comm.record(self.op, self.nbytes, self.seconds, self.group,
                                launch_step=self.step, tail_s=tail_s)


