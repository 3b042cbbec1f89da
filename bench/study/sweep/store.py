"""The sweep's record store: which runs are recorded, which can continue from a
checkpoint, moving old records aside, the lock, and NAME/sweep.json (run id -> variant,
seed, grid point), which the report reads.

    commbench sweep configs/quickstart.yaml    # skips runs recorded here, resumes stopped ones

A run's record is OUTPUT_DIR/NAME/RUN_NAME-ID/ (see bench/study/sweep/__init__.py); records are
never deleted: a record that is trained again from step 0 moves to NAME/_retired/ first.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from bench.run import checkpoint, files, records
from bench.run.records import RunDir

if TYPE_CHECKING:
    from bench.study.sweep.spec import SweepRun, SweepSpec


def record_state(run_dir: Path) -> str:
    """`new` when nothing is recorded at run_dir, else records.status_of its summary
    (a torn summary.json, from a run killed while writing it, reads as partial)."""
    if not RunDir(run_dir).holds_records():
        return "new"
    return records.status_of(read_summary(run_dir))


def read_summary(run_dir: Path) -> dict | None:
    """summary.json, or None when it is missing or torn."""
    try:
        return RunDir(run_dir).read_summary()
    except ValueError:
        return None


def resumable(run_dir: Path, world_size: int) -> tuple[int | None, str]:
    """(the step a stopped run continues from, or None; why not, in words): the run's
    checkpoints, every rank's, loaded and at one step (bench/run/checkpoint.py)."""
    try:
        step = checkpoint.verify_states(RunDir(run_dir), world_size)
    except ValueError as err:
        return None, str(err)
    if not step:
        return None, "no checkpoint was saved"
    return step, ""


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


def lock_holder(sweep_dir: Path) -> dict | None:
    """The sweep process that holds the sweep directory now (purpose, pid, host, since),
    or None."""
    return records.holder_of(sweep_dir / ".sweep.lock")


def write_sweep_json(spec: SweepSpec, run_dirs: dict[str, Path]) -> None:
    path = spec.sweep_dir / "sweep.json"
    old = files.read_json(path) if path.exists() else {}
    entries = dict(old.get("runs", {}))
    for run in spec.runs:
        entries[run.run_id] = {
            "dir": run_dirs[run.run_id].name, "variant": run.variant, "seed": run.seed,
            "label": run.label, "point": run.point, "overrides": run.overrides,
            "strategy": run.config.strategy.name,
        }
    files.write_json(path, {
        "name": spec.name,
        "spec": str(spec.path),
        "description": spec.description,
        "target_loss": spec.target_loss,
        "axes": {"grid": list(spec.grid), "zip": [list(g) for g in spec.zip],
                 "seeds": spec.seeds, "variants": list(spec.variants)},
        "runs": entries,
    })

