"""Crash safety with real processes: faults in one rank, signals, resume, killed sweeps.

    PYTHONPATH=$PWD pytest tests/test_crash_safety.py            # the fast ones
    PYTHONPATH=$PWD pytest tests/test_crash_safety.py -m slow    # real runs (minutes)

Issue 16: a rank killed, raising, frozen or going NaN ends the run with the right status
and names that rank, within the process-group timeout; Ctrl-C or SIGTERM then `--resume`
reaches bit-exactly the uninterrupted run's losses with a clean `ok` summary; a sweep
killed with SIGKILL at a random moment, run again, trains only what is missing and leaves
no duplicate or corrupt record; a straggler (`run.straggler`) slows the measured clock.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from algorithms.base import STRATEGIES, StepStats, Strategy, StrategyConfig
from bench.config import load_config
from bench.launch.failure import error_text
from bench.run import checkpoint, records
from bench.run.records import RunDir, status_of
from bench.run.train import Trainer
from tests.distributed import run_distributed
from tests.helpers import IdleStrategy, burn_cpu

SHORT = ["--set", "parallel.world_size=2", "--set", "run.steps=12", "--set", "run.log_every=2",
         "--set", "run.val_every=6", "--set", "run.val_sequences=8", "--set",
         "checkpoint.final=false"]
TIMEOUT_S = 30
"""parallel.timeout_s of the fault runs: generous (the machine is loaded), but bounded."""


def commbench(*args: str, env: dict | None = None, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def only_run(out: Path) -> RunDir:
    (path,) = [p for p in out.iterdir() if p.is_dir()]
    return RunDir(path)


def steps_of(run: RunDir, key: str = "loss") -> list[int]:
    return [r["step"] for r in run.read_metrics() if key in r]


# ------------------------------------------------------------------ failure headlines


TORCHRUN_KILL_SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
bench.run.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-23_17:00:01
  host      : node
  rank      : 3 (local_rank: 3)
  exitcode  : 1 (pid: 103)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_17:00:01
  host      : node
  rank      : 2 (local_rank: 2)
  exitcode  : -9 (pid: 102)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 102
============================================================""".splitlines()
CLOSED = ("Traceback (most recent call last):\n  File \"algorithms/ddp.py\", line 95, in finish\n"
          "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer "
          "[127.0.0.1]:4242\n")
TIMED_OUT = ("Traceback (most recent call last):\n  File \"algorithms/ddp.py\", line 95\n"
             "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
             "30000ms for recv operation to complete\n")


def _error_files(tmp_path: Path, texts: dict[int, str]) -> RunDir:
    run = RunDir(tmp_path)
    run.prepare()
    for i, (rank, text) in enumerate(texts.items()):  # written in this order
        run.error_log(rank).write_text(text)
        os.utime(run.error_log(rank), (1000 + i, 1000 + i))
    return run


def test_a_killed_rank_is_the_headline_not_the_last_traceback(tmp_path):
    """Defect 6: kill -9 of rank 2 was reported as rank 3's secondary traceback."""
    run = _error_files(tmp_path, {3: CLOSED, 1: CLOSED})
    headline = error_text(run, 1, TORCHRUN_KILL_SUMMARY, 4, 30).splitlines()[0]
    assert headline.startswith("rank 2: killed by SIGKILL (exit code -9"), headline
    assert "then ranks 3, 1 failed too" in headline


def test_a_frozen_rank_is_named_by_the_ranks_that_timed_out(tmp_path):
    """Defect 6: SIGSTOP of rank 1 never named rank 1. Rank 0 timed out waiting for it,
    rank 2 then lost rank 0; rank 1 wrote nothing."""
    run = _error_files(tmp_path, {0: TIMED_OUT, 2: CLOSED})
    headline = error_text(run, 1, [], 3, 30).splitlines()[0]
    assert headline.startswith("rank 1 stopped responding"), headline
    assert "rank 0 timed out after 30 s (parallel.timeout_s)" in headline


def test_a_raised_error_beats_the_consequences_written_before_it(tmp_path):
    run = _error_files(tmp_path, {3: CLOSED, 1: "Traceback...\nValueError: bad shard\n"})
    headline = error_text(run, 1, [], 4, 30).splitlines()[0]
    assert headline == "rank 1: ValueError: bad shard (then rank 3 failed too)"


# ------------------------------------------------------------ a stop in mid-save


def _state(run: RunDir, path: Path, step: int) -> None:
    run.save_torch({"step": step}, path)


@pytest.mark.parametrize("rank1_done,expected", [(True, 4), (False, 2)])
def test_a_stop_during_a_checkpoint_save_leaves_a_resumable_step(tmp_path, rank1_done,
                                                                 expected):
    """Ranks save beside the old state (.pt.next) and replace it after all have saved. A
    stop between the two leaves rank 0 with both files: the resume takes the latest step
    that every rank holds, and keeps only that."""
    run = RunDir(tmp_path)
    _state(run, run.state_checkpoint(0), 2)
    _state(run, run.pending_state_checkpoint(0), 4)
    _state(run, run.state_checkpoint(1), 4 if rank1_done else 2)
    assert checkpoint.verify_states(run, 2) == expected
    checkpoint.adopt_states(run, 2, expected)
    assert [torch.load(run.state_checkpoint(r))["step"] for r in (0, 1)] == [expected] * 2
    assert run.state_files() == [run.state_checkpoint(0), run.state_checkpoint(1)]


def _write(root: Path, files: dict[str, bytes]) -> None:
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(content)


