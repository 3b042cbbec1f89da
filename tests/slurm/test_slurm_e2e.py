"""Sweeps through the submitit executor on a real one-node Slurm (tools/slurm/start-cluster.sh).

    COMMBENCH_SLURM=1 tox -e slurm                 # starts the cluster, runs these tests
    sudo tools/slurm/start-cluster.sh && pytest tests/slurm -m slurm

Without a cluster these tests skip, except under COMMBENCH_SLURM=1, where they fail. The
jobs train real tiny runs (bench.launch.run_config through tests.slurm.runners); runs named
in COMMBENCH_TEST_HANG hang instead, to be cancelled or to outlive their time limit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from bench import records
from bench.sweep import expand, load_spec, run_sweep
from tests.slurm.runners import hanging_runner

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]

BASE = {"run": {"name": "tiny", "steps": 6, "log_every": 2, "val_every": 6, "val_sequences": 4},
        "model": {"preset": "tiny", "seq_len": 32, "n_layer": 1},
        "data": {"corpus": "embedded", "batch_size": 2},
        "parallel": {"world_size": 2}, "strategy": {"name": "ddp", "backend": "torch"}}


def _node_state() -> str:
    if not shutil.which("sinfo"):
        return "no sinfo on PATH"
    done = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True)
    return done.stdout.strip() or done.stderr.strip()


@pytest.fixture(autouse=True)
def cluster(tmp_path, monkeypatch):
    state = _node_state()
    if state not in ("idle", "mixed", "allocated"):
        message = f"no idle Slurm node here ({state}); start one: tools/slurm/start-cluster.sh"
        if os.environ.get("COMMBENCH_SLURM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    # jobs inherit the environment (sbatch --export=ALL): the repo and the hang list
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("COMMBENCH_TEST_HANG", raising=False)


def _spec(tmp_path: Path, name: str, variants: dict, **executor) -> Path:
    spec = {"name": name, "base": BASE, "variants": variants,
            "output_dir": str(tmp_path / "results"), "report_dir": str(tmp_path / "report"),
            "executor": {"name": "slurm", "poll_s": 1, "cpus_per_task": 1, **executor}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _job_id(path: Path, variant: str, timeout_s: float = 120) -> str:
    """The Slurm job id of a run once it is submitted (from NAME/_slurm/jobs.json)."""
    spec = load_spec(path)
    run_id = next(r.run_id for r in expand(spec) if r.variant == variant)
    jobs_path = spec.sweep_dir / "_slurm" / "jobs.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if jobs_path.exists():
            jobs = json.loads(jobs_path.read_text())
            if run_id in jobs:
                return str(jobs[run_id])
        time.sleep(0.5)
    raise AssertionError(f"run {variant} was not submitted within {timeout_s}s")


def _wait_running(job_id: str, run_dir_glob: Path, timeout_s: float = 120) -> None:
    """Wait until Slurm runs the job and the runner has recorded status running."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"],
                               capture_output=True, text=True).stdout.strip()
        started = any((records.read_summary(d) or {}).get("status") == "running"
                      for d in run_dir_glob.parent.glob(run_dir_glob.name))
        if state == "RUNNING" and started:
            return
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not start running within {timeout_s}s")


def _in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)), daemon=True)
    thread.start()
    return thread, out


def test_two_run_sweep_cancel_and_retry(tmp_path, monkeypatch):
    path = _spec(tmp_path, "pair", {"a": {"optim.lr": 1e-3}, "b": {"optim.lr": 2e-3}},
                 array=True, timeout_min=10)
    monkeypatch.setenv("COMMBENCH_TEST_HANG", "b")
    thread, out = _in_thread(run_sweep, path, runner=hanging_runner, report=False)
    b_job = _job_id(path, "b")
    _wait_running(b_job, tmp_path / "results" / "pair" / "b-*")
    subprocess.run(["scancel", b_job], check=True)
    thread.join(timeout=600)
    assert not thread.is_alive(), "the sweep did not notice the cancelled job"
    [result] = out
    by_variant = {o.run.variant: o for o in result.outcomes}
    assert by_variant["a"].status == "ok"
    a_summary = records.read_summary(by_variant["a"].run_dir)
    assert a_summary["status"] == "ok" and a_summary["steps"] == 6
    metrics = (by_variant["a"].run_dir / "metrics.jsonl").read_text().splitlines()
    assert any("val_loss" in line for line in metrics)
    b_summary = records.read_summary(by_variant["b"].run_dir)
    assert b_summary["status"] == "failed"
    assert b_job in b_summary["error"] and "CANCELLED" in b_summary["error"], b_summary["error"]
    print(f"\ncancelled run recorded: {b_summary['error'].splitlines()[0]}")

    monkeypatch.delenv("COMMBENCH_TEST_HANG")
    retried = run_sweep(path, runner=hanging_runner, report=False, retry_failed=True)
    assert retried.ok and retried.num_launched == 1
    assert _job_id(path, "b") != b_job
    assert records.read_summary(by_variant["b"].run_dir)["status"] == "ok"


def test_a_job_past_its_time_limit_is_recorded_failed(tmp_path, monkeypatch):
    path = _spec(tmp_path, "late", {"late": {"optim.lr": 1e-3}}, timeout_min=1)
    monkeypatch.setenv("COMMBENCH_TEST_HANG", "late")
    result = run_sweep(path, runner=hanging_runner, report=False)
    [outcome] = result.outcomes
    summary = records.read_summary(outcome.run_dir)
    assert outcome.status == "failed" and summary["status"] == "failed"
    # submitit turns Slurm's warning signal into "timed-out"; a hard kill shows TIMEOUT
    assert re.search(r"timed-out|TIMEOUT", summary["error"]), summary["error"]
    print(f"\nrun past its time limit recorded: {summary['error'].splitlines()[0]}")
