"""`commbench run` end to end, as a user runs it: records, failure handling, resume."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.records import read_jsonl

SHORT = ["--set", "parallel.world_size=2", "--set", "run.steps=20", "--set", "run.log_every=5",
         "--set", "run.val_every=10", "--set", "run.val_batches=2"]


def commbench(*args, env=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def only_run_dir(out: Path) -> Path:
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return run_dir


@pytest.mark.timeout(300)
def test_run_writes_every_record_and_loss_falls(tmp_path):
    proc = commbench("run", "configs/ddp-tiny.yaml", *SHORT, "--set",
                     f"run.output_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    run_dir = only_run_dir(tmp_path)
    assert proc.stdout.strip().endswith(str(run_dir))
    for name in ("config.yaml", "env.json", "metrics.jsonl", "comm.jsonl", "summary.json",
                 "checkpoints/final.pt"):
        assert (run_dir / name).exists(), name
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("status", "strategy", "num_params", "world_size", "steps", "total_tokens",
                "throughput_tokens_per_s", "compute_s_total", "comm_s_total",
                "comm_bytes_total", "final_val_loss", "projected"):
        assert summary[key] is not None, key
    assert summary["status"] == "ok" and summary["steps"] == 20
    assert summary["total_tokens"] == 20 * 2 * 8 * 128
    assert set(summary["projected"]) == {"nvlink", "ib-400g", "eth-100g", "eth-10g", "wan-1g"}
    # a slower network can only make the projected step slower
    assert summary["projected"]["wan-1g"]["step_s"] > summary["projected"]["nvlink"]["step_s"]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    assert [r["step"] for r in val] == [10, 20]
    for key in ("step", "tokens", "loss", "lr", "step_s", "compute_s", "comm_s", "comm_bytes"):
        assert key in train[0], key
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    env = json.loads((run_dir / "env.json").read_text())
    assert env["world_size"] == 2 and env["packages"]["torch"].startswith("2.")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["crash", "hang"])
def test_dead_or_stuck_rank_ends_run_as_failed(tmp_path, mode):
    start = time.time()
    proc = commbench("run", "configs/ddp-tiny.yaml", *SHORT, "--set",
                     f"run.output_dir={tmp_path}", "--set", "parallel.timeout_s=15",
                     env={"COMMBENCH_FAULT": f"1:3:{mode}"})
    assert proc.returncode == 1
    summary = json.loads((only_run_dir(tmp_path) / "summary.json").read_text())
    assert summary["status"] == "failed"
    if mode == "crash":
        assert "injected fault on rank 1 at step 3" in summary["error"]
    assert "run FAILED" in proc.stderr
    assert time.time() - start < 200  # ended by the timeout, not hung


@pytest.mark.timeout(400)
def test_interrupted_run_resumes_to_the_same_result(tmp_path):
    common = [*SHORT, "--set", "checkpoint.every=10", "--set", "run.val_every=0"]
    full = commbench("run", "configs/ddp-tiny.yaml", *common, "--set",
                     f"run.output_dir={tmp_path / 'full'}")
    assert full.returncode == 0, full.stderr
    broken = commbench("run", "configs/ddp-tiny.yaml", *common, "--set",
                       f"run.output_dir={tmp_path / 'cut'}", env={"COMMBENCH_FAULT": "0:15:crash"})
    assert broken.returncode == 1
    run_dir = only_run_dir(tmp_path / "cut")
    resumed = commbench("run", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    a = json.loads((only_run_dir(tmp_path / "full") / "summary.json").read_text())
    b = json.loads((run_dir / "summary.json").read_text())
    assert b["status"] == "ok"
    assert b["final_val_loss"] == a["final_val_loss"]
    losses = [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    assert losses == [r["loss"] for r in read_jsonl(only_run_dir(tmp_path / "full") /
                                                      "metrics.jsonl") if "loss" in r]


def test_records_are_ordinary_readable_files(tmp_path):
    from bench.records import write_json

    umask = os.umask(0o022)
    os.umask(umask)
    write_json(tmp_path / "summary.json", {"status": "ok"})
    # as open() would create it (mkstemp alone makes 0600, unreadable to others)
    assert (tmp_path / "summary.json").stat().st_mode & 0o777 == 0o666 & ~umask