@pytest.mark.parametrize("torn", ["no-complete", "removed-halfway", "only-torn"])
def test_a_stop_during_a_dcp_save_leaves_the_last_complete_step(tmp_path, torn):
    """DCP checkpoints (checkpoints/state-stepN/): a save cut short has no complete.json
    (rank 0 writes it after every rank saved), so the resume takes the last complete one
    and removes the torn one; a checkpoint removed halfway loses its complete.json first
    and reads the same. With no complete checkpoint left the run restarts at step 0."""
    from tests.test_bad_input import dcp_checkpoint

    run = RunDir(tmp_path / "r")
    if torn != "only-torn":
        _write(tmp_path, dcp_checkpoint(step=2))
    later = dcp_checkpoint(step=4)
    if torn == "no-complete":  # every rank's files, no marker: a stop before rank 0 wrote it
        later = {k: v for k, v in later.items() if not k.endswith("complete.json")}
    else:  # a marker-less remainder: .metadata gone too (a crash mid-save or mid-removal)
        later = {k: v[:100] for k, v in later.items() if k.endswith(".distcp")}
    _write(tmp_path, later)
    step = checkpoint.verify_states(run, 2)
    assert step == (None if torn == "only-torn" else 2)
    if step:
        checkpoint.adopt_states(run, 2, step)
        assert [s for s, _ in run.state_dirs()] == [2]


# --------------------------------------------------------------------------- straggler


SLEEP_S = 0.1
STEPS = 4


@dataclass
class SleepConfig(StrategyConfig):
    name: str = "sleepy"


class Sleepy(IdleStrategy, Strategy):
    """Every rank's step computes for SLEEP_S (CPU time) and trains nothing: the straggler's
    sleep is all the rest."""

    Config = SleepConfig

    def train_step(self, batch):
        burn_cpu(SLEEP_S)
        return StepStats(loss=1.0, tokens=batch[1].numel())


def train_with_straggler(rank, world_size, run_dir, slowdown):
    STRATEGIES["sleepy"] = f"{__name__}:Sleepy"  # in this rank's process only
    cfg = load_config("configs/ddp-tiny.yaml", [
        f"run.steps={STEPS}", "run.log_every=2", "run.val_every=0", "run.val_sequences=8",
        "checkpoint.final=false", "checkpoint.every=0", "parallel.world_size=2",
        "network.profiles=[nvlink]", "run.straggler.rank=1", f"run.straggler.slowdown={slowdown}"])
    cfg.strategy = SleepConfig()
    return Trainer(cfg, Path(run_dir), torch.device("cpu"), "gloo").run()


@pytest.mark.timeout(150)
def test_a_straggler_slows_the_measured_clock(tmp_path):
    """run.straggler {rank: 1, slowdown: 3}: rank 1's steps take >= 3 x SLEEP_S, and the
    run's clock (the slowest rank's) shows it. Sleeps make these lower bounds certain."""
    summaries = run_distributed(train_with_straggler, 2, str(tmp_path), 3.0, timeout=120)
    for summary in summaries:
        assert summary["wall_s"] >= STEPS * 3 * SLEEP_S
    # the slow rank's compute includes the sleep: rank 0 reports its own, unslowed
    assert summaries[0]["compute_s_total"] < summaries[0]["wall_s"]


class Stateless(Sleepy):
    """A strategy that cannot save its state (a new one, not written for resume yet)."""

    def state_dict(self):
        raise NotImplementedError


def train_stateless(rank, world_size, run_dir, every):
    STRATEGIES["sleepy"] = f"{__name__}:Stateless"
    cfg = load_config("configs/ddp-tiny.yaml", [
        "run.steps=4", "run.log_every=2", "run.val_every=0", "run.val_sequences=8",
        "checkpoint.final=false", f"checkpoint.every={every}", "parallel.world_size=2",
        "network.profiles=[nvlink]"])
    cfg.strategy = SleepConfig()
    summary = Trainer(cfg, Path(run_dir), torch.device("cpu"), "gloo").run()
    return summary["status"], [*RunDir(run_dir).state_files(), *RunDir(run_dir).state_dirs()]


@pytest.mark.timeout(150)
def test_default_checkpoints_skip_a_strategy_that_cannot_save(tmp_path):
    """Checkpoints are on by default (checkpoint.every null): a strategy without state_dict
    trains on without them; asked for explicitly, they fail naming checkpoint.every."""
    results = run_distributed(train_stateless, 2, str(tmp_path / "auto"), "null", timeout=120)
    assert results == [("ok", [])] * 2
    with pytest.raises(ValueError, match="checkpoint.every=2: strategy Stateless cannot save"):
        run_distributed(train_stateless, 2, str(tmp_path / "set"), 2, timeout=120)


# ------------------------------------------------------------------ real runs (slow)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode,headline", [
    ("crash", "rank 1: RuntimeError: injected fault on rank 1 at step 3"),
    ("kill", "rank 1: killed by SIGKILL"),
    ("hang", "rank 1 stopped responding"),
    ("stop", "rank 1 stopped responding"),
])
def test_a_faulty_rank_fails_the_run_and_is_named(tmp_path, mode, headline):
    start = time.monotonic()
    proc = commbench("run", "configs/ddp-tiny.yaml", *SHORT, "--set", f"run.output_dir={tmp_path}",
                     "--set", f"parallel.timeout_s={TIMEOUT_S}", "--quiet",
                     env={"COMMBENCH_FAULT": f"1:3:{mode}"})
    assert proc.returncode == 1, proc.stderr
    summary = only_run(tmp_path).read_summary()
    assert summary["status"] == "failed"
    assert summary["error"].startswith(headline), summary["error"]
    assert f"run FAILED: {headline}" in proc.stderr
    assert time.monotonic() - start < 300  # ended by the timeout, not hung


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_nan_in_one_rank_diverges_and_names_it(tmp_path):
    proc = commbench("run", "configs/ddp-tiny.yaml", *SHORT, "--set", f"run.output_dir={tmp_path}",
                     "--quiet", env={"COMMBENCH_FAULT": "1:3:nan"})
    assert proc.returncode == 1, proc.stderr
    summary = only_run(tmp_path).read_summary()
    assert summary["status"] == "diverged"
    # rank 1's step 4 is non-finite; rank 0's only after DDP averaged rank 1's NaN gradient
    assert summary["error"] == "non-finite loss first on rank 1 at step 4"


