"""Runners for Slurm jobs in tests/slurm, imported by name inside the jobs (bench.launch.jobentry),
and the tests' helpers to watch jobs.

`instant_runner` writes a finished record in milliseconds. `hanging_runner` is the real
launcher (bench.launch.run.run_config), except that runs whose name is listed in
COMMBENCH_TEST_HANG (comma-separated; the variable reaches the jobs through sbatch's
environment export) start, record status running, and hang until Slurm ends them.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

from bench.config import config_hash, to_yaml
from bench.launch.run import run_config
from bench.run import files, records
from bench.run.records import RunDir
from bench.study.sweep import expand, load_spec


def _head(cfg) -> dict:
    return {"run_name": cfg.run.name, "config_hash": config_hash(cfg),
            "strategy": cfg.strategy.name, "world_size": cfg.parallel.world_size}


def instant_runner(cfg, run_dir, progress=True) -> dict:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    files.write_text(run_dir / "config.yaml", to_yaml(cfg))
    summary = {**_head(cfg), "status": "ok", "steps": cfg.run.steps}
    files.write_json(run_dir / "summary.json", summary)
    return summary


def hanging_runner(cfg, run_dir, progress=True, resume=False) -> dict:
    if cfg.run.name in os.environ.get("COMMBENCH_TEST_HANG", "").split(","):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        files.write_text(run_dir / "config.yaml", to_yaml(cfg))
        files.write_json(run_dir / "summary.json", {**_head(cfg), "status": "running"})
        time.sleep(3600)
    return run_config(cfg, run_dir, progress=progress, resume=resume)


# ------------------------------------------------------------------------------ helpers


def job_id(path: Path, variant: str | None = None, timeout_s: float = 120,
           other_than: str | None = None) -> str:
    """The Slurm job id of a run of the sweep spec at `path` once it is submitted
    (NAME/_slurm/jobs.json), `other_than` a previous one."""
    spec = load_spec(path)
    run_id = next(r.run_id for r in expand(spec) if variant in (None, r.variant))
    jobs_path = spec.sweep_dir / "_slurm" / "jobs.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if jobs_path.exists():
            job = json.loads(jobs_path.read_text()).get(run_id)
            if job is not None and str(job) != other_than:
                return str(job)
        time.sleep(0.5)
    raise AssertionError(f"run {variant} was not submitted within {timeout_s}s")


def run_dir_of(path: Path, variant: str | None = None) -> Path:
    """Where a run of the sweep spec at `path` is recorded (the sweep's first attempt)."""
    spec = load_spec(path)
    run = next(r for r in expand(spec) if variant in (None, r.variant))
    return spec.sweep_dir / run.dir_name


def squeue_state(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                          text=True).stdout.strip()


def wait_running(job: str, run_dir_glob: Path, timeout_s: float = 120) -> None:
    """Wait until Slurm runs the job and the runner has recorded status running."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        started = any((records.read_summary(d) or {}).get("status") == "running"
                      for d in run_dir_glob.parent.glob(run_dir_glob.name))
        if squeue_state(job) == "RUNNING" and started:
            return
        time.sleep(0.5)
    raise AssertionError(f"job {job} did not start running within {timeout_s}s")


def wait_step(run_dir: Path, step: int, timeout_s: float = 300) -> None:
    """Wait until the run's metrics reach `step`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = RunDir(run_dir).read_metrics() if run_dir.exists() else []
        if any(r.get("step", 0) >= step for r in rows):
            return
        time.sleep(0.5)
    raise AssertionError(f"{run_dir} did not reach step {step} within {timeout_s}s")


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)), daemon=True)
    thread.start()
    return thread, out
