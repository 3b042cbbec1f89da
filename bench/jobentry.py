"""The entry point of a Slurm job: plain data in, the runner imported by name at job start.

    commbench sweep configs/sweeps/slurm-example.yaml    # each job calls run_job
    COMMBENCH_SLURM=1 tox -e slurm                        # tests/slurm, on a real Slurm

submitit pickles the function it submits and its arguments into the job folder when the
job is queued, and unpickles them when the job starts, maybe days later and after an
upgrade of this code. A pickled function is an import path: a job queued before a
refactor that moved it would fail at start. So a job holds only `bench.jobentry.run_job`
(this module's promise: that name stays) and plain data: the config as a dict, the run
directory as a string, and the runner as a dotted name, imported when the job starts.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

DEFAULT_RUNNER = "bench.launch.run_config"
"""The runner jobs use unless the sweep was given another: a real training run."""


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

    Imports happen here, at job start, so the job runs the code installed then."""
    from bench.config import from_dict
    from bench.executors import execute_run

    return execute_run(from_dict(config_data), Path(run_dir), resolve(runner), progress=False)
