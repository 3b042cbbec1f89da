"""Files written whole or not at all, and JSON records read back: the writes under a run's
records (bench/run/records.py `RunDir` names the files; this module writes them).

Every file is replaced atomically (`write_text`, `write_bytes`, `write_json`,
`write_jsonl`, `atomic` for a writer such as `torch.save`: a temporary file beside the
target, fsync'd, renamed over it), so a reader never sees half a file, and a symbolic link
at the target is replaced, never followed. A JSON-lines file is appended a whole row at a
time (`append_jsonl`) and its readers skip a torn last line (`read_jsonl`). A full disk
(`NO_SPACE`) raises OSError naming the file and leaves the old one as it was; `overwrite`
is the in-place last resort of a record that must say why the run failed. Split from
records.py (issue 44: no file over 500 lines); imports nothing of bench.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

UMASK = os.umask(0o022)  # read the process umask (setting it back at once)
os.umask(UMASK)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write a file atomically: a reader sees the old content or the new, never a part."""
    write_bytes(path, text.encode())


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """`write_text` for bytes. The new file replaces `path` itself: a symbolic link there
    is replaced, never followed. A full disk raises OSError naming `path` and leaves the
    old file as it was."""
    path = Path(path)
    with atomic(path) as f:
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
def atomic(path: Path) -> Iterator[_Writes]:
    """A temporary file beside `path`, renamed over it when the block ends (fsync'd first);
    on any failure removed, the write's OSError raised naming `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    f = os.fdopen(fd, "wb")
    try:
        os.chmod(tmp, 0o666 & ~UMASK)  # mkstemp makes 0600; records are ordinary files
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
    of a record that must say why the run failed (bench/run/records.py `RunDir.update_summary`)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o666 & ~UMASK)
    try:
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=jsonable) + "\n")


def jsonable(value: Any) -> Any:
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


def write_jsonl(path: str | os.PathLike, rows: list[dict]) -> None:
    """Replace a JSON-lines file atomically."""
    write_text(path, "".join(json.dumps(row, default=jsonable) + "\n" for row in rows))


def append_jsonl(path: str | os.PathLike, row: dict) -> None:
    """Append one row, whole or not at all: a write cut short (a full disk) is truncated
    away and raises OSError naming `path`, so the file never holds a torn row."""
    data = (json.dumps(row, default=jsonable) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                 0o666 & ~UMASK)
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
