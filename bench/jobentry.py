"""The entry point of a Slurm job: plain data in, the runner imported by name at job start.

    commbench sweep configs/sweeps/slurm-example.yaml    # each job calls run_job
    COMMBENCH_SLURM=1 tox -e slurm                        # tests/slurm, on a real Slurm

submitit pickles the function it submits and its arguments into the job folder when the
job is queued, and unpickles them when the job starts, maybe days later and after an
upgrade of this code. A pickled function is an import path: a job queued before a
refactor that moved it would fail at start. So a job holds only `bench.jobentry.run_job`
(this module's promise: that name stays) and plain data: the config as a dict, the run
directory as a string, and the runner as a dotted name, imported when the job starts.

`execute_run` trains one run, a Slurm job's or the local executor's (bench/executors.py),
and records a run that raised as failed (`record_failure`) instead of stopping the sweep.
"""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable
from pathlib import Path

from bench import records
from bench.config import Config, config_hash, from_dict, to_yaml

DEFAULT_RUNNER = "bench.launch.run_config"
"""The runner jobs use unless the sweep was given another: a real training run."""
Runner = Callable[..., dict]
"""`runner(cfg, run_dir, progress=bool) -> summary dict`, default bench.launch.run_config."""


def runner_name(runner: Callable | None) -> str:
    """The dotted name of a module-level runner function (None: the default runner).

    Raises ValueError for a runner that cannot be imported by name (a lambda, a local
    function, a bound method): a job could not find it."""
    if runner is None:
        return DEFAULT_RUNNER
    module = getattr(runner, "__module__", None)
    qualname = getattr(runner, "__qualname__", "")
    name = f"{module}.{qualname}"
    if not module or module == "__main__" or "<" in qualname or "." in qualname:
        raise ValueError(f"a Slurm job's runner must be a module-level function importable by "
                         f"name, got {runner!r} ({name})")
    return name


def resolve(name: str) -> Callable:
    """The function a dotted name `package.module.function` names, imported now."""
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"runner {name!r} cannot be imported ({type(err).__name__}: {err}); "
                         f"a runner is a dotted name such as {DEFAULT_RUNNER!r}") from None


def run_job(config_data: dict, run_dir: str, runner: str = DEFAULT_RUNNER) -> dict:
    """Train one run inside a Slurm job; returns its summary (a failure is recorded, not raised).

    The runner is imported here, at job start, so the job runs the code installed then."""
    return execute_run(from_dict(config_data), Path(run_dir), resolve(runner), progress=False)



def record_failure(cfg: Config, run_dir: Path, error: BaseException | str) -> dict:
    """A run that raised instead of returning a summary: keep a record with the error."""
    if isinstance(error, BaseException):
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        headline = f"{type(error).__name__}: {error}"
        error = f"{headline}\n{text}"
    run = records.RunDir(run_dir)
    run.path.mkdir(parents=True, exist_ok=True)
    if not run.config.exists():
        records.write_text(run.config, to_yaml(cfg))
    return records.update_summary(run_dir, {
        "status": "failed", "error": str(error), "run_name": cfg.run.name,
        "config_hash": config_hash(cfg), "strategy": cfg.strategy.name,
        "world_size": cfg.parallel.world_size,
    })


def execute_run(cfg: Config, run_dir: Path, runner: Runner | None = None,
                progress: bool = False) -> dict:
    """Train one run; never raises for a run's own failure (records status failed)."""
    runner = runner or resolve(DEFAULT_RUNNER)
    try:
        summary = runner(cfg, run_dir, progress=progress)
    except Exception as err:
        summary = record_failure(cfg, run_dir, err)
    return summary