def _interrupt(proc: subprocess.Popen, run_dir_parent: Path, sig: int, at_step: int) -> None:
    """Send `sig` to the command once its metrics reach `at_step`."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        runs = [p for p in run_dir_parent.glob("*") if p.is_dir()] if run_dir_parent.exists() \
            else []
        if runs and any(s >= at_step for s in steps_of(RunDir(runs[0]))):
            proc.send_signal(sig)
            return
        time.sleep(0.2)
    raise AssertionError(f"the run did not reach step {at_step}: {proc.poll()}")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=["ctrl-c", "sigterm", "sighup"])
def test_interrupt_then_resume_is_bit_exact_and_clean(tmp_path, sig):
    """Defects 1 and 10: the resumed run ends ok with no stale `interrupted`/`error`, its
    losses equal the uninterrupted run's, and no step is recorded twice. Issues 25 and 29:
    the signal (SIGHUP too: a closed terminal) stops the ranks at the next step boundary,
    with a checkpoint there, which the resume continues from."""
    common = [*SHORT, "--set", "checkpoint.every=4", "--quiet"]
    full = commbench("run", "configs/ddp-tiny.yaml", *common,
                     "--set", f"run.output_dir={tmp_path / 'full'}")
    assert full.returncode == 0, full.stderr
    cut_dir = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "-m", "bench.cli", "run", "configs/ddp-tiny.yaml",
                             *common, "--set", f"run.output_dir={cut_dir}"],
                            stderr=subprocess.PIPE, text=True)
    _interrupt(proc, cut_dir, sig, at_step=6)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    cut = only_run(cut_dir)
    stopped = cut.read_summary()
    assert stopped["interrupted"] is True and status_of(stopped) == "partial"
    assert stopped["stopped_by"] == signal.Signals(sig).name and 6 <= stopped["steps"] < 12
    assert f"commbench run --resume {cut.path}" in err
    assert f"continue from step {stopped['steps']}" in err

    resumed = commbench("run", "--resume", str(cut.path), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    a, b = only_run(tmp_path / "full"), cut
    summary = b.read_summary()
    assert summary["status"] == "ok" and "interrupted" not in summary and "error" not in summary
    assert summary["resumed_from_step"] == stopped["steps"]  # the stop's own checkpoint
    assert [a["reason"] for a in summary["attempts"]] == [f"stopped by {stopped['stopped_by']}",
                                                         "ok"]
    assert (summary["steps"], summary["total_tokens"], summary["final_val_loss"]) == \
        (a.read_summary()["steps"], a.read_summary()["total_tokens"],
         a.read_summary()["final_val_loss"])
    assert steps_of(b) == steps_of(a) == list(range(2, 13, 2))
    assert [r["loss"] for r in b.read_metrics() if "loss" in r] == \
        [r["loss"] for r in a.read_metrics() if "loss" in r]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_without_checkpoints_says_it_restarts_and_records_each_step_once(tmp_path):
    """Defect 2: no checkpoint: the Ctrl-C hint does not promise a resume, the resume says
    it restarts at step 0, and metrics.jsonl holds each step once."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.cli", "run", "configs/ddp-tiny.yaml",
                             *SHORT, "--set", "checkpoint.every=0", "--set",
                             f"run.output_dir={tmp_path}", "--quiet"],
                            stderr=subprocess.PIPE, text=True)
    _interrupt(proc, tmp_path, signal.SIGINT, at_step=4)
    _, err = proc.communicate(timeout=120)
    assert "no checkpoint was saved yet" in err and "continue from" not in err
    run = only_run(tmp_path)
    resumed = commbench("run", "--resume", str(run.path), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert "restarts at step 0" in resumed.stderr
    assert steps_of(run) == list(range(2, 13, 2))
    assert run.read_summary()["status"] == "ok"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_extending_a_finished_run_is_recorded(tmp_path):
    done = commbench("run", "configs/ddp-tiny.yaml", *SHORT, "--set", "run.steps=8",
                     "--set", f"run.output_dir={tmp_path}", "--quiet")
    assert done.returncode == 0, done.stderr
    run = only_run(tmp_path)
    again = commbench("run", "--resume", str(run.path), "--quiet")
    assert again.returncode == 2 and "already finished" in again.stderr
    longer = commbench("run", "--resume", str(run.path), "--set", "run.steps=12", "--quiet")
    assert longer.returncode == 0, longer.stderr
    summary = run.read_summary()
    assert (summary["status"], summary["steps"], summary["steps_extended_from"]) == ("ok", 12, [8])
    assert steps_of(run) == list(range(2, 13, 2))


SWEEP_SPEC = """\
name: killed
base: {repo}/configs/ddp-tiny.yaml
output_dir: {out}
set: {{parallel.world_size: 1, run.steps: 6, run.log_every: 2, run.val_every: 0,
       run.val_sequences: 8, checkpoint.final: false, network.profiles: [nvlink]}}
grid: {{optim.lr: [0.001, 0.002, 0.003]}}
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_sweep_killed_at_a_random_moment_recovers(tmp_path):
    """kill -9 of the whole sweep (its process group, as a scheduler would) at a random
    moment, then the same command: only what is missing is trained, every record is ok,
    no step is recorded twice, and runs finished before the kill are left untouched."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(SWEEP_SPEC.format(repo=Path.cwd(), out=tmp_path / "out"))
    argv = [sys.executable, "-m", "bench.cli", "sweep", str(spec), "--no-report"]
    proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    time.sleep(random.uniform(5, 40))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    sweep_dir = tmp_path / "out" / "killed"
    before = {p.name: p.joinpath("summary.json").read_bytes() for p in sweep_dir.glob("*")
              if p.is_dir() and status_of(_summary(p)) == "ok"}
    again = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    runs = [p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith("_")]
    assert len(runs) == 3
    for path in runs:
        run = RunDir(path)
        assert run.read_summary()["status"] == "ok"
        assert steps_of(run) == [2, 4, 6]
    for name, content in before.items():  # finished runs were not trained again
        assert (sweep_dir / name / "summary.json").read_bytes() == content


def _summary(path: Path) -> dict | None:
    try:
        return json.loads((path / "summary.json").read_text())
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------- the run directory's lock

HOLD = """\
import sys, time
from bench.run.records import RunDir
with RunDir(sys.argv[1]).lock(sys.argv[2], shared=sys.argv[3] or None):
    print("held", flush=True)
    time.sleep(60)
"""


@contextlib.contextmanager
def held_by_another_process(path: Path, purpose: str, shared: str = ""):
    """A process holding RunDir(path).lock(purpose) while the block runs."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), purpose, shared],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "held\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_run_directory_lock_refuses_a_second_writer_naming_the_holder(tmp_path):
    """Issue 29: two `--resume` of one directory both trained, and a sweep moved a directory
    aside while a hand `--resume` trained it. Every writer holds RunDir.lock."""
    run = RunDir(tmp_path)
    with held_by_another_process(tmp_path, "commbench run --resume") as proc:
        holder = run.holder()
        assert (holder["purpose"], holder["pid"]) == ("commbench run --resume", proc.pid)
        with pytest.raises(records.Busy, match=f"run directory {tmp_path} is in use by "
                           rf"commbench run --resume \(pid {proc.pid} on host"):
            with run.lock("commbench run"):
                pass
    assert run.holder() is None  # the kernel releases a dead holder's lock: never stale
    with run.lock("commbench eval"):
        assert run.holder()["purpose"] == "commbench eval"
        with run.lock("nested, same thread"):  # re-entrant in one thread
            pass
        errors = []

        def other_thread():
            try:
                with run.lock("another thread"):
                    pass
            except records.Busy as err:
                errors.append(err)

        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        assert len(errors) == 1
    assert run.holder() is None


def test_the_nodes_of_one_multi_node_run_share_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "SHARED_SETTLE_S", 0.5)  # how long a refusal takes
    run = RunDir(tmp_path)
    with held_by_another_process(tmp_path, "commbench run (node)", shared="abc@host:29500"):
        with run.lock("commbench run (node)", shared="abc@host:29500"):
            pass
        with pytest.raises(records.Busy, match="commbench run \\(node\\)"):
            with run.lock("commbench run (node)", shared="other@host:29500"):
                pass
        with pytest.raises(records.Busy):
            with run.lock("commbench run --resume"):
                pass


def test_a_killed_multi_node_run_does_not_refuse_its_retry(tmp_path, monkeypatch):
    """Issue 49 (tox -e slurm): a node killed mid-run, then `sweep --retry-failed`; the retry's
    job refused the run directory on both nodes, "in use by commbench run (pid P on host
    cbnode1)", a process that had ended: the shared holders of the killed attempt never
    clear the lock's description (none knows it is the last), and the retry's nodes share
    another key (its rendezvous port comes from its job id). The kernel had released the
    flock: a description nobody holds is stale, whatever key it names."""
    monkeypatch.setattr(records, "SHARED_SETTLE_S", 0.5)  # how long a refusal takes
    run = RunDir(tmp_path)
    with held_by_another_process(tmp_path, "commbench run", shared="abc@cbnode1:20001") as proc:
        pass  # killed, as a lost node's launcher is: nothing of it ran after
    assert run.holder() is None
    assert json.loads(run.lock_file.read_text())["pid"] == proc.pid  # its description stays
    with run.lock("commbench run", shared="abc@cbnode1:20002"):  # the retry's job
        holder = run.holder()
        assert (holder["pid"], holder["shared"]) == (os.getpid(), "abc@cbnode1:20002")
        refused = []

        def another_attempt():  # a live holder of another key still refuses
            try:
                with run.lock("commbench run", shared="abc@cbnode1:20003"):
                    pass
            except records.Busy as err:
                refused.append(str(err))

        thread = threading.Thread(target=another_attempt)
        thread.start()
        thread.join()
        assert len(refused) == 1 and f"pid {os.getpid()}" in refused[0], refused


def test_the_nodes_of_a_retry_all_get_in_past_a_stale_description(tmp_path):
    """Every node of the retry sees the stale description at once; each must get in (one of
    them replaces the description, the others then find their own key)."""
    run = RunDir(tmp_path)
    with held_by_another_process(tmp_path, "commbench run --resume"):
        pass  # an exclusive holder killed: its description stays too
    def node(key: str, entered: threading.Barrier, errors: list) -> None:
        try:
            with run.lock("commbench run", shared=key):
                entered.wait()  # all four hold it together
        except (records.Busy, threading.BrokenBarrierError) as err:
            errors.append(err)
            entered.abort()

    for attempt in range(5):
        entered, errors = threading.Barrier(4, timeout=30), []
        threads = [threading.Thread(target=node, args=(f"abc@cbnode1:{20010 + attempt}",
                                                       entered, errors)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert run.holder() is None


def test_the_nodes_of_a_run_do_not_trip_over_each_others_writes(tmp_path, monkeypatch):
    """Issue 49 (tox -e slurm): the retry's second node ended in seconds, refused, and the
    first waited launch.rdzv_timeout_s for it at the rendezvous. Taking the lock, a node
    checks that the directory holds only files and directories; the other node's atomic
    writes (summary.json, config.yaml: a temporary file renamed) come and go meanwhile. A
    name listed, then gone, is no stranger; nor is a stale file another node removed first
    (both nodes drop the last attempt's error texts and node records)."""
    run = RunDir(tmp_path)
    run.prepare()
    real_walk = os.walk

    def walk_meeting_a_rename(top, *args, **kwargs):
        for dirpath, dirnames, filenames in real_walk(top, *args, **kwargs):
            yield dirpath, dirnames, [*filenames, ".summary.json.x1y2z3.tmp"]  # renamed since

    monkeypatch.setattr(os, "walk", walk_meeting_a_rename)
    with run.lock("commbench run", shared="abc@cbnode1:20004"):
        pass
    monkeypatch.setattr(os, "walk", real_walk)

    (run.logs / "error-rank0.txt").write_text("lost its peers")
    gone = run.logs / "node1.json"  # listed by this node, removed by the other meanwhile
    monkeypatch.setattr(RunDir, "node_records", lambda self: [gone])
    run.prepare()
    assert not (run.logs / "error-rank0.txt").exists()


def test_a_lock_that_is_a_directory_or_a_symlink_is_refused(tmp_path):
    run = RunDir(tmp_path / "r")
    run.lock_file.mkdir(parents=True)
    with pytest.raises(ValueError, match="is a directory"):
        with run.lock("commbench run"):
            pass
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    run = RunDir(tmp_path / "s")
    run.path.mkdir()
    run.lock_file.symlink_to(outside)
    with pytest.raises(ValueError, match="is a symbolic link"):
        with run.lock("commbench run"):
            pass
    assert outside.read_text() == "precious"


def test_a_second_resume_of_a_held_run_directory_is_refused_and_changes_nothing(
        tmp_path, capsys):
    from bench.cli import main
    from tests.test_bad_input import _snapshot, recorded_run

    for name, text in recorded_run().items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text.replace("{tmp}", str(tmp_path)))
    run_dir = tmp_path / "r"
    with held_by_another_process(run_dir, "commbench run --resume") as proc:
        before = _snapshot(tmp_path)
        code = main(["run", "--resume", str(run_dir), "--quiet"])
        err = capsys.readouterr().err
        assert code == 2, err
        assert f"run directory {run_dir} is in use by commbench run --resume (pid " \
               f"{proc.pid}" in err
        assert _snapshot(tmp_path) == before


