"""Runs that outlive their Slurm job: time limits, requeues, preemption, resume, on the real
cluster of tools/slurm/start-cluster.sh (COMMBENCH_SLURM=1 tox -e slurm).

    sudo tools/slurm/start-cluster.sh && pytest tests/slurm/test_requeue.py -m slurm -s

Every run is the same tiny DDP run, made slow by an emulated link (tests/slurm/slow.yaml:
each step waits about a second for its all-reduce, whatever the machine's load), and each
must end with the losses of the same run made in one go here (the emulation only waits:
the numbers are those of the run without it). A stop from Slurm (the warning before the
time limit, the SIGTERM of a requeue or a preemption, a cancel) checkpoints at the next
step boundary (bench/run/stop.py); the job requeues itself, or Slurm does, or the next sweep
resumes the run (bench/launch/jobentry.py).
"""

from __future__ import annotations

import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from bench.config import from_dict
from bench.launch.run import run_config
from bench.run.records import RunDir, status_of
from bench.study.sweep import run_sweep, sweep_status
from tests.slurm.runners import in_thread, job_id, run_dir_of, squeue_state, wait_step

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1500),
              pytest.mark.usefixtures("slurm_cluster")]

SLOW_LINK = Path(__file__).with_name("slow.yaml")


def base(steps: int, **sections) -> dict:
    return {"run": {"name": "long", "steps": steps, "log_every": 5, "val_every": 10,
                    "val_sequences": 4},
            "model": {"preset": "tiny", "seq_len": 32, "n_layer": 1},
            "data": {"corpus": "embedded", "batch_size": 2},
            "parallel": {"world_size": 2}, "strategy": {"name": "ddp", "backend": "torch"},
            "network": {"emulate": str(SLOW_LINK)}, "checkpoint": {"final": False},
            **sections}


def spec(tmp_path: Path, name: str, config: dict, **executor) -> Path:
    body = {"name": name, "base": config, "output_dir": str(tmp_path / "results"),
            "report_dir": str(tmp_path / "report"),
            "executor": {"name": "slurm", "poll_s": 2, "cpus_per_task": 1, **executor}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def reference_rows(tmp_path: Path, config: dict) -> list[tuple]:
    """(step, loss, val_loss) of the run made in one go, here (one node), without the slow
    link."""
    data = {**config, "network": {}, "launch": {}, "run": {**config["run"],
                                             "output_dir": str(tmp_path / "reference")}}
    summary = run_config(from_dict(data), progress=False)
    assert summary["status"] == "ok", summary.get("error")
    return rows_of(Path(summary["run_dir"]))


def rows_of(run_dir: Path) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in RunDir(run_dir).read_metrics()]


def only_run(result) -> RunDir:
    (outcome,) = result.outcomes
    return RunDir(outcome.run_dir)


def span_s(attempts: list[dict]) -> float:
    """Seconds from the first attempt's start to the last one's end."""
    fmt = "%Y-%m-%dT%H:%M:%S%z"
    return (datetime.strptime(attempts[-1]["end"], fmt)
            - datetime.strptime(attempts[0]["start"], fmt)).total_seconds()


LIMIT_STEPS = 190
"""Steps of the time-limit test's run: at least a second each (tests/slurm/slow.yaml), so
its training alone (~192 s) outlasts the latest warning (180 s into its 4-minute job)
however fast the job starts. Learned here: with 70 steps in a 2-minute job (warning at 90
s, or up to ~30 s earlier) a job that started in ~8 s was warned at step 66 or 67 of 70, a
hair from finishing in one attempt; and on a machine loaded ~10x (load 21 on 2 cores), a
requeued job took ~90 s to start its ranks, past a warning that came 58 s into the job, so
its attempts trained nothing and the third hit the time limit while stopping."""
LIMIT_MIN, WARN_S = 4, 60
"""The job's time limit and its warning's delay: the warning comes ~150-180 s into the
job, after a slow start-up, and leaves the stop 60-90 s (checkpoint, exit, requeue)."""


@pytest.mark.timeout(2400)  # up to 7 attempts of 4 minutes on a loaded machine
def test_a_run_longer_than_its_time_limit_finishes_after_requeues(tmp_path):
    """A 4-minute job for ~190 s of training (LIMIT_STEPS) plus its start-up: the warning
    (SIGUSR2, 60 s before the limit, or up to ~30 s earlier) stops it with a checkpoint,
    the job requeues itself, continues (usually 2 attempts; a loaded machine or early
    warnings need more, hence max_requeues 6), and the run ends ok, bit-exact; the clock
    counts training, not the wait."""
    config = base(LIMIT_STEPS)
    expected = reference_rows(tmp_path, config)
    result = run_sweep(spec(tmp_path, "limit", config, timeout_min=LIMIT_MIN,
                            signal_delay_s=WARN_S, max_requeues=6), report=False)
    run = only_run(result)
    summary = run.read_summary()
    assert result.ok and summary["status"] == "ok", summary.get("error")
    attempts = summary["attempts"]
    print(f"\ntime limit: {len(attempts)} attempts: {attempts}")
    assert len(attempts) >= 2 and len({a["job_id"] for a in attempts}) == 1  # one job, requeued
    for attempt in attempts[:-1]:
        assert attempt["reason"] == "stopped by SIGUSR2" and attempt["requeued"] is True
    assert attempts[-1]["reason"] == "ok"
    assert rows_of(run.path) == expected
    # training time only: the requeued job waited in the queue between attempts
    assert summary["wall_s"] + summary.get("warmup_s", 0) < span_s(attempts) - 10


