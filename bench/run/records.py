"""Run records: the run directory (`RunDir`, the one owner of its paths), its lock, its status.

A run directory (`commbench run` prints its path) holds:

    config.yaml     the resolved config (its hash is the run's identity)
    env.json        code identity (git commit, dirty-diff hash), packages, host, devices
    metrics.jsonl   one object per logged step; validation rows carry val_loss
    comm.jsonl      CommLedger aggregates by (phase, op, tier, group size)
    summary.json    status ok|failed|diverged|running, totals, projections, eval numbers
                    (its schema: bench/run/summary.py)
    eval.json       lm-eval results (after `commbench eval`)
    tracking.json   what each tracking sink already holds (bench/study/tracking/sync.py)
    .lock           held by the process writing the run (`RunDir.lock`); names it
    checkpoints/    final.pt (evaluation model), state-step{N}/ (the resumable state after
                    step N: bench/run/dcp_state.py), state-rank{N}.pt (the format before)
    logs/           torchrun.log (every rank's output), error-rank{N}.txt, eval.log,
                    node{N}.json (a node's host and ranks), stop-request (bench/run/stop.py)

Every file is replaced atomically (temp file + rename; `torch.save` too), so a reader
never sees half a file; metrics.jsonl is appended line by line and readers skip a torn
last line (the writes and JSON readers: bench/run/files.py). Nothing outside this module
spells a file name of the run directory; who may write it now is its lock (`hold`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import random
import socket
import stat
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.run.files import (
    NO_SPACE,
    UMASK,
    append_jsonl,
    atomic,
    jsonable,
    overwrite,
    read_json,
    read_jsonl,
    write_json,
    write_jsonl,
)

ENDED_STATUSES = ("ok", "failed", "diverged")
"""How a run ended, as summary.json records it."""
DONE_STATUSES = ("ok", "diverged")
"""Statuses of a finished run that a re-run keeps (a diverged run is a result)."""
SUMMARY_ESSENTIALS = ("status", "error", "interrupted", "run_name", "config_hash", "strategy",
                      "world_size", "started", "resumed_from_step", "steps_extended_from")
"""What summary.json keeps when nothing else fits on a full disk (RunDir.update_summary)."""


def status_of(summary: dict | None) -> str:
    """ok, failed or diverged as recorded; partial for a run killed or stopped midway.

    Partial: no summary (killed before writing it), status still running (killed while
    training), or `interrupted` (stopped with Ctrl-C: recorded failed, but trained again
    on re-run, not kept as a failure)."""
    if not summary or summary.get("status") not in ENDED_STATUSES or summary.get("interrupted"):
        return "partial"
    return summary["status"]


def check_report_dir(path: str | os.PathLike, flag: str) -> Path:
    """Where a command writes pages or figures (`report -o`, `compare -o`, `claims
    --report-dir`): ValueError naming `flag` when a file stands in the way, when it is (or
    is inside) a run directory, whose records a report would mix with, or when it already
    holds a symbolic link or special file (a received directory: a link would make the
    report write outside it). Creates nothing."""
    p = Path(path).expanduser().absolute()
    for ancestor in (p, *p.parents):
        if not ancestor.exists():
            continue
        if not ancestor.is_dir():
            raise ValueError(f"{flag} {str(path)!r}: {str(ancestor)!r} is a file, not a "
                             "directory (give a directory path)")
        if RunDir(ancestor).holds_records():
            raise ValueError(f"{flag} {str(path)!r}: {str(ancestor)!r} is a run directory "
                             "(it holds config.yaml or summary.json); write the report "
                             "elsewhere, e.g. reports/NAME")
    if p.is_dir():
        for dirpath, dirnames, filenames in os.walk(p):
            for name in dirnames + filenames:
                entry = Path(dirpath) / name
                if entry.is_symlink() or not (entry.is_dir() or entry.is_file()):
                    raise ValueError(f"{flag} {str(path)!r}: {entry} is a symbolic link or "
                                     "special file; give a new or plain directory")
    return p


def linked_dirs(root: str | os.PathLike) -> list[Path]:
    """Symbolic links to directories under `root` (`root` itself excepted), not followed:
    readers of a results tree skip them (a received tree's link could point anywhere), and
    each should be named, not skipped without a word."""
    found = []
    for dirpath, dirnames, _ in os.walk(root):
        dirnames.sort()
        for name in dirnames:
            entry = Path(dirpath) / name
            if entry.is_symlink():
                found.append(entry)
    return found


def read_summary(run_dir: str | os.PathLike) -> dict | None:
    """The run's summary.json, or None when it has none yet."""
    return RunDir(run_dir).read_summary()


def update_summary(run_dir: str | os.PathLike, updates: dict) -> dict:
    """Merge `updates` into summary.json atomically; returns the new summary."""
    return RunDir(run_dir).update_summary(updates)


# ------------------------------------------------------------------------------ locks


class Busy(ValueError):
    """Another process holds a lock (`hold`): the message names it (what, pid, host, since).
    A ValueError: the command line prints it and exits 2, having changed nothing."""

    def __init__(self, what: str, holder: dict | None):
        self.holder = holder
        super().__init__(f"{what} is in use by {describe_holder(holder)}; wait for it to "
                         "end, or stop it (two writers would mix their records)")


def describe_holder(holder: dict | None) -> str:
    """`commbench run --resume (pid 123 on host h, since 2026-...)`, from a lock's content."""
    if not holder:
        return "another process (it has not said which yet)"
    return (f"{holder.get('purpose', 'another process')} (pid {holder.get('pid')} on host "
            f"{holder.get('host')}, since {holder.get('since')})")


_HELD: dict[tuple[str, int], list] = {}  # (lock path, thread) -> [fd, depth]
_HELD_GUARD = threading.Lock()


@contextlib.contextmanager
def hold(path: str | os.PathLike, purpose: str, what: str, shared: str | None = None
         ) -> Iterator[None]:
    """Hold the lock file `path` (created if absent) while the block runs; `Busy` (naming
    the holder: `purpose`, pid, host, since) when another process holds it.

    An advisory `flock` (released by the kernel when the holder dies, so a killed process
    never leaves a stale lock; NFS v4 carries it between hosts). The holder's description
    is the file's content. Re-entrant in one thread (the same process and thread may nest
    `hold`s of one path); another thread or process is refused. `shared`: a key; holders
    passing the same key hold the lock together (the nodes of one multi-node run), any
    other holder is refused (after up to SHARED_SETTLE_S), and the last one out clears the
    description; a description that nobody holds (its holders killed) is replaced
    (`_hold_shared`). `what` names the locked thing in the message."""
    path = Path(path)
    key = (os.path.realpath(path), threading.get_ident())
    with _HELD_GUARD:
        if key in _HELD:
            _HELD[key][1] += 1
            nested = True
        else:
            nested = False
    if nested:
        try:
            yield
        finally:
            with _HELD_GUARD:
                _HELD[key][1] -= 1
        return
    fd = _open_lock(path, what)
    try:
        holder = {"purpose": purpose, "pid": os.getpid(), "host": socket.gethostname(),
                  "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "shared": shared,
                  "command": " ".join(sys.argv)}
        if shared:
            _hold_shared(fd, shared, holder, what)
        else:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise Busy(what, _lock_content(fd)) from None
            _set_lock_content(fd, holder)
        with _HELD_GUARD:
            _HELD[key] = [fd, 1]
        try:
            yield
        finally:
            with _HELD_GUARD:
                del _HELD[key]
            if not shared:
                _set_lock_content(fd, None)
            else:  # the last shared holder clears the description (a failed try drops the lock)
                with contextlib.suppress(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    _set_lock_content(fd, None)
    finally:
        os.close(fd)  # releases the flock


SHARED_SETTLE_S = 5.0
"""How long a shared holder (`hold(shared=KEY)`) keeps trying before it is refused, while the
lock's description names another key: the time the nodes of one run that all find a
stale description take to agree which of them replaces it."""


def _hold_shared(fd: int, shared: str, holder: dict, what: str) -> None:
    """Take the flock of `fd` shared with the holders of key `shared`, or raise `Busy`.

    The lock's description names the key of the holders now; a description nobody holds
    is stale: a holder killed (a lost node: SIGKILL, no `finally`) never cleared it, and
    the next attempt of the same multi-node run has another key (its rendezvous endpoint,
    whose port a Slurm job takes from its id). So, holding the flock shared, a description
    of another key is replaced if the flock can become exclusive (nobody else holds it). A
    failed conversion drops the flock (flock(2) is not atomic there), and another node of
    the same attempt may be converting at that moment: try again, a little later, for
    SHARED_SETTLE_S, before naming the other holder."""
    deadline = time.monotonic() + SHARED_SETTLE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # an exclusive holder, or one of ours replacing a description
            pass
        else:
            present = _lock_content(fd)
            if not present:
                _set_lock_content(fd, holder)
                return
            if present.get("shared") == shared:
                return
            try:  # another key: stale unless someone else holds the flock
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass  # someone does (and this fd's shared flock is gone)
            else:
                _set_lock_content(fd, holder)
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # let the other nodes in
                    return
                except BlockingIOError:
                    pass  # taken exclusively in between: its holder wrote its description
        if time.monotonic() >= deadline:
            raise Busy(what, _lock_content(fd))
        time.sleep(random.uniform(0.02, 0.2))


def holder_of(path: str | os.PathLike) -> dict | None:
    """Who holds the lock file `path` now (its description), or None when nobody does.
    Creates nothing; a lock held by this very thread reads as held."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:  # absent, a directory or unreadable: not a lock anyone holds
        return None
    try:  # any lock on another open file (this process's too) refuses this one
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _lock_content(fd) or {}
    finally:
        os.close(fd)


def _open_lock(path: Path, what: str) -> int:
    try:  # never through a symlink: a received directory's lock may point anywhere
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666 & ~UMASK)
    except IsADirectoryError:
        raise ValueError(f"{what}: its lock {path} is a directory; remove it (a lock is a "
                         "file that commbench creates)") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ValueError(f"{what}: its lock {path} is a symbolic link; remove it (a "
                             "lock is a file that commbench creates)") from None
        raise ValueError(f"{what}: cannot create its lock {path} ({err.strerror}); the "
                         "directory must be writable") from None


def _lock_content(fd: int) -> dict | None:
    try:
        data = os.pread(fd, 4096, 0)
        return json.loads(data) if data.strip() else None
    except (OSError, ValueError):
        return None


def _set_lock_content(fd: int, holder: dict | None) -> None:
    try:
        os.ftruncate(fd, 0)
        if holder is not None:
            os.pwrite(fd, json.dumps(holder).encode(), 0)
    except OSError as err:  # a full disk: the lock holds; only its description is lost
        if err.errno not in NO_SPACE:
            raise


class RunDir:
    """One run directory: where each record and checkpoint lives and how it is written.

        run = RunDir("results/ddp-tiny-1a2b3c4d")
        run.summary                       # .../summary.json
        run.update_summary({"status": "failed", "error": "..."})
        run.save_torch(payload, run.final_checkpoint)

    The trainer, the launcher, lm-eval and the test fixtures (tests/fakes.py) go through
    this class, so a file name is spelled in one place.
    """

    FINAL_CHECKPOINT = Path("checkpoints") / "final.pt"
    """The evaluation model, relative to the run directory (what `commbench eval` loads)."""
    STATE_COMPLETE = "complete.json"  # in a `state_dir` once every rank saved into it

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # ------------------------------------------------------------------------ paths

    config = property(lambda self: self.path / "config.yaml")
    env = property(lambda self: self.path / "env.json")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    comm = property(lambda self: self.path / "comm.jsonl")
    summary = property(lambda self: self.path / "summary.json")
    eval = property(lambda self: self.path / "eval.json")
    tracking = property(lambda self: self.path / "tracking.json")
    checkpoints = property(lambda self: self.path / "checkpoints")
    final_checkpoint = property(lambda self: self.path / RunDir.FINAL_CHECKPOINT)
    lock_file = property(lambda self: self.path / ".lock")
    logs = property(lambda self: self.path / "logs")
    torchrun_log = property(lambda self: self.logs / "torchrun.log")
    eval_log = property(lambda self: self.logs / "eval.log")

    def holds_records(self) -> bool:
        """Whether this directory holds a run's records (config.yaml or summary.json)."""
        return self.config.is_file() or self.summary.is_file()

    def state_dir(self, step: int) -> Path:
        """The resumable state after `step` steps: a DCP directory (bench/run/dcp_state.py)."""
        return self.checkpoints / f"state-step{step}"

    def state_dirs(self) -> list[tuple[int, Path]]:
        """(step, path) of every `state_dir`, complete or not, by step."""
        found = [(p.name[len("state-step"):], p) for p in self.checkpoints.glob("state-step*")]
        return sorted((int(step), p) for step, p in found if step.isdigit() and p.is_dir())

    def state_checkpoint(self, rank: int) -> Path:
        """Rank `rank`'s state in the per-rank format before `state_dir` (still read)."""
        return self.checkpoints / f"state-rank{rank}.pt"

    def pending_state_checkpoint(self, rank: int) -> Path:
        """Rank `rank`'s per-rank state being saved (replaced state_checkpoint once saved)."""
        return self.checkpoints / f"state-rank{rank}.pt.next"

    def state_files(self) -> list[Path]:
        """Every rank's per-rank state file, saved or being saved."""
        return sorted(self.checkpoints.glob("state-rank*.pt*"))

    def error_log(self, rank: int) -> Path:
        """The traceback of the exception that ended rank `rank`."""
        return self.logs / f"error-rank{rank}.txt"

    def finished(self, rank: int) -> Path:
        """Written by rank `rank` when its part of the run is done (before the last barrier):
        a failure after every rank wrote one is in teardown, not in the run."""
        return self.logs / f"finished-rank{rank}"

    def all_finished(self, world_size: int) -> bool:
        return all(self.finished(r).exists() for r in range(world_size))

    def node_record(self, node: int) -> Path:
        """Node `node`'s host and global ranks ({host, ranks}; its local rank 0 writes it):
        a failure names the node of a rank that left no trace (bench/launch/failure.py)."""
        return self.logs / f"node{node}.json"

    def node_records(self) -> list[Path]:
        return sorted(self.logs.glob("node*.json"))

    stop_request = property(lambda self: self.logs / "stop-request")
    """The launcher's stop, relayed to the ranks (bench/launch/run.py): a rank that starts
    after the signal reads it (bench/run/train.py)."""

    def error_logs(self) -> list[Path]:
        """Every rank's error text, first written first (the first is usually the cause)."""
        stamped = []
        for path in self.logs.glob("error-rank*.txt"):
            with contextlib.suppress(FileNotFoundError):  # removed since (another node's
                stamped.append((path.stat().st_mtime, path))  # launcher, a new attempt)
        return [path for _, path in sorted(stamped)]

    # ------------------------------------------------------------------------ lock

    @contextlib.contextmanager
    def lock(self, purpose: str, shared: str | None = None) -> Iterator[None]:
        """Hold this run directory while writing it (a context manager): every writer of a
        run's records (`commbench run`, `--resume`, `eval`, `track`, a sweep moving it
        aside) holds it, so a second one fails at once with `Busy` (a ValueError naming the
        holder) instead of mixing records. The directory must exist, and hold only
        directories and regular files (`check_contained`). Re-entrant in one thread;
        `shared`: a key the nodes of one multi-node run share (`records.hold`)."""
        with hold(self.lock_file, purpose, f"run directory {self.path}", shared):
            self.check_contained()
            yield

    def check_contained(self) -> None:
        """ValueError naming the first entry under the directory that is a symbolic link
        or not a regular file: run directories travel (tarballs, shared filesystems), and
        a link would make a writer of this run write outside it (a FIFO would hang it)."""
        for dirpath, dirnames, filenames in os.walk(self.path):
            for name in sorted(dirnames + filenames):
                path = Path(dirpath) / name
                try:
                    mode = path.lstat().st_mode
                except FileNotFoundError:  # gone since listed: another node's atomic write
                    continue  # (a temporary file renamed) or its removal of a stale file
                if stat.S_ISLNK(mode):
                    raise ValueError(
                        f"run directory {self.path}: {path} is a symbolic link (to "
                        f"{os.readlink(path)}); commbench writes a run's records only inside "
                        "its directory: replace the link by what it points to (cp -rL)")
                if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                    raise ValueError(f"run directory {self.path}: {path} is not a regular "
                                     "file or directory; remove it")

    def holder(self) -> dict | None:
        """Who holds this run directory now (purpose, pid, host, since), or None."""
        return holder_of(self.lock_file)

    # ----------------------------------------------------------------------- writes

    def prepare(self) -> None:
        """Create the directory and logs/, and drop error texts, finished marks, node
        records and the stop request of an earlier attempt."""
        self.logs.mkdir(parents=True, exist_ok=True)
        for stale in [*self.error_logs(), *self.logs.glob("finished-rank*"), *self.node_records()]:
            stale.unlink(missing_ok=True)  # the other nodes of the run drop them too
        self.stop_request.unlink(missing_ok=True)

    def read_summary(self) -> dict | None:
        return read_json(self.summary) if self.summary.exists() else None

    def write_summary(self, summary: dict) -> None:
        """Replace summary.json (a new attempt: nothing of the previous one is kept)."""
        write_json(self.summary, summary)

    def update_summary(self, updates: dict) -> dict:
        """Merge `updates` into summary.json atomically; returns the new summary.

        On a full disk (no room for the new file beside the old) the summary is rewritten
        in place, and if it does not fit there either, cut to the run's identity, status
        and error (`SUMMARY_ESSENTIALS`, the error shortened): a run that failed because
        the disk is full still says so."""
        summary = self.read_summary() or {}
        summary.update(updates)
        try:
            write_json(self.summary, summary)
        except OSError as err:
            if err.errno not in NO_SPACE:
                raise
            self._summary_in_place(summary)
        return summary

    def _summary_in_place(self, summary: dict) -> None:
        text = json.dumps(summary, indent=2, default=jsonable) + "\n"
        try:
            overwrite(self.summary, text.encode())
            return
        except OSError as err:
            if err.errno not in NO_SPACE:
                raise
        essentials = {k: summary[k] for k in SUMMARY_ESSENTIALS if k in summary}
        if isinstance(essentials.get("error"), str):
            essentials["error"] = essentials["error"][:1000]
        overwrite(self.summary, (json.dumps(essentials) + "\n").encode())

    def append_metrics(self, row: dict) -> None:
        append_jsonl(self.metrics, row)

    def read_metrics(self, skipped: list[str] | None = None) -> list[dict]:
        return read_jsonl(self.metrics, skipped)

    def write_metrics(self, rows: list[dict]) -> None:
        write_jsonl(self.metrics, rows)

    @staticmethod
    def save_torch(obj: Any, path: Path) -> None:
        """`torch.save` atomically: a crash mid-write leaves the previous file intact."""
        import torch

        with atomic(path) as f:
            torch.save(obj, f)
