"""Sweeps through the submitit executor on a real Slurm (tools/slurm/start-cluster.sh).

    COMMBENCH_SLURM=1 tox -e slurm                 # starts the cluster, runs these tests
    sudo tools/slurm/start-cluster.sh && pytest tests/slurm -m slurm

Without a cluster these tests skip, except under COMMBENCH_SLURM=1, where they fail. The
jobs train real tiny runs (bench.launch.run.run_config through tests.slurm.runners); runs named
in COMMBENCH_TEST_HANG hang instead, to be cancelled or to outlive their time limit.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from bench.run import records
from bench.study.sweep import run_sweep
from tests.slurm.runners import hanging_runner, in_thread, job_id, wait_running

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900),
              pytest.mark.usefixtures("slurm_cluster")]

BASE = {"run": {"name": "tiny", "steps": 6, "log_every": 2, "val_every": 6, "val_sequences": 4},
        "model": {"preset": "tiny", "seq_len": 32, "n_layer": 1},
        "data": {"corpus": "embedded", "batch_size": 2},
        "parallel": {"world_size": 2}, "strategy": {"name": "ddp", "backend": "torch"}}


def _spec(tmp_path: Path, name: str, variants: dict, **executor) -> Path:
    spec = {"name": name, "base": BASE, "variants": variants,
            "output_dir": str(tmp_path / "results"), "report_dir": str(tmp_path / "report"),
            "executor": {"name": "slurm", "poll_s": 1, "cpus_per_task": 1, **executor}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_two_run_sweep_cancel_and_retry(tmp_path, monkeypatch):
    path = _spec(tmp_path, "pair", {"a": {"optim.lr": 1e-3}, "b": {"optim.lr": 2e-3}},
                 array=True, timeout_min=10)
    monkeypatch.setenv("COMMBENCH_TEST_HANG", "b")
    thread, out = in_thread(run_sweep, path, runner=hanging_runner, report=False)
    b_job = job_id(path, "b")
    wait_running(b_job, tmp_path / "results" / "pair" / "b-*")
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
    # a cancelled job stops its run (SIGTERM) and is never requeued: interrupted, resumable
    assert b_summary["status"] == "failed" and b_summary["interrupted"] is True
    assert f"stopped by SIGTERM (job {b_job})" in b_summary["error"], b_summary["error"]
    print(f"\ncancelled run recorded: {b_summary['error'].splitlines()[0]}")

    monkeypatch.delenv("COMMBENCH_TEST_HANG")
    retried = run_sweep(path, runner=hanging_runner, report=False)  # partial: trained again
    assert retried.ok and retried.num_launched == 1
    assert job_id(path, "b") != b_job
    assert records.read_summary(by_variant["b"].run_dir)["status"] == "ok"


def test_a_job_past_its_time_limit_without_requeues_is_left_to_resume(tmp_path, monkeypatch):
    """Slurm's warning before the time limit stops the run; with executor.max_requeues 0
    the job is not requeued and the run is recorded interrupted (the next sweep resumes
    it), not failed. Slurm may send the warning up to 60 s early: a 2-minute limit keeps it
    after the job's start-up (with 1 minute, it can come before the job's Python has a
    handler, and kill it)."""
    path = _spec(tmp_path, "late", {"late": {"optim.lr": 1e-3}}, timeout_min=2,
                 signal_delay_s=30, max_requeues=0)
    monkeypatch.setenv("COMMBENCH_TEST_HANG", "late")
    result = run_sweep(path, runner=hanging_runner, report=False)
    [outcome] = result.outcomes
    summary = records.read_summary(outcome.run_dir)
    assert outcome.status == "failed" and summary["interrupted"] is True, summary
    assert re.search(r"stopped by SIGUSR2 \(job \d+\)", summary["error"]), summary["error"]
    assert records.status_of(summary) == "partial"
    print(f"\nrun past its time limit recorded: {summary['error'].splitlines()[0]}")
