"""A Slurm job holds plain data and one stable import path (bench.launch.jobentry.run_job).

    pytest tests/slurm/test_jobentry.py

Defect fixed: jobs queued before an upgrade failed at start, because submitit pickled the
import paths of the job function (bench.executors._slurm_job) and of the runner, and an
upgrade that moved either left the queued job unable to unpickle. Runs submitit's local
executor (the same submission path as Slurm) and reads back what the job file references.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import yaml

from bench.launch import jobentry
from bench.run import records
from bench.study.sweep import run_sweep
from tests.slurm.runners import instant_runner

REPO = Path(__file__).resolve().parents[2]


class _ImportRecorder(pickle.Unpickler):
    """Unpickles, recording every (module, name) the pickle imports."""

    def __init__(self, file):
        super().__init__(file)
        self.imports: set[str] = set()

    def find_class(self, module, name):
        self.imports.add(f"{module}.{name}")
        return super().find_class(module, name)


def _spec(tmp_path: Path) -> Path:
    base = {"run": {"name": "queued", "steps": 4}, "model": {"preset": "tiny", "seq_len": 32},
            "data": {"corpus": "embedded", "batch_size": 2}, "parallel": {"world_size": 1},
            "strategy": {"name": "ddp"}}
    spec = {"name": "jobs", "base": base, "output_dir": str(tmp_path / "results"),
            "report_dir": str(tmp_path / "report"),
            "executor": {"name": "slurm", "cluster": "local", "poll_s": 0.2, "timeout_min": 5}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_queued_job_references_only_the_stable_entry_point(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    result = run_sweep(_spec(tmp_path), runner=instant_runner, report=False)
    assert result.ok, [o.error for o in result.outcomes]
    assert records.read_summary(result.outcomes[0].run_dir)["status"] == "ok"

    [submitted] = (tmp_path / "results" / "jobs" / "_slurm").glob("*/*_submitted.pkl")
    with open(submitted, "rb") as f:
        recorder = _ImportRecorder(f)
        delayed = recorder.load()
    ours = {name for name in recorder.imports if not name.startswith(("submitit.", "builtins."))}
    assert ours == {"bench.launch.jobentry.run_job"}
    config_data, run_dir, runner, resume, max_requeues, warning_signal = delayed.args
    assert isinstance(config_data, dict) and isinstance(run_dir, str)
    assert runner == "tests.slurm.runners.instant_runner"
    assert (resume, max_requeues, warning_signal) == (False, 3, "USR2")  # plain data too


def test_runner_names_round_trip_and_bad_ones_are_refused():
    assert jobentry.runner_name(None) == jobentry.DEFAULT_RUNNER
    assert jobentry.resolve(jobentry.runner_name(instant_runner)) is instant_runner
    with pytest.raises(ValueError, match="module-level function"):
        jobentry.runner_name(lambda cfg, run_dir, progress=True: {})
    with pytest.raises(ValueError, match="'bench.launch.run.no_such_runner' cannot be imported"):
        jobentry.resolve("bench.launch.run.no_such_runner")


def test_jobs_queued_before_the_floors_moved_still_find_their_names():
    """Issue 44 moved bench/jobentry.py to bench/launch/ and bench/launch.py to
    bench/launch/run.py: a job queued before holds the old names of run_job and of the
    default runner, and must still start."""
    import bench.jobentry
    from bench.launch.run import run_config

    assert bench.jobentry.run_job is jobentry.run_job
    assert pickle.loads(b"cbench.jobentry\nrun_job\n.") is jobentry.run_job  # GLOBAL by name
    assert jobentry.resolve("bench.launch.run_config") is run_config
    assert jobentry.resolve(jobentry.DEFAULT_RUNNER) is run_config


def _held_elsewhere(cfg, run_dir, progress=False):
    raise records.Busy(f"run directory {run_dir}", {"purpose": "commbench run --resume",
                                                     "pid": 1, "host": "h", "since": "now"})


def test_a_run_another_process_holds_fails_without_a_write_into_it(tmp_path):
    """Issue 29: a sweep's run whose directory a hand `--resume` holds (it took the lock
    after the sweep's check) is reported failed; its records stay the other writer's."""
    from bench.config import load_config

    cfg = load_config(REPO / "configs/ddp-tiny.yaml")
    run_dir = tmp_path / "held"
    run_dir.mkdir()
    summary = jobentry.execute_run(cfg, run_dir, _held_elsewhere)
    assert summary["status"] == "failed" and "is in use by commbench run --resume" in \
        summary["error"]
    assert list(run_dir.iterdir()) == []
