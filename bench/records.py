"""Run records: the run directory (`RunDir`, the one owner of its paths) and atomic writes.

A run directory (`commbench run` prints its path) holds:

    config.yaml     the resolved config (its hash is the run's identity)
    env.json        code identity (git commit, dirty-diff hash), packages, host, devices
    metrics.jsonl   one object per logged step; validation rows carry val_loss
    comm.jsonl      CommLedger aggregates by (phase, op, tier, group size)
    summary.json    status ok|failed|diverged|running, totals, projections, eval numbers
                    (its schema: bench/summary.py)
    eval.json       lm-eval results (after `commbench eval`)
    tracking.json   what each tracking sink already holds (bench/tracking/sync.py)
    .lock           held by the process writing the run (`RunDir.lock`); names it
    checkpoints/    final.pt (evaluation model), state-rank{N}.pt (each rank's resumable
                    state at the last `checkpoint.every` step; .pt.next while saving)
    logs/           torchrun.log (every rank's output), error-rank{N}.txt, eval.log,
                    node{N}.json (a node's host and ranks), stop-request (bench/stop.py)

Every file is replaced atomically (temp file + rename; `torch.save` too), so a reader
never sees half a file; metrics.jsonl is appended line by line and readers skip a torn
last line. Nothing outside this module spells a file name of the run directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


_UMASK = os.umask(0o022)  # read the process umask (setting it back at once)
os.umask(_UMASK)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write a file atomically: a reader sees the old content or the new, never a part."""
    write_bytes(path, text.encode())


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """`write_text` for bytes. The new file replaces `path` itself: a symbolic link there
    is replaced, never followed. A full disk raises OSError naming `path` and leaves the
    old file as it was."""
    path = Path(path)
    with _atomic(path) as f:
        f.write(data)


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
"""A full filesystem, or the user's quota on it."""