def test_two_exports_into_one_directory_the_second_fails_cleanly(tmp_path):
    """Issue 29: two concurrent `export --hf OUT` into one OUT: the second one's rename
    raised OSError (a traceback). Here the first has just published OUT."""
    from eval.export import publish

    first, second, out = tmp_path / ".out.a.tmp", tmp_path / ".out.b.tmp", tmp_path / "out"
    for work in (first, second):
        work.mkdir()
        (work / "config.json").write_text(work.name)
    publish(first, out)
    with pytest.raises(ValueError, match="written by another process meanwhile"):
        publish(second, out)
    assert (out / "config.json").read_text() == ".out.a.tmp"


# ------------------------------------------------------------------------- a full disk


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` mounted at `path` while the block runs (root only: else skip)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(path: Path) -> None:
    """Fill the filesystem of `path` to the last byte."""
    with open(path / "filler", "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0")


def test_a_full_disk_keeps_metrics_rows_whole_and_the_summary_says_why(tmp_path):
    """Issue 29: a full disk cut metrics.jsonl mid-row and left summary.json `running`.
    A row is appended whole or not at all; a summary that no longer fits beside the old
    one is rewritten in place, cut to its essentials if need be."""
    from bench.run.summary import running_header

    with tmpfs(tmp_path / "disk", "64k") as disk:
        run = RunDir(disk / "run")
        run.path.mkdir()
        run.write_summary(running_header("ddp-tiny", "abc", "ddp", 2, started="now"))
        run.append_metrics({"step": 2, "loss": 5.0, "note": "x" * 3000})
        fill(disk)
        before = run.metrics.read_bytes()
        with pytest.raises(OSError, match="No space left on device") as err:
            run.append_metrics({"step": 4, "loss": 4.0, "note": "y" * 3000})
        assert err.value.filename == str(run.metrics)
        assert run.metrics.read_bytes() == before  # no torn row
        skipped = []
        assert [r["step"] for r in run.read_metrics(skipped)] == [2] and skipped == []

        error = "rank 1: OSError: [Errno 28] No space left on device\n" + "trace\n" * 500
        run.update_summary({"status": "failed", "error": error})
        summary = run.read_summary()
        assert (summary["status"], summary["run_name"]) == ("failed", "ddp-tiny")
        assert summary["error"].startswith("rank 1: OSError: [Errno 28] No space left")


def test_the_launcher_survives_a_log_it_cannot_write(tmp_path):
    """A full disk under logs/torchrun.log stopped the launcher with a traceback before it
    recorded the run; now the log stops, the launcher goes on and says why."""
    from bench.launch import run as launch

    with tmpfs(tmp_path / "disk", "64k") as disk:
        run = RunDir(disk / "run")
        run.logs.mkdir(parents=True)
        fill(disk)
        rc, tail, error = launch._run_torchrun(
            [sys.executable, "-c", "print('x' * 9000); print('last')"], dict(os.environ),
            run, False, 60.0)
    assert (rc, tail[-1], error.errno) == (0, "last", 28)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_that_fills_its_disk_fails_readably_and_resumes_once_there_is_room(tmp_path):
    """A real run on a 2 MB filesystem: the first checkpoint (1.5 MB per rank) does not
    fit. The run is recorded failed, its headline says the disk is full and the next line
    what to do, every metrics row is whole; with room made, --resume finishes it."""
    out = tmp_path / "out"
    with tmpfs(out, "2m"):
        proc = commbench("run", "configs/ddp-tiny.yaml", *SHORT, "--set", "checkpoint.every=4",
                         "--set", f"run.output_dir={out}", "--set",
                         f"data.cache_dir={tmp_path / 'cache'}", "--quiet")
        assert proc.returncode == 1, proc.stderr
        run = only_run(out)
        summary = run.read_summary()
        headline, note = summary["error"].splitlines()[:2]
        assert summary["status"] == "failed"
        assert "OSError: [Errno 28] No space left on device" in headline, headline
        assert note == (f"free space on the filesystem of {run.path}, then run `commbench run "
                        f"--resume {run.path}` (no checkpoint was saved: it restarts at step "
                        "0)"), note
        skipped = []
        rows = run.read_metrics(skipped)
        assert [r["step"] for r in rows if "loss" in r] == [2, 4] and skipped == []
        subprocess.run(["mount", "-o", "remount,size=64m", str(out)], check=True)
        resumed = commbench("run", "--resume", str(run.path), "--quiet")
        assert resumed.returncode == 0, resumed.stderr
        assert run.read_summary()["status"] == "ok"
        assert steps_of(run) == list(range(2, 13, 2))


