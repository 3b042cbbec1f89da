"""Multi-node runs under the Slurm executor, on the two namespace nodes of
tools/slurm/start-cluster.sh (cbnode1, cbnode2: partition `pair`).

    sudo tools/slurm/start-cluster.sh && pytest tests/slurm/test_multinode.py -m slurm -s

A run with launch.nnodes 2 is one job of two nodes: a task on each starts torchrun, the
rendezvous is on the job's first node, gloo binds each namespace's eth0, and the run is
recorded once (bench/launch/jobentry.py). A node killed mid-run (its job step's processes) fails
the run with that node named (bench/launch/failure.py); --retry-failed continues it from its
checkpoint, bit-exactly, in one job: the killed attempt's lock description (its shared key)
does not refuse the retry's nodes (bench/run/records.py `hold`).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from bench.run.files import read_json
from bench.run.records import RunDir
from bench.study.sweep import run_sweep
from tests.slurm.runners import in_thread, job_id, run_dir_of, wait_step
from tests.slurm.test_requeue import base, reference_rows, rows_of

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1200),
              pytest.mark.usefixtures("slurm_cluster")]


def two_nodes(steps: int, **sections) -> dict:
    config = base(steps, **sections)
    return {**config, "parallel": {"world_size": 4}, "launch": {"nnodes": 2}}


def spec(tmp_path: Path, name: str, config: dict) -> Path:
    body = {"name": name, "base": config, "output_dir": str(tmp_path / "results"),
            "report_dir": str(tmp_path / "report"),
            "executor": {"name": "slurm", "partition": "pair", "poll_s": 2, "timeout_min": 10,
                         "cpus_per_task": 2,
                         "setup": ["export GLOO_SOCKET_IFNAME=eth0"]}}  # the node's own link
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def nodes(run: RunDir) -> dict[str, list[int]]:
    """host -> its ranks, from the run's node records."""
    return {(r := read_json(p))["host"]: r["ranks"] for p in run.node_records()}


def test_four_ranks_on_two_nodes_are_one_job_and_one_record(tmp_path):
    config = two_nodes(12, network={})
    expected = reference_rows(tmp_path, config)  # the same 4 ranks on this one machine
    result = run_sweep(spec(tmp_path, "two", config), report=False)
    (outcome,) = result.outcomes
    run = RunDir(outcome.run_dir)
    summary = run.read_summary()
    assert result.ok and summary["status"] == "ok", summary.get("error")
    placed = nodes(run)
    print(f"\ntwo nodes: {placed}; attempts {summary['attempts']}")
    assert set(placed) == {"cbnode1", "cbnode2"}
    assert sorted(r for ranks in placed.values() for r in ranks) == [0, 1, 2, 3]
    (attempt,) = summary["attempts"]  # recorded once, by the first node
    assert attempt["host"] == "cbnode1" and attempt["reason"] == "ok"
    assert rows_of(run.path) == expected


def _step_processes(job: str, node: str) -> list[int]:
    """The processes of a job's step on one node (their environment says so)."""
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = environ.read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in env and f"SLURMD_NODENAME={node}".encode() in env:
            pids.append(int(environ.parent.name))
    return pids


def test_a_node_killed_mid_run_is_recorded_failed_and_resumed_by_retry_failed(tmp_path):
    config = two_nodes(30, checkpoint={"final": False, "every": 10})
    expected = reference_rows(tmp_path, config)
    path = spec(tmp_path, "lost", config)
    thread, out = in_thread(run_sweep, path, report=False)
    job = job_id(path)
    run_dir = run_dir_of(path)
    wait_step(run_dir, 12)  # after the checkpoint at step 10
    killed = _step_processes(job, "cbnode2")
    assert killed, "no process of the job on cbnode2"
    for pid in killed:  # the node dies: every process of the job there, at once
        os.kill(pid, signal.SIGKILL)
    thread.join(timeout=600)
    assert not thread.is_alive(), "the sweep did not notice the lost node"
    (outcome,) = out[0].outcomes
    summary = RunDir(run_dir).read_summary()
    print(f"\nlost node recorded: {summary['error'].splitlines()[0]}")
    assert outcome.status == "failed" and not summary.get("interrupted"), summary
    headline = summary["error"].splitlines()[0]
    assert "(node cbnode2) lost" in headline, headline
    time.sleep(1)
    retried = run_sweep(path, report=False, retry_failed=True)
    summary = RunDir(run_dir).read_summary()
    (outcome,) = retried.outcomes
    assert retried.ok and summary["status"] == "ok", outcome.error or summary.get("error")
    assert summary["resumed_from_step"] == 10
    # the retry's job trained at once: not a node refused (the killed attempt's lock, the
    # other node's writes) while its partner waited out the rendezvous and the time limit
    assert [a["reason"] for a in summary["attempts"]] == ["failed", "ok"], summary["attempts"]
    assert rows_of(run_dir) == expected
