"""`commbench run` end to end, as a user runs it: records, failure handling, resume; and
the harness's layering (only the command line imports `eval`)."""

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.data import load_corpus
from bench.data.batches import validation_set
from bench.run.records import RunDir

SHORT = ["--set", "parallel.world_size=2", "--set", "run.steps=20", "--set", "run.log_every=5",
         "--set", "run.val_every=10", "--set", "run.val_sequences=16"]


def commbench(*args, env=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def only_run_dir(out: Path) -> RunDir:
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return RunDir(run_dir)


@pytest.mark.timeout(300)
def test_run_writes_every_record_and_loss_falls(tmp_path):
    proc = commbench("run", "configs/ddp-tiny.yaml", *SHORT, "--set",
                     f"run.output_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    run = only_run_dir(tmp_path)
    assert proc.stdout.strip().endswith(str(run.path))
    for path in (run.config, run.env, run.metrics, run.comm, run.summary, run.final_checkpoint):
        assert path.exists(), path
    summary = run.read_summary()
    for key in ("status", "strategy", "num_params", "world_size", "steps", "total_tokens",
                "throughput_tokens_per_s", "compute_s_total", "comm_s_total",
                "comm_bytes_total", "final_val_loss", "projected"):
        assert summary[key] is not None, key
    assert summary["status"] == "ok" and summary["steps"] == 20
    assert summary["total_tokens"] == 20 * 2 * 8 * 128
    val = load_corpus("embedded", "byte", "~/.cache/commbench", 0.05).val
    assert summary["val_set"] == validation_set(val, 128, 16).record()
    assert summary["val_set"]["sequences"] == 16 and summary["val_set"]["tokens"] == 16 * 128
    profiles = {"nvlink", "ib-400g", "eth-100g", "eth-10g", "wan-1g"}
    assert set(summary["projected"]) == profiles
    # a slower network can only make the projected step slower
    assert summary["projected"]["wan-1g"]["step_s"] > summary["projected"]["nvlink"]["step_s"]
    rows = run.read_metrics()
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    assert [r["step"] for r in val] == [10, 20]
    for key in ("step", "tokens", "loss", "lr", "step_s", "compute_s", "comm_s", "comm_bytes",
                "elapsed_s", "projected_elapsed_s"):
        assert key in train[0], key
    assert set(val[0]["projected_elapsed_s"]) == profiles
    assert summary["projected"]["wan-1g"]["total_s"] == train[-1]["projected_elapsed_s"]["wan-1g"]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    env = json.loads(run.env.read_text())
    assert env["world_size"] == 2 and env["packages"]["torch"].startswith("2.")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [
    "crash", pytest.param("hang", marks=pytest.mark.slow)])  # hang: ~55 s of waiting
def test_dead_or_stuck_rank_ends_run_as_failed(tmp_path, mode):
    start = time.time()
    proc = commbench("run", "configs/ddp-tiny.yaml", *SHORT, "--set",
                     f"run.output_dir={tmp_path}", "--set", "parallel.timeout_s=15",
                     env={"COMMBENCH_FAULT": f"1:3:{mode}"})
    assert proc.returncode == 1
    summary = only_run_dir(tmp_path).read_summary()
    assert summary["status"] == "failed"
    if mode == "crash":
        assert "injected fault on rank 1 at step 3" in summary["error"]
    assert "run FAILED" in proc.stderr
    assert time.time() - start < 200  # ended by the timeout, not hung


@pytest.mark.timeout(300)
def test_rank_dying_at_exit_after_the_run_keeps_the_record(tmp_path):
    # seen once in a real sweep: "terminate called without an active exception" (SIGABRT)
    # in one rank's interpreter exit after a complete run turned it into a failed one
    proc = commbench("run", "configs/ddp-tiny.yaml", *SHORT, "--set",
                     f"run.output_dir={tmp_path}", env={"COMMBENCH_FAULT": "1:0:exit"})
    assert proc.returncode == 0, proc.stderr
    run = only_run_dir(tmp_path)
    summary = run.read_summary()
    assert summary["status"] == "ok" and summary["steps"] == 20
    assert "final_val_loss" in summary and "error" not in summary
    assert "rank 1" in summary["teardown_error"] and "SIGABRT" in summary["teardown_error"]
    assert "every rank finished the run" in proc.stderr


@pytest.mark.slow  # ~30 s; test_resume.py covers stop and resume in the default run
@pytest.mark.timeout(400)
def test_interrupted_run_resumes_to_the_same_result(tmp_path):
    common = [*SHORT, "--set", "checkpoint.every=10", "--set", "run.val_every=0"]
    full = commbench("run", "configs/ddp-tiny.yaml", *common, "--set",
                     f"run.output_dir={tmp_path / 'full'}")
    assert full.returncode == 0, full.stderr
    broken = commbench("run", "configs/ddp-tiny.yaml", *common, "--set",
                       f"run.output_dir={tmp_path / 'cut'}", env={"COMMBENCH_FAULT": "0:15:crash"})
    assert broken.returncode == 1
    cut = only_run_dir(tmp_path / "cut")
    resumed = commbench("run", "--resume", str(cut.path))
    assert resumed.returncode == 0, resumed.stderr
    full = only_run_dir(tmp_path / "full")
    a, b = full.read_summary(), cut.read_summary()
    assert b["status"] == "ok"
    # issue 16, defect 1: nothing of the failed attempt is left in the finished record
    assert "error" not in b and "interrupted" not in b and b["resumed_from_step"] == 10
    assert b["final_val_loss"] == a["final_val_loss"]
    assert (b["steps"], b["total_tokens"]) == (a["steps"], a["total_tokens"])
    losses = [r["loss"] for r in cut.read_metrics() if "loss" in r]
    assert losses == [r["loss"] for r in full.read_metrics() if "loss" in r]


FAKE_LAUNCH = """
import os, signal, sys, time
from bench.launch import run as launch
from bench.config import load_config

def fake_torchrun(cmd, env, run, progress, start_timeout_s):
    {body}

launch._run_torchrun = fake_torchrun
cfg = load_config("configs/ddp-tiny.yaml", sys.argv[2:])
try:
    summary = launch.run_config(cfg, sys.argv[1], progress=False)
    print("returned", summary["status"])
except launch.Terminated:
    print("terminated")
except launch.Stopped as stop:
    print("stopped", stop)
"""


def fake_launch(tmp_path: Path, body: str, *sets: str) -> subprocess.CompletedProcess:
    """run_config in a fresh interpreter with torchrun replaced by `body`."""
    script = tmp_path / "fake.py"
    script.write_text(FAKE_LAUNCH.replace("{body}", body))
    return subprocess.run([sys.executable, str(script), str(tmp_path / "run"), *sets],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("sig, printed, error", [
    (signal.SIGTERM, "terminated", "terminated (SIGTERM)"),
    (signal.SIGHUP, "stopped SIGHUP", "stopped by SIGHUP")], ids=["sigterm", "sighup"])
def test_a_stop_signal_is_recorded_like_ctrl_c(tmp_path, sig, printed, error):
    """Issue 16, defect 10: SIGTERM (Slurm's stop) left summary.json at "running"; issue
    29: so did SIGHUP (a closed terminal or ssh session)."""
    proc = fake_launch(tmp_path, f"os.kill(os.getpid(), signal.{sig.name}); time.sleep(30)\n"
                                 "    return 0, [], None")
    assert proc.returncode == 0 and proc.stdout.strip() == printed, proc.stderr
    summary = RunDir(tmp_path / "run").read_summary()
    assert summary["status"] == "failed" and summary["interrupted"] is True
    assert summary["error"] == error
    assert "no checkpoint was saved yet" in proc.stderr  # nothing to resume: no promise
    (attempt,) = summary["attempts"]
    assert attempt["reason"] == error and attempt["end"] >= attempt["start"]


def test_a_node_without_rank_0_succeeds_on_exit_code_0(tmp_path):
    """Issue 16/17: on a node whose rank 0 is elsewhere, summary.json is rank 0's to write;
    this node's torchrun exiting 0 is success, and the record is left alone."""
    proc = fake_launch(tmp_path, "return 0, [], None", "launch.nnodes=2",
                       "launch.rdzv_endpoint=127.0.0.1:29999")
    assert proc.stdout.strip() == "returned ok", proc.stderr
    summary = RunDir(tmp_path / "run").read_summary()
    assert summary["status"] == "running" and "launcher_wall_s" not in summary


def test_records_are_ordinary_readable_files(tmp_path):
    from bench.run.files import write_json

    umask = os.umask(0o022)
    os.umask(umask)
    write_json(tmp_path / "summary.json", {"status": "ok"})
    # as open() would create it (mkstemp alone makes 0600, unreadable to others)
    assert (tmp_path / "summary.json").stat().st_mode & 0o777 == 0o666 & ~umask


def test_records_are_replaced_atomically_torch_save_too(tmp_path):
    run = RunDir(tmp_path)
    run.save_torch({"step": 1}, run.state_checkpoint(0))
    run.save_torch({"step": 2}, run.state_checkpoint(0))
    assert torch.load(run.state_checkpoint(0))["step"] == 2
    assert [p.name for p in run.checkpoints.iterdir()] == ["state-rank0.pt"]  # no temp left


def test_only_the_command_line_imports_eval():
    """bench is the layer below the command line; eval depends on bench, not the reverse."""
    offenders = []
    for path in sorted(Path("bench").rglob("*.py")):
        if path == Path("bench/cli.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path}: {n}" for n in names if n == "eval" or n.startswith("eval.")]
    assert offenders == []


# ------------------------------------------------- resuming onto another layout (issue 46)


def _recorded(tmp_path: Path, config: str, *sets: str, status: str = "failed") -> RunDir:
    """A run directory holding `config` (with `sets`) as recorded, killed or failed."""
    from bench.config import load_config, to_yaml
    from tests.fakes import write_fake_run

    cfg = load_config(config, list(sets))
    return write_fake_run(tmp_path / "run", to_yaml(cfg), summary={"status": status})


def test_resume_checks_the_layout_rule_before_anything_starts(tmp_path):
    """check_resume (the launcher) lets torch DDP change world size with the global batch
    kept, and refuses every other layout change naming both layouts (no processes)."""
    from bench.config import load_config
    from bench.launch.run import check_resume

    run = _recorded(tmp_path, "configs/ddp-tiny.yaml")
    header = check_resume(load_config("configs/ddp-tiny.yaml", [
        "parallel.world_size=2", "data.batch_size=16"]), run)
    assert header["resumed_from_step"] == 0  # no checkpoint here: restarts at step 0
    with pytest.raises(ValueError, match="global batch must stay 32"):
        check_resume(load_config("configs/ddp-tiny.yaml", ["parallel.world_size=2"]), run)
    with pytest.raises(ValueError, match=r"these keys differ .*model.n_layer"):
        check_resume(load_config("configs/ddp-tiny.yaml", [
            "parallel.world_size=2", "data.batch_size=16", "model.n_layer=1"]), run)
    diloco = _recorded(tmp_path / "d", "configs/diloco-tiny.yaml")
    with pytest.raises(ValueError, match="diloco on 4 ranks .* diloco on 2 ranks"):
        check_resume(load_config("configs/diloco-tiny.yaml", [
            "parallel.world_size=2", "data.batch_size=16"]), diloco)


@pytest.mark.slow  # three launches, ~60 s; the rule itself is tested above without any
@pytest.mark.timeout(400)
def test_a_ddp_run_resumes_on_half_the_ranks_through_the_command_line(tmp_path):
    """`commbench run --resume DIR --set parallel.world_size=2 --set data.batch_size=16`
    continues a 4-rank DDP run (data.batch_size 8: the same global batch) from its
    checkpoint and finishes ok; DiLoCo on 4 -> 2 ranks is refused naming both layouts."""
    tiny = ["--set", "run.steps=6", "--set", "checkpoint.every=4", "--set", "run.log_every=2",
            "--set", "run.val_every=0", "--set", "run.val_sequences=8",
            "--set", "model.seq_len=32", "--set", "checkpoint.final=false"]
    first = commbench("run", "configs/ddp-tiny.yaml", *tiny, "--set",
                      f"run.output_dir={tmp_path / 'ddp'}")
    assert first.returncode == 0, first.stderr
    run = only_run_dir(tmp_path / "ddp")
    assert [p.name for _, p in run.state_dirs()] == ["state-step4"]
    assert run.read_summary()["projected_robust"]  # the 4-rank run's: one per profile
    resumed = commbench("run", "--resume", str(run.path), "--set", "run.steps=8", "--set",
                        "parallel.world_size=2", "--set", "data.batch_size=16")
    assert resumed.returncode == 0, resumed.stderr
    summary = run.read_summary()
    assert summary["status"] == "ok" and summary["resumed_from_step"] == 4
    assert summary["world_size"] == 2 and summary["steps"] == 8
    assert [r["step"] for r in run.read_metrics() if "loss" in r] == [2, 4, 6, 8]
    assert not summary.get("projected_robust")  # left out: its stretches were the 4 ranks'
    assert "world_size: 2" in run.config.read_text()

    diloco = commbench("run", "configs/diloco-tiny.yaml", *tiny, "--set",
                       "strategy.inner_steps=2", "--set", f"run.output_dir={tmp_path / 'dl'}")
    assert diloco.returncode == 0, diloco.stderr
    run = only_run_dir(tmp_path / "dl")
    before = {p.name for _, p in run.state_dirs()}
    refused = commbench("run", "--resume", str(run.path), "--set", "run.steps=8", "--set",
                        "parallel.world_size=2", "--set", "data.batch_size=16")
    assert refused.returncode == 2
    assert "diloco on 4 ranks" in refused.stderr and "diloco on 2 ranks" in refused.stderr
    assert {p.name for _, p in run.state_dirs()} == before == {"state-step4"}
