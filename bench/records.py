"""Run records: the run directory layout, atomic writes and environment capture.

A run directory (`commbench run` prints its path) holds:

    config.yaml     the resolved config (its hash is the run's identity)
    env.json        code identity (git commit, dirty-diff hash), packages, host, devices
    metrics.jsonl   one object per logged step; validation rows carry val_loss
    comm.jsonl      CommLedger aggregates by (phase, op, tier, group size)
    summary.json    status ok|failed|diverged|running, totals, projections, eval numbers
    eval.json       lm-eval results (after `commbench eval`)
    checkpoints/    final.pt (evaluation model), step-N.pt (resumable state)
    logs/           per-rank stdout/stderr and error texts

JSON files are replaced atomically (temp file + rename), so a reader never sees half a
file; metrics.jsonl is appended line by line and readers skip a torn last line.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ENDED_STATUSES = ("ok", "failed", "diverged")
"""How a run ended, as summary.json records it."""
STATUSES = ("running", *ENDED_STATUSES)
DONE_STATUSES = ("ok", "diverged")
"""Statuses of a finished run that a re-run keeps (a diverged run is a result)."""


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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; records are ordinary files
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
    path = Path(run_dir) / "summary.json"
    return read_json(path) if path.exists() else None


def update_summary(run_dir: str | os.PathLike, updates: dict) -> dict:
    """Merge `updates` into summary.json atomically; returns the new summary."""
    summary = read_summary(run_dir) or {}
    summary.update(updates)
    write_json(Path(run_dir) / "summary.json", summary)
    return summary


def write_jsonl(path: str | os.PathLike, rows: list[dict]) -> None:
    """Replace a JSON-lines file atomically."""
    write_text(path, "".join(json.dumps(row, default=_jsonable) + "\n" for row in rows))


def append_jsonl(path: str | os.PathLike, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row, default=_jsonable) + "\n")
        f.flush()


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


def git_identity(repo: Path) -> dict:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, timeout=10, check=True
        ).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        diff = git("diff", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, "diff_sha256": None}
    return {
        "commit": commit,
        "dirty": bool(diff),
        "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
    }


PACKAGES = ("torch", "numpy", "deepspeed", "lm_eval", "tiktoken", "pandas", "commbench")


def capture_env(world_size: int, backend: str, device: str) -> dict:
    import torch

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "git": git_identity(Path(__file__).resolve().parent.parent),
        "packages": versions,
        "python": sys.version.split()[0],
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "gpus": gpus,
        "cuda": torch.version.cuda,
        "world_size": world_size,
        "backend": backend,
        "device": device,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
