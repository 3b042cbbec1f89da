"""Stop requests: a signal asks a run to checkpoint at the next step boundary and stop.

    commbench run configs/ddp-tiny.yaml        # Ctrl-C, kill -TERM, a closed ssh session...
    commbench run --resume RUN_DIR             # ...then this continues from that step

Two sides. The launcher's (`stop_signals`, `relaying`, `Stopped`: bench/launch/run.py and the
sweep executors use them) and the ranks' (`StopRequest`, `handle_signals`: bench/run/train.py).

`STOP_SIGNALS` (SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2) all mean "stop soon, losing
nothing": every rank finishes its step, the ranks agree on one step, save their state there
(bench/run/checkpoint.py) and the run ends recorded `interrupted` (partial: `--resume` or the
next sweep continues it bit-exactly). Who receives them: a Slurm job's processes all do
(the time limit's warning, sbatch `--signal`, and the scheduler's SIGTERM on preemption
or requeue); a terminal's Ctrl-C or a closed ssh session reaches the launcher, which relays
its first signal to its ranks (bench/launch/run.py; torchrun ignores them,
bench/launch/torchrun.py).

How the ranks agree, adding nothing to a step or between steps (a collective per step
would align the ranks and move their waits out of the measured steps, bench/run/meter.py):
a rank that receives a signal asks every rank to stop through the process group's store
(`request`) and goes on. Each rank's watcher thread, woken by that request, publishes the
step boundary its rank reaches next; the stop step is the largest, so that every rank can
still reach it (every rank stops at the first boundary at or after it: the same one). A
rank waits only at a boundary after a request, for the others' watchers (threads, never
blocked by their ranks' steps), at most `checkpoint.timeout_s`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from bench.run.files import write_text
from bench.run.records import RunDir

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
"""Signals that stop a run at the next step boundary, with a checkpoint."""

STARTED = "COMMBENCH_RANK_STARTED"
"""The first line of every rank's output (`announce_start`): the launcher's bound on
torchrun's rendezvous ends when it reads one (bench/launch/torchrun.py `run`)."""


def announce_start() -> None:
    """What each rank prints first: its rendezvous is complete (the rank's half of
    bench/launch/torchrun.py's start protocol; `die_with_parent` is the other)."""
    print(STARTED, flush=True)



class Stopped(KeyboardInterrupt):
    """A stop signal ended the run; `signum` is the launcher's first (bench/launch/run.py)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Terminated(Stopped):
    """SIGTERM (a scheduler's stop): the conventional exit status is 143."""


# ------------------------------------------------------------------ the launcher's side
# Process-wide: a sweep may run several launches at once, in threads, and only the main
# thread receives signals. The torchruns this process runs, and the stop signals received.
_running: dict[subprocess.Popen, RunDir] = {}
_stops: list[int] = []


def stop_received() -> int | None:
    """The first stop signal this process received inside `stop_signals`, or None."""
    return _stops[0] if _stops else None


@contextlib.contextmanager
def stop_signals():
    """Inside, STOP_SIGNALS stop the torchruns of this process that are `relaying`: the
    first is relayed to their ranks; a second SIGINT, SIGTERM or SIGHUP kills them, and it
    or any signal while no torchrun runs raises `Stopped` at once. Main thread only
    (elsewhere it does nothing); nested uses share the outermost's."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is _on_stop_signal):
        yield
        return
    previous = {signum: signal.signal(signum, _on_stop_signal) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stops.clear()


@contextlib.contextmanager
def relaying(proc: subprocess.Popen, run: RunDir):
    """While inside, stop signals received by this process go to `proc`'s ranks (proc: a
    torchrun training `run`), including one received just before."""
    _running[proc] = run
    try:
        if _stops:
            _ask_ranks_to_stop(proc, run, _stops[0])
        yield
    finally:
        del _running[proc]


def _on_stop_signal(signum, frame):
    first = not _stops
    _stops.append(signum)
    running = list(_running.items())
    if running and (first or signum in (signal.SIGUSR1, signal.SIGUSR2)):
        for proc, run in running:
            _ask_ranks_to_stop(proc, run, signum)
        return
    for proc, _ in running:  # a second stop: at once (their ranks die with them)
        proc.kill()
    for signum_ in STOP_SIGNALS:  # one stop at once; let the recording finish
        signal.signal(signum_, signal.SIG_IGN)
    raise (Terminated if signum == signal.SIGTERM else Stopped)(signum)


def _ask_ranks_to_stop(proc: subprocess.Popen, run: RunDir, signum: int) -> None:
    """Relay a stop to a torchrun's ranks: the mark first (a rank that starts later reads
    it, bench/run/train.py), then the signal to each rank already started."""
    write_text(run.stop_request, signal.Signals(signum).name)
    for pid in _children(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc; none elsewhere)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid:
            children.append(int(stat.parent.name))
    return children


# ---------------------------------------------------------------------- the ranks' side

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