def test_scontrol_requeue_mid_run_continues_from_the_checkpoint(tmp_path):
    """`scontrol requeue` (Slurm's SIGTERM, then the job back in the queue): the run stops
    at the next step boundary with a checkpoint and the requeued job continues it."""
    config = base(30)
    expected = reference_rows(tmp_path, config)
    path = spec(tmp_path, "requeue", config, timeout_min=10)
    thread, out = in_thread(run_sweep, path, report=False)
    job = job_id(path)
    wait_step(run_dir_of(path), 10)
    subprocess.run(["scontrol", "requeue", job], check=True)
    thread.join(timeout=900)
    assert not thread.is_alive(), "the sweep did not wait for the requeued job"
    run = only_run(out[0])
    summary = run.read_summary()
    assert summary["status"] == "ok", summary.get("error")
    first, last = summary["attempts"]
    print(f"\nscontrol requeue: {summary['attempts']}")
    assert first["reason"] == "stopped by SIGTERM" and first["requeued"] is True
    assert last["reason"] == "ok" and summary["resumed_from_step"] >= 10
    assert rows_of(run.path) == expected


def test_a_preempted_job_requeues_itself_and_continues(tmp_path):
    """A job of the preemptible partition is preempted by an urgent job (SIGTERM, 30 s of
    grace): the run checkpoints, the job requeues itself, waits for the urgent job and
    continues the run."""
    config = base(30)
    expected = reference_rows(tmp_path, config)
    path = spec(tmp_path, "preempt", config, timeout_min=10, partition="preempt")
    thread, out = in_thread(run_sweep, path, report=False)
    job_id(path)
    wait_step(run_dir_of(path), 10)
    urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-c", "2", "-o",
                             "/dev/null", "--wrap", "sleep 5"], check=True, capture_output=True,
                            text=True).stdout.strip()
    thread.join(timeout=900)
    assert not thread.is_alive(), "the sweep did not wait for the preempted job"
    assert squeue_state(urgent) == ""  # it ran
    run = only_run(out[0])
    summary = run.read_summary()
    assert summary["status"] == "ok", summary.get("error")
    print(f"\npreemption: {summary['attempts']}")
    first, last = summary["attempts"]
    assert first["reason"] == "stopped by SIGTERM" and first["requeued"] is True
    assert last["reason"] == "ok" and rows_of(run.path) == expected


def test_a_cancelled_run_is_resumed_by_the_next_sweep(tmp_path, capsys):
    """scancel: the run stops with a checkpoint and is not requeued (a cancel is not
    undone); `--status` shows it stopped; the next sweep resumes it in a new job."""
    config = base(30)
    expected = reference_rows(tmp_path, config)
    path = spec(tmp_path, "cancel", config, timeout_min=10)
    thread, out = in_thread(run_sweep, path, report=False)
    job = job_id(path)
    run_dir = run_dir_of(path)
    wait_step(run_dir, 10)
    subprocess.run(["scancel", job], check=True)
    thread.join(timeout=600)
    stopped = RunDir(run_dir).read_summary()
    assert status_of(stopped) == "partial" and stopped["stopped_by"] == "SIGTERM", stopped
    assert stopped["error"] == f"stopped by SIGTERM at step {stopped['steps']}"  # a clean stop
    (row,) = sweep_status(path)
    assert row["state"] == f"stopped, resumes from step {stopped['steps']}", row
    resumed = run_sweep(path, report=False)
    assert job_id(path, other_than=job) != job
    summary = only_run(resumed).read_summary()
    assert summary["status"] == "ok" and summary["resumed_from_step"] == stopped["steps"]
    assert [a["reason"] for a in summary["attempts"]] == ["stopped by SIGTERM", "ok"]
    assert rows_of(run_dir) == expected
    print(f"\ncancelled, then resumed: {summary['attempts']}")


def test_status_shows_a_queued_job(tmp_path):
    """--status of a sweep whose job waits in the queue names its job id."""
    config = base(5)
    path = spec(tmp_path, "queued", config, timeout_min=5,
                sbatch={"begin": "now+600"})  # held in the queue
    thread, _ = in_thread(run_sweep, path, report=False)
    job = job_id(path)
    deadline = time.monotonic() + 60
    while squeue_state(job) != "PENDING" and time.monotonic() < deadline:
        time.sleep(0.5)
    (row,) = sweep_status(path)
    assert row["state"] == f"pending (job {job})", row
    subprocess.run(["scancel", job], check=True)
    thread.join(timeout=300)