def _report_argv(tmp_path: Path, target: Path) -> list[str]:
    from tests.test_report import DDP_VAL, _save, _sweep, write_run

    sweep_dir, sweep = _sweep(tmp_path / "results", "s")
    for seed in (0, 1):
        write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0)
    _save(sweep_dir, sweep)
    return ["report", str(tmp_path / "results"), "-o", str(target / "report")]


def _claims_argv(tmp_path: Path, target: Path) -> list[str]:
    return ["claims", "diloco-matches-ddp", "--dry-run", "--claims-dir",
            str(Path(__file__).resolve().parent.parent / "configs/claims"),
            "--output-dir", str(tmp_path / "results"), "--report-dir", str(target / "claims")]


def _export_argv(tmp_path: Path, target: Path, monkeypatch) -> list[str]:
    """`export` of a real final.pt, the transformers conversion replaced by objects that
    write 200 kB each (transformers is optional; the writes are what is tested)."""
    from eval import export
    from tests.test_security import crafted_eval_run

    run = crafted_eval_run(tmp_path, tmp_path / "unused")
    model = torch.load(run / "checkpoints/final.pt", weights_only=False)  # our own file
    model.pop("planted")
    torch.save(model, run / "checkpoints/final.pt")

    class Saves:
        config = type("Config", (), {"activation_function": "gelu"})()

        def save_pretrained(self, where):
            Path(where).mkdir(parents=True, exist_ok=True)
            (Path(where) / f"part-{id(self)}.bin").write_bytes(b"\0" * 200_000)

    monkeypatch.setattr(export, "_import_transformers", lambda: None)
    monkeypatch.setattr(export, "to_hf_model", lambda model, eot: Saves())
    monkeypatch.setattr(export, "hf_tokenizer", lambda name, length: Saves())
    return ["export", str(run), "--hf", str(target / "hf")]


