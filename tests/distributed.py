"""Run a test function on N real processes with a real process group (gloo by default).

    from tests.distributed import run_distributed

    def _check_sum(rank, world_size, scale):      # module level: it is pickled
        t = torch.ones(2) * rank * scale
        dist.all_reduce(t)
        return t.tolist()

    def test_sum():
        assert run_distributed(_check_sum, 2, 3.0, timeout=30) == [[3.0, 3.0]] * 2

Each rank runs in a fresh spawned interpreter with `torch.set_num_threads(1)`, joins a
process group whose store the parent hosts (no free-port race), calls
`fn(rank, world_size, *args, **kwargs)` and sends back its return value. The parent
returns the values in rank order. If a rank raises, the parent raises that exception
(or a RuntimeError if it cannot be pickled) with the rank's traceback as its cause,
after stopping the other ranks. Past `timeout` seconds (start-up included) every child
is killed and TimeoutError is raised.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

HOST = "127.0.0.1"


class RemoteTraceback(Exception):
    """Carries a rank's formatted traceback as the cause of the re-raised exception."""

    def __str__(self) -> str:
        return self.args[0]


def run_distributed(fn, world_size: int, *args, timeout: float = 60, backend: str = "gloo",
                    **kwargs) -> list:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    store = dist.TCPStore(HOST, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout + 30))
    # The group's own timeout outlives ours so that we, not gloo, report a hang; it still
    # frees children if this process dies without killing them.
    group_timeout = timeout + 30
    procs, readers = [], {}
    deadline = time.monotonic() + timeout
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker, daemon=True, name=f"rank{rank}",
                args=(rank, world_size, store.port, backend, group_timeout, writer, fn,
                      args, kwargs),
            )
            p.start()
            writer.close()  # the child holds the only writer: EOF means it died
            procs.append(p)
            readers[reader] = rank
        results: dict[int, object] = {}
        while readers:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(readers.values())
                raise TimeoutError(
                    f"run_distributed({fn.__name__}, world_size={world_size}) did not finish "
                    f"within {timeout}s; ranks still running: {missing}"
                )
            failures = []
            for reader in wait(list(readers), timeout=remaining):
                rank = readers.pop(reader)
                try:
                    ok, payload = pickle.loads(reader.recv_bytes())
                except EOFError:
                    procs[rank].join(1)
                    raise RuntimeError(
                        f"rank {rank} of {fn.__name__} exited with code {procs[rank].exitcode} "
                        "without reporting a result"
                    ) from None
                if not ok:
                    failures.append((payload[2], rank, payload[:2]))
                results[rank] = payload
            if failures:
                # The rank that failed first: a peer's "connection reset" is its consequence
                # and may be read in the same wait.
                _, rank, payload = min(failures)
                _raise_remote(rank, *payload)
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        for reader in readers:
            reader.close()
        del store


def _raise_remote(rank: int, exc_bytes: bytes | None, text: str):
    cause = RemoteTraceback(f"\n\nrank {rank} traceback:\n{text}")
    exc = None
    if exc_bytes is not None:
        try:
            exc = pickle.loads(exc_bytes)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = RuntimeError(f"rank {rank} failed:\n{text}")
    raise exc from cause


def _worker(rank, world_size, port, backend, group_timeout, writer, fn, args, kwargs):
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=HOST, MASTER_PORT=str(port),
    )
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        store = dist.TCPStore(HOST, port, world_size, is_master=False,
                              timeout=timedelta(seconds=group_timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=group_timeout))
        message = (True, fn(rank, world_size, *args, **kwargs))
    except BaseException as exc:
        try:
            exc_bytes = pickle.dumps(exc)
        except Exception:
            exc_bytes = None
        message = (False, (exc_bytes, traceback.format_exc(), time.monotonic()))
    # Plain pickle, not the Connection's ForkingPickler: that one ships tensors as shared
    # memory handles that die with this process.
    try:
        data = pickle.dumps(message)
    except Exception as exc:
        data = pickle.dumps((False, (None, f"rank {rank}: cannot pickle the result: {exc!r}",
                                     time.monotonic())))
    writer.send_bytes(data)
    writer.close()
    if dist.is_initialized():
        dist.destroy_process_group()