class _Writes:
    """A binary file that remembers the first OSError of its writes (torch.save's zip
    writer reports a failed write as a RuntimeError about a position, not as the disk
    being full)."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.f.flush()


@contextlib.contextmanager
def _atomic(path: Path) -> Iterator[_Writes]:
    """A temporary file beside `path`, renamed over it when the block ends (fsync'd first);
    on any failure removed, the write's OSError raised naming `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    f = os.fdopen(fd, "wb")
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; records are ordinary files
        writes = _Writes(f)
        try:
            yield writes
            f.flush()
            os.fsync(f.fileno())
        except Exception as err:
            cause = writes.error or (err if isinstance(err, OSError) else None)
            if cause is None:
                raise
            raise OSError(cause.errno, cause.strerror, str(path)) from err
        finally:
            with contextlib.suppress(OSError):  # flushed above, or failing: the file goes
                f.close()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def overwrite(path: Path, data: bytes) -> None:
    """Rewrite `path` in place (truncate, then write): not atomic, but it frees the old
    content's blocks first, so on a full disk it stores what fits in them. The last resort
    of a record that must say why the run failed (`RunDir.update_summary`)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o666 & ~_UMASK)
    try:
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


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


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if isinstance(value, Path | tuple | set):
        return str(value) if isinstance(value, Path) else list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: corrupt JSON ({err})") from None


def read_summary(run_dir: str | os.PathLike) -> dict | None:
    """The run's summary.json, or None when it has none yet."""
    return RunDir(run_dir).read_summary()


def update_summary(run_dir: str | os.PathLike, updates: dict) -> dict:
    """Merge `updates` into summary.json atomically; returns the new summary."""
    return RunDir(run_dir).update_summary(updates)


def write_jsonl(path: str | os.PathLike, rows: list[dict]) -> None:
    """Replace a JSON-lines file atomically."""
    write_text(path, "".join(json.dumps(row, default=_jsonable) + "\n" for row in rows))


def append_jsonl(path: str | os.PathLike, row: dict) -> None:
    """Append one row, whole or not at all: a write cut short (a full disk) is truncated
    away and raises OSError naming `path`, so the file never holds a torn row."""
    data = (json.dumps(row, default=_jsonable) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                 0o666 & ~_UMASK)
    try:
        size = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
            if written != len(data):  # the rest would fail: a full disk
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        except OSError as err:
            os.ftruncate(fd, size)
            raise OSError(err.errno, err.strerror, str(path)) from None
    finally:
        os.close(fd)


def read_jsonl(path: str | os.PathLike, skipped: list[str] | None = None) -> list[dict]:
    """Rows of a JSON-lines file; a torn (partially written) last line is skipped.

    A corrupt line elsewhere raises ValueError, unless `skipped` is given: then every
    unreadable line, the torn last one included, is skipped and described in `skipped`
    ("PATH: skipped a truncated last line", "PATH: skipped corrupt line N")."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            last = i == len(lines) - 1  # a run killed mid-write
            if skipped is not None:
                what = "a truncated last line" if last else f"corrupt line {i + 1}"
                skipped.append(f"{path}: skipped {what}")
            elif not last:
                raise ValueError(f"{path}:{i + 1}: corrupt JSON line") from None
    return rows


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
    other holder is refused. `what` names the locked thing in the message."""
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
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Busy(what, _lock_content(fd)) from None
        holder = {"purpose": purpose, "pid": os.getpid(), "host": socket.gethostname(),
                  "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "shared": shared,
                  "command": " ".join(sys.argv)}
        present = _lock_content(fd) if shared else None
        if present and present.get("shared") != shared:
            raise Busy(what, present)
        if not present:
            _set_lock_content(fd, holder)
        with _HELD_GUARD:
            _HELD[key] = [fd, 1]
        try:
            yield
        finally:
            with _HELD_GUARD:
                del _HELD[key]
            if not shared:  # a shared holder cannot know whether it is the last one
                _set_lock_content(fd, None)
    finally:
        os.close(fd)  # releases the flock


def holder_of(path: str | os.PathLike) -> dict | None:
    """Who holds the lock file `path` now (its description), or None when nobody does.
    Creates nothing; a lock held by this very thread reads as held."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError:  # a directory or unreadable: not a lock anyone holds
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
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666 & ~_UMASK)
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
        run.save_torch(payload, run.state_checkpoint(rank=0))

    The trainer, the launcher, lm-eval and the test fixtures (tests/fakes.py) go through
    this class, so a file name is spelled in one place.
    """

    FINAL_CHECKPOINT = Path("checkpoints") / "final.pt"
    """The evaluation model, relative to the run directory (what `commbench eval` loads)."""

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

    def state_checkpoint(self, rank: int) -> Path:
        """Rank `rank`'s resumable state (strategy, loop state, RNG, ledger)."""
        return self.checkpoints / f"state-rank{rank}.pt"

    def pending_state_checkpoint(self, rank: int) -> Path:
        """Rank `rank`'s state being saved; it replaces state_checkpoint once every rank has
        saved (bench/checkpoint.py: a stop mid-save never leaves the ranks mismatched)."""
        return self.checkpoints / f"state-rank{rank}.pt.next"

    def state_files(self) -> list[Path]:
        """Every rank's state file, saved or being saved."""
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
        a failure names the node of a rank that left no trace (bench/failure.py)."""
        return self.logs / f"node{node}.json"

    def node_records(self) -> list[Path]:
        return sorted(self.logs.glob("node*.json"))

    stop_request = property(lambda self: self.logs / "stop-request")
    """The launcher's stop, relayed to the ranks (bench/launch.py): a rank that starts
    after the signal reads it (bench/train.py)."""

    def error_logs(self) -> list[Path]:
        """Every rank's error text, first written first (the first is usually the cause)."""
        return sorted(self.logs.glob("error-rank*.txt"), key=lambda p: p.stat().st_mtime)

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
                if path.is_symlink():
                    raise ValueError(
                        f"run directory {self.path}: {path} is a symbolic link (to "
                        f"{os.readlink(path)}); commbench writes a run's records only inside "
                        "its directory: replace the link by what it points to (cp -rL)")
                if not (path.is_dir() or path.is_file()):
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
        for stale in [*self.error_logs(), *self.logs.glob("finished-rank*"),
                      *self.node_records()]:
            stale.unlink()
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
        text = json.dumps(summary, indent=2, default=_jsonable) + "\n"
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

        with _atomic(path) as f:
            torch.save(obj, f)