@pytest.mark.parametrize("command", ["report", "export", "claims"])
@pytest.mark.parametrize("target", ["full", "read-only"])
def test_a_full_or_read_only_target_is_one_clear_error(tmp_path, command, target, capsys,
                                                        monkeypatch):
    """Issue 29: `report`, `export` and `claims --dry-run` into a full or read-only
    filesystem ended in a traceback."""
    from bench.cli import main

    with tmpfs(tmp_path / "disk", "64k") as disk:
        if target == "full":
            fill(disk)
        else:
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        argv = (_report_argv(tmp_path, disk) if command == "report" else
                _claims_argv(tmp_path, disk) if command == "claims" else
                _export_argv(tmp_path, disk, monkeypatch))
        code = main(argv)
        err = capsys.readouterr().err
        reason = "No space left on device" if target == "full" else "Read-only file system"
        assert code == 1, err
        assert err.startswith(f"commbench: error: {disk}/") and reason in err, err
        assert "Traceback" not in err
        assert not [p for p in disk.rglob("*") if p.is_file() and p.name != "filler"]


# --------------------------------------------------------------------- the run's data

REPO = Path(__file__).resolve().parent.parent


def test_a_relative_corpus_is_resolved_when_the_config_is_read(tmp_path, monkeypatch):
    """Issue 29: a relative data.corpus was recorded as given, so a `--resume` from another
    working directory read another file under the same config hash."""
    from tests.test_bad_input import SMALL_TEXT

    (tmp_path / "c.txt").write_text(SMALL_TEXT * 40)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(REPO / "configs/ddp-tiny.yaml", ["data.corpus=c.txt"])
    assert cfg.data.corpus == str(tmp_path / "c.txt")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_resume_from_another_directory_trains_on_the_same_data_or_is_refused(tmp_path):
    """The issue's case end to end: a run with data.corpus=c.txt (relative) made in a/,
    extended with --resume from b/, which holds another c.txt. The recorded config names
    a/c.txt, so the resume trains on it; once a/c.txt changed, the resume is refused."""
    from tests.test_bad_input import SMALL_TEXT

    for name, text in (("a", SMALL_TEXT * 40), ("b", SMALL_TEXT.upper() * 40)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "c.txt").write_text(text)

    def cli(cwd: Path, *args: str):
        return subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True,
                              text=True, timeout=300, cwd=cwd,
                              env={**os.environ, "PYTHONPATH": str(REPO)})

    first = cli(tmp_path / "a", "run", str(REPO / "configs/ddp-tiny.yaml"), *SHORT,
                "--set", "run.steps=4", "--set", "data.corpus=c.txt", "--set",
                f"run.output_dir={tmp_path / 'out'}", "--set",
                f"data.cache_dir={tmp_path / 'cache'}", "--quiet")
    assert first.returncode == 0, first.stderr
    run = only_run(tmp_path / "out")
    data = run.read_summary()["data"]
    longer = cli(tmp_path / "b", "run", "--resume", str(run.path), "--set", "run.steps=6",
                 "--quiet")
    assert longer.returncode == 0, longer.stderr
    assert run.read_summary()["data"] == data  # a/c.txt, not b/c.txt
    (tmp_path / "a" / "c.txt").write_text(SMALL_TEXT.lower() * 40)
    refused = cli(tmp_path / "b", "run", "--resume", str(run.path), "--set", "run.steps=8",
                  "--quiet")
    assert refused.returncode == 2 and "its data differ from the run's" in refused.stderr
    assert run.read_summary()["steps"] == 6


