"""Stop requests: a signal asks a run to checkpoint at the next step boundary and stop.

    commbench run configs/ddp-tiny.yaml        # Ctrl-C, kill -TERM, a closed ssh session...
    commbench run --resume RUN_DIR             # ...then this continues from that step

`STOP_SIGNALS` (SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2) all mean "stop soon, losing
nothing": every rank finishes its step, the ranks agree on one step, save their state there
(bench/checkpoint.py) and the run ends recorded `interrupted` (partial: `--resume` or the
next sweep continues it bit-exactly). Who receives them: a Slurm job's processes all do
(the time limit's warning, sbatch `--signal`, and the scheduler's SIGTERM on preemption
or requeue); a terminal's Ctrl-C or a closed ssh session reaches the launcher, which relays
its first signal to its ranks (bench/launch.py; torchrun ignores them, bench/torchrun.py).

How the ranks agree, adding nothing to a step or between steps (a collective per step
would align the ranks and move their waits out of the measured steps, bench/meter.py):
a rank that receives a signal asks every rank to stop through the process group's store
(`request`) and goes on. Each rank's watcher thread, woken by that request, publishes the
step boundary its rank reaches next; the stop step is the largest, so that every rank can
still reach it (every rank stops at the first boundary at or after it: the same one). A
rank waits only at a boundary after a request, for the others' watchers (threads, never
blocked by their ranks' steps), at most `checkpoint.timeout_s`.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
from datetime import timedelta

import torch.distributed as dist

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
"""Signals that stop a run at the next step boundary, with a checkpoint."""

_FOREVER = timedelta(days=3650)
_serial = itertools.count()  # one namespace per StopRequest, the same sequence on every rank


class StopRequest:
    """One rank's side of the stop agreement (module docstring). Collective to build: every
    rank builds its own at the same point (the Trainer does).

        stop = StopRequest(rank, world_size, timeout_s)
        stop.request("SIGTERM")       # any rank, any time (a signal handler)
        if stop.reached(step): ...    # at each step boundary: True at the agreed step
        stop.close()                  # after the last boundary every rank passes together
    """

    def __init__(self, rank: int, world_size: int, timeout_s: float):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.reason: str | None = None
        """Why the run stops (a signal's name), once asked on any rank."""
        self.step: int | None = None
        """The agreed stop step, once every rank's watcher has published."""
        self._reached = -1  # the last boundary this rank's loop checked (none yet)
        self._asked = False  # set by the watcher before it reads _reached (see reached())
        self._closed = False
        self._agreed = threading.Event()
        self._client, self._waiter = _stores(next(_serial))
        self._watcher = threading.Thread(target=self._watch, name="stop-watcher", daemon=True)
        self._watcher.start()

    def request(self, reason: str) -> None:
        """Ask every rank to stop at the next boundary they can all reach (returns at once)."""
        if self.reason is None:
            self.reason = reason
        if self._client.add("requests", 1) == 1:  # the first request wakes every rank
            self._client.set("reason", reason)
            keys = [f"wake/{r}" for r in range(self.world_size)]
            self._client.multi_set(keys, ["stop"] * self.world_size)

    @property
    def requested(self) -> bool:
        return self.reason is not None or self._asked

    def reached(self, step: int) -> bool:
        """At the boundary after `step` steps: whether the run stops here. Free until a stop
        is asked; then waits (at most timeout_s) for the ranks to agree on the step."""
        self._reached = step  # written before _asked is read; the watcher does the reverse
        if not self.requested:
            return False
        if not self._agreed.wait(self.timeout_s):
            raise RuntimeError(
                f"rank {self.rank}: a stop was asked ({self.reason}) but the ranks did not "
                f"agree on a stop step within {self.timeout_s:g} s (checkpoint.timeout_s): a "
                "rank is gone or its process group's store does not answer")
        # every rank's next boundary is at most its published one, hence at most the
        # agreed step (or its first, when none had started): all stop at one boundary
        return step >= self.step

    def close(self) -> None:
        """Release the watcher. Call it once every rank has passed its last boundary (after
        a collective that follows it): no rank can then wait for this one's watcher."""
        self._closed = True
        self._client.set(f"wake/{self.rank}", "closed")
        self._watcher.join(timeout=5)

    def _watch(self) -> None:
        try:
            self._waiter.wait([f"wake/{self.rank}"], _FOREVER)
            if self._closed:
                return
            self._asked = True
            # the boundary this rank checks next is at most _reached + 1 (reached() writes
            # _reached before it reads _asked): the largest over ranks is one all can reach
            self.step = _agree_max(self._waiter, self._reached + 1, self.world_size,
                                   timedelta(seconds=self.timeout_s))
            if self.reason is None:
                self.reason = self._waiter.get("reason").decode()
        except Exception:  # the store is gone (the run ended); reached() times out if asked
            return
        self._agreed.set()


def _agree_max(store, value: int, world_size: int, timeout: timedelta) -> int:
    """The largest `value` over every rank (each calls it once), through the store."""
    current = store.compare_set("max", "", str(value))  # set when absent
    while int(current) < value:
        current = store.compare_set("max", current, str(value))
    if store.add("arrived", 1) == world_size:
        store.set("agreed", "1")
    store.wait(["agreed"], timeout)
    return int(store.get("max"))


def _stores(serial: int):
    """Two clients of the process group's store (MASTER_ADDR:MASTER_PORT, set by torchrun):
    one for this rank's requests, one for its watcher, which blocks in `wait`. Keys are
    under a namespace per StopRequest and per torchrun restart."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    prefix = f"commbench/stop/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{serial}/"
    client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
    return dist.PrefixStore(prefix, client), dist.PrefixStore(prefix, client.clone())


def handle_signals(stop: StopRequest) -> None:
    """Make every STOP_SIGNAL a stop request in this process (a rank's main thread)."""

    def handler(signum, frame):
        stop.request(signal.Signals(signum).name)

    for signum in STOP_SIGNALS:
        signal.signal(signum, handler)


def die_with_parent() -> None:
    """Have the kernel kill this process (SIGKILL) when its parent dies (Linux; elsewhere
    nothing): torchrun and the ranks never outlive a killed launcher."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
