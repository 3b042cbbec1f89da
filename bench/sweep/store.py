"""The sweep's record store: which runs are recorded, moving old records aside, the lock,
and NAME/sweep.json (run id -> variant, seed, grid point), which the report reads.

    commbench sweep configs/quickstart.yaml    # skips runs recorded here, retires partial ones

A run's record is OUTPUT_DIR/NAME/RUN_NAME-ID/ (see bench/sweep/__init__.py); records are
never deleted: a record that is trained again moves to NAME/_retired/ first.
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench import records

if TYPE_CHECKING:
    from bench.sweep.spec import SweepRun, SweepSpec


@dataclass
class RunOutcome:
    """A run of the sweep, its record and what this invocation did with it."""

    run: SweepRun
    run_dir: Path
    status: str
    """ok, failed, diverged, partial (killed), or new (dry run: not started)."""
    launched: bool
    """Whether this invocation trained it (False: skipped, already recorded)."""
    error: str | None = None


def record_state(run_dir: Path) -> str:
    """`new` when nothing is recorded at run_dir, else records.status_of its summary
    (a torn summary.json, from a run killed while writing it, reads as partial)."""
    if not records.RunDir(run_dir).holds_records():
        return "new"
    try:
        summary = records.read_summary(run_dir)
    except ValueError:
        summary = None
    return records.status_of(summary)


def find_run_dir(sweep_dir: Path, run: SweepRun) -> Path:
    """The run's record, keyed on the hash (any NAME-HASH directory), else the new path."""
    expected = sweep_dir / run.dir_name
    if expected.exists():
        return expected
    matches = sorted(p for p in sweep_dir.glob(f"*{run.run_id}")
                     if p.is_dir() and (p.name == run.run_id or p.name.endswith("-" + run.run_id)))
    return matches[0] if matches else expected


def retire(run_dir: Path, sweep_dir: Path) -> Path:
    """Move a record aside to SWEEP/_retired/NAME.N (never deleted), holding its run
    directory's lock: `records.Busy` when another process (a hand `--resume`) writes it."""
    retired = sweep_dir / "_retired"
    with records.RunDir(run_dir).lock("commbench sweep (moving it to _retired/)"):
        retired.mkdir(parents=True, exist_ok=True)
        n = 1
        while (retired / f"{run_dir.name}.{n}").exists():
            n += 1
        dest = retired / f"{run_dir.name}.{n}"
        shutil.move(str(run_dir), str(dest))
    return dest


def check_not_held(run_dirs: list[Path]) -> None:
    """`records.Busy` naming the first run directory another process holds (a hand
    `--resume` or `eval`): checked before a sweep changes any record."""
    for run_dir in run_dirs:
        holder = records.RunDir(run_dir).holder()
        if holder is not None:
            raise records.Busy(f"run directory {run_dir}", holder)


@contextlib.contextmanager
def sweep_lock(sweep_dir: Path):
    """One sweep process per sweep directory: a second one would retire the first's runs.
    NAME/.sweep.lock, held with records.hold (a flock the kernel releases when the holder
    dies: never stale); a second sweep is refused naming the holder (`records.Busy`)."""
    with records.hold(sweep_dir / ".sweep.lock", "commbench sweep",
                      f"sweep directory {str(sweep_dir)!r}"):
        yield


def write_sweep_json(spec: SweepSpec, run_dirs: dict[str, Path]) -> None:
    path = spec.sweep_dir / "sweep.json"
    old = records.read_json(path) if path.exists() else {}
    entries = dict(old.get("runs", {}))
    for run in spec.runs:
        entries[run.run_id] = {
            "dir": run_dirs[run.run_id].name, "variant": run.variant, "seed": run.seed,
            "label": run.label, "point": run.point, "overrides": run.overrides,
            "strategy": run.config.strategy.name,
        }
    records.write_json(path, {
        "name": spec.name,
        "spec": str(spec.path),
        "description": spec.description,
        "target_loss": spec.target_loss,
        "axes": {"grid": list(spec.grid), "zip": [list(g) for g in spec.zip],
                 "seeds": spec.seeds, "variants": list(spec.variants)},
        "runs": entries,
    })