# ------------------------------------------------------------------------------ hangs


@contextlib.contextmanager
def silent_endpoint():
    """host:port of a TCP listener on this machine that accepts and never answers (a
    rendezvous endpoint that does not answer)."""
    import socket

    with socket.create_server(("127.0.0.1", 0), backlog=64) as server:
        yield f"127.0.0.1:{server.getsockname()[1]}"


RDZV_TIMEOUT_S = 8


@pytest.mark.timeout(120)
def test_a_rendezvous_that_does_not_answer_fails_in_bounded_time_saying_why(tmp_path):
    """Issue 29: a multi-node run whose rendezvous endpoint does not answer waited silently
    (torchrun's own join and read timeouts do not bound it: it waited for minutes)."""
    with silent_endpoint() as endpoint:
        start = time.monotonic()
        proc = commbench("run", "configs/ddp-tiny.yaml", *SHORT, "--set", "launch.nnodes=2",
                         "--set", f"launch.rdzv_endpoint={endpoint}", "--set",
                         f"launch.rdzv_timeout_s={RDZV_TIMEOUT_S}", "--set",
                         f"run.output_dir={tmp_path}", "--quiet", timeout=100)
        assert time.monotonic() - start < RDZV_TIMEOUT_S + 60
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(f"waiting for the rendezvous of launch.nnodes=2 nodes at "
                                  f"{endpoint} (at most launch.rdzv_timeout_s=8 s")
    summary = only_run(tmp_path).read_summary()
    assert summary["status"] == "failed"
    assert summary["error"].startswith(f"the rendezvous at {endpoint} did not complete within "
                                       "launch.rdzv_timeout_s=8 s")


@pytest.mark.timeout(120)
def test_netprobe_with_a_rendezvous_that_does_not_answer_fails_in_bounded_time(tmp_path):
    with silent_endpoint() as endpoint:
        proc = commbench("netprobe", "--world-size", "2", "--nnodes", "2", "--rdzv-endpoint",
                         endpoint, "--rdzv-timeout", str(RDZV_TIMEOUT_S), "--out",
                         str(tmp_path / "p.yaml"), timeout=100)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(f"netprobe: waiting for the rendezvous of --nnodes 2 at "
                                  f"{endpoint}")
    assert f"did not start within --rdzv-timeout {RDZV_TIMEOUT_S} s" in proc.stderr
    assert not (tmp_path / "p.yaml").exists()


def _without_loopback(*args: str):
    """The command line in a new network namespace, whose loopback is down (root only)."""
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot create a network namespace here (needs root)")
    return subprocess.run(["unshare", "-n", sys.executable, "-m", "bench.cli", *args],
                          capture_output=True, text=True, timeout=100)


@pytest.mark.timeout(120)
def test_a_run_without_loopback_is_refused_before_it_starts(tmp_path):
    """Issue 29: without loopback torchrun's standalone rendezvous retried for minutes."""
    proc = _without_loopback("run", "configs/ddp-tiny.yaml", *SHORT, "--set",
                             f"run.output_dir={tmp_path / 'out'}", "--set",
                             f"data.cache_dir={tmp_path / 'cache'}", "--quiet")
    assert proc.returncode == 2, proc.stderr
    assert "this machine's loopback (127.0.0.1) does not work" in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    probe = _without_loopback("netprobe", "--out", str(tmp_path / "p.yaml"))
    assert probe.returncode == 2 and "loopback (127.0.0.1) does not work" in probe.stderr


def test_a_read_only_home_is_named_as_the_cache_it_holds(tmp_path):
    """Issue 29: with a read-only HOME the default data.cache_dir (~/.cache/commbench)
    failed with a traceback; it is named, with what to do, before anything is launched."""
    with tmpfs(tmp_path / "home", "64k") as home:
        subprocess.run(["mount", "-o", "remount,ro", str(home)], check=True)
        proc = commbench("run", "configs/ddp-tiny.yaml", *SHORT, "--set",
                         f"run.output_dir={tmp_path / 'out'}", "--quiet",
                         env={"HOME": str(home)}, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"commbench: error: data.cache_dir '{home}/.cache/commbench'"
                                  ": cannot write the tokenised corpus there (Read-only file "
                                  "system"), proc.stderr
    assert "set data.cache_dir to a writable directory" in proc.stderr
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------- records read back, mistyped


@pytest.mark.parametrize("garbage", ["not json {", "[1, 2]", '"a string"'])
def test_a_stray_summary_above_the_runs_hides_none_of_them(tmp_path, garbage, capsys):
    """Issue 29: a garbage summary.json at the top of a results tree made the tree one
    (broken) run, hiding every run below it from report, compare and track."""
    from bench.cli import main
    from bench.study.report.load import load_results
    from tests.test_report import DDP_VAL, _save, _sweep, write_run

    sweep_dir, sweep = _sweep(tmp_path / "results", "s")
    for seed in (0, 1):
        write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0)
    _save(sweep_dir, sweep)
    (tmp_path / "results" / "summary.json").write_text(garbage)
    res = load_results(tmp_path / "results")
    assert len(res.runs) == 2 and set(res.runs["status"]) == {"ok"}
    assert any("summary.json: not a run's summary" in w for w in res.warnings)
    assert main(["report", str(tmp_path / "results"), "-o", str(tmp_path / "page")]) == 0


MISTYPED = [("projected", "x"), ("projected", {"eth-10g": 5}), ("config_hash", [1, 2]),
            ("run_name", {"a": 1}), ("total_tokens", 1e308), ("final_val_loss", 1e308),
            ("status", 7), ("val_set", "x")]


@pytest.mark.parametrize("key,value", MISTYPED, ids=[f"{k}={v!r}" for k, v in MISTYPED])
def test_a_mistyped_summary_field_is_dropped_with_a_warning(tmp_path, key, value, capsys):
    """Issue 29: a summary.json field of another type (hand-edited, corrupted) ended
    report and compare in a traceback (AttributeError, TypeError, OverflowError)."""
    from bench.cli import main
    from tests.test_report import DDP_VAL, _save, _sweep, write_run

    sweep_dir, sweep = _sweep(tmp_path / "results", "s")
    runs = [write_run(sweep_dir, sweep, name, strategy, seed, DDP_VAL, t)
            for name, strategy, t in (("ddp", "ddp", 1.0), ("dil", "diloco", 0.5))
            for seed in (0, 1)]
    _save(sweep_dir, sweep)
    summary = json.loads((runs[2] / "summary.json").read_text())
    (runs[2] / "summary.json").write_text(json.dumps({**summary, key: value}))
    assert main(["report", str(tmp_path / "results"), "-o", str(tmp_path / "page")]) == 0
    assert main(["compare", str(runs[0]), str(runs[2]), "-o", str(tmp_path / "cmp")]) == 0


@pytest.mark.parametrize("row", ['{"step": "x", "loss": 1}', '{"step": 4, "loss": "x"}',
                                 '[1, 2]', '{"step": 4, "loss": 1e308, "tokens": [1]}'])
def test_a_mistyped_metrics_row_is_skipped(tmp_path, row, capsys):
    from bench.cli import main
    from tests.test_report import DDP_VAL, _save, _sweep, write_run

    sweep_dir, sweep = _sweep(tmp_path / "results", "s")
    runs = [write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0) for seed in (0, 1)]
    _save(sweep_dir, sweep)
    metrics = runs[1] / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], row, *lines[1:]]) + "\n")
    assert main(["report", str(tmp_path / "results"), "-o", str(tmp_path / "page")]) == 0
CUT_SPEC = """\
name: cut
base: {repo}/configs/ddp-tiny.yaml
output_dir: {out}
set: {{parallel.world_size: 2, run.steps: 12, run.log_every: 2, run.val_every: 6,
       run.val_sequences: 8, checkpoint.every: 4, checkpoint.final: false}}
"""


def _training(run_dir: Path) -> list[int]:
    """Processes whose command line names run_dir (the ranks of its torchrun)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(run_dir).encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_sweep_killed_mid_run_continues_the_run_from_its_checkpoint(tmp_path):
    """Issue 25: kill -9 of the whole sweep mid-run leaves no rank training (they die with
    torchrun); `--status` shows the run stopped and resumable; the same sweep again
    continues it from its checkpoint, and it ends with the uninterrupted run's losses."""
    full = commbench("run", "configs/ddp-tiny.yaml", *SHORT, "--set", "checkpoint.every=4",
                     "--set", f"run.output_dir={tmp_path / 'full'}", "--quiet")
    assert full.returncode == 0, full.stderr
    spec = tmp_path / "spec.yaml"
    spec.write_text(CUT_SPEC.format(repo=Path.cwd(), out=tmp_path / "out"))
    argv = [sys.executable, "-m", "bench.cli", "sweep", str(spec), "--no-report"]
    proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    sweep_dir = tmp_path / "out" / "cut"
    _interrupt(proc, sweep_dir, signal.SIGKILL, at_step=6)
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its torchrun, as a scheduler would
    proc.wait()
    (run,) = (RunDir(p) for p in sweep_dir.iterdir() if p.is_dir() and p.name != "_slurm")
    deadline = time.monotonic() + 30
    while _training(run.path) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _training(run.path), "ranks outlived the killed sweep"
    before = commbench("sweep", str(spec), "--status")
    assert before.returncode == 0, before.stderr
    assert re.search(r"stopped, resumes from step (4|8)\s+1\s+\d+", before.stdout), before.stdout

    again = commbench("sweep", str(spec), "--no-report")
    assert again.returncode == 0, again.stderr
    assert "resuming ->" in again.stderr
    summary = run.read_summary()
    assert summary["status"] == "ok" and summary["resumed_from_step"] in (4, 8)
    assert len(summary["attempts"]) == 2 and summary["attempts"][1]["reason"] == "ok"
    after = commbench("sweep", str(spec), "--status")
    assert re.search(r"\bok\s+2\s+12\b", after.stdout), after.stdout
    a = only_run(tmp_path / "full")
    assert steps_of(run) == steps_of(a) == list(range(2, 13, 2))
    assert [r["loss"] for r in run.read_metrics() if "loss" in r] == \
        [r["loss"] for r in a.read_metrics() if "loss" in r]
    assert not (sweep_dir / "_retired").exists()  # continued in place, nothing retrained


def _lose_the_peer(rank, world_size, run_dir):
    from tests.local_updates import make_trainer

    trainer = make_trainer(world_size, "configs/ddp-tiny.yaml", ["network.emulate=nvlink"],
                           run_dir)
    for step in range(3):  # past DDP's bucket rebuild (a broadcast in its second forward)
        trainer.timed_step(step)
    if rank == 1:
        return "left"  # its process exits: rank 0's next all-reduce loses its peer
    try:
        trainer.timed_step(3)
    except RuntimeError as err:
        return f"raised {err}"
    return "finished"


@pytest.mark.slow  # ~35 s on a loaded 2-core machine
@pytest.mark.timeout(120)
def test_an_emulated_ddp_step_whose_peer_is_lost_fails_instead_of_hanging(tmp_path):
    """Issue 25 (a node killed mid-run): under network.emulate the DDP hook's future was
    never completed when the bucket's all-reduce failed, and the rank waited forever."""
    lost, left = run_distributed(_lose_the_peer, 2, str(tmp_path), timeout=90)
    assert left == "left"
    assert lost.startswith("raised") and "Connection closed by peer" in lost, lost
