"""One run of a sweep as an executor starts it: in a thread here, or as a Slurm job.

    commbench sweep configs/sweeps/slurm-example.yaml    # each job calls run_job
    COMMBENCH_SLURM=1 tox -e slurm                        # tests/slurm, on a real Slurm

`execute_run` trains one run with a runner (`runner(cfg, run_dir, progress=bool)`,
default bench.launch.run.run_config; `resume=True` is passed only to continue the run in
run_dir from its checkpoint, as `commbench run --resume` does) and records a runner's
exception as a failed run: one run's failure never stops a sweep.

`run_job` is what a Slurm job runs. submitit pickles the function it submits and its
arguments into the job folder when the job is queued, and unpickles them when the job
starts, maybe days later and after an upgrade of this code. A pickled function is an
import path: a job queued before a refactor that moved it would fail at start. So a job
holds only `bench.launch.jobentry.run_job` (this module's promise: that name stays) and plain
data: the config as a dict, the run directory as a string, the runner as a dotted name
imported when the job starts, and the requeue settings. Jobs queued before the floors
became folders (issue 44) hold `bench.jobentry.run_job` (bench/jobentry.py still names it)
and perhaps the runner `bench.launch.run_config` (`MOVED_RUNNERS` names its new home).

Inside the job (bench/run/stop.py does the stopping): Slurm's warning signal before the time
limit (sbatch `--signal`, executor.signal) or its SIGTERM (preemption; a requeue; a
cancel) stops the ranks at the next step boundary with a checkpoint. Then, as `scontrol
show job` says: a job that Slurm already requeues (its Restarts went up: `scontrol
requeue`, preemption in PreemptMode=REQUEUE) leaves without a result; a job still RUNNING
after the warning or a SIGTERM (preemption that cancels, `scancel --signal=TERM`)
requeues itself (`scontrol requeue`) until it has been restarted `executor.max_requeues`
times, and leaves without a result; a cancelled job (COMPLETING) is never requeued. No
result: Slurm runs the job again and the sweep keeps waiting for it. A restarted job
continues from the checkpoint; a job whose run is already recorded finished returns that
record. Otherwise the run stays recorded interrupted (partial): the next `commbench
sweep` resumes it. A multi-node run
(launch.nnodes > 1) runs one task per node, each starting torchrun, with the rendezvous
on the job's first node (`launch.rdzv_endpoint` when null: FIRST_NODE:PORT, PORT from
the job id, `with_rendezvous`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from bench.config import Config, config_hash, to_yaml
from bench.run.files import write_text
from bench.run.records import DONE_STATUSES, Busy, RunDir, status_of

DEFAULT_RUNNER = "bench.launch.run.run_config"
"""The runner jobs use unless the sweep was given another: a real training run."""

MOVED_RUNNERS = {"bench.launch.run_config": DEFAULT_RUNNER}
"""Runner names a job queued before a move may hold -> where the runner lives now."""

Runner = Callable[..., dict]
"""`runner(cfg, run_dir, progress=bool[, resume=True]) -> summary dict`."""

UNRECORDED = "unrecorded"
"""Set in the summary `execute_run` returns when the run was refused without a write into
its directory (`records.Busy`): what that directory holds is an earlier attempt's record,
not this outcome (bench/launch/executors.py reports the refusal, not that record)."""

RDZV_PORT_BASE = 20000
"""A multi-node job's rendezvous port is RDZV_PORT_BASE + its job id % RDZV_PORT_BASE."""


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
    module, _, attr = MOVED_RUNNERS.get(name, name).rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"runner {name!r} cannot be imported ({type(err).__name__}: {err}); "
                         f"a runner is a dotted name such as {DEFAULT_RUNNER!r}") from None


# ------------------------------------------------------------------------------ one run


def record_failure(cfg: Config, run_dir: Path, error: BaseException | str) -> dict:
    """A run that raised instead of returning a summary: keep a record with the error."""
    if isinstance(error, BaseException):
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        error = f"{type(error).__name__}: {error}\n{text}"
    run = RunDir(run_dir)
    run.path.mkdir(parents=True, exist_ok=True)
    if not run.config.exists():
        write_text(run.config, to_yaml(cfg))
    return run.update_summary({
        "status": "failed", "error": str(error), "run_name": cfg.run.name,
        "config_hash": config_hash(cfg), "strategy": cfg.strategy.name,
        "world_size": cfg.parallel.world_size,
    })


def execute_run(cfg: Config, run_dir: Path, runner: Runner | None = None,
                progress: bool = False, resume: bool = False) -> dict:
    """Train one run (`resume`: continue it from run_dir's checkpoint); never raises for
    the run's own failure (records status failed; a run directory another process holds,
    `records.Busy`, is failed without a write into it, the summary marked `UNRECORDED`).
    A stop (KeyboardInterrupt) propagates."""
    if runner is None:
        from bench.launch.run import run_config as runner
    try:
        return runner(cfg, run_dir, progress=progress, **({"resume": True} if resume else {}))
    except Busy as err:  # another process writes this run: its records are not ours to touch
        return {"status": "failed", "error": str(err), UNRECORDED: True}
    except Exception as err:
        return record_failure(cfg, run_dir, err)


# ------------------------------------------------------------------------- a Slurm job


def run_job(config_data: dict, run_dir: str, runner: str = DEFAULT_RUNNER,
            resume: bool = False, max_requeues: int = 0, warning_signal: str = "USR2") -> dict:
    """Train one run inside a Slurm job; returns its summary (a failure is recorded, not
    raised). Requeues the job on a stop from Slurm (module docstring).

    Imports happen here, at job start, so the job runs the code installed then."""
    from bench.config import from_dict
    from bench.launch.run import end_attempt, slurm_job_id
    from bench.run.stop import Stopped, stop_signals

    cfg = with_rendezvous(from_dict(config_data))
    run = RunDir(run_dir)
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if restarts:  # a requeued job: continue the run, unless it is already recorded done
        summary = _read(run)
        if status_of(summary) in DONE_STATUSES and summary.get("config_hash") == config_hash(cfg):
            return summary
        resume = resume or run.config.exists()
    try:
        with stop_signals():
            return execute_run(cfg, run.path, resolve(runner), resume=resume)
    except Stopped as stop:
        job, first_task = slurm_job_id(), os.environ.get("SLURM_PROCID", "0") == "0"
        summary = _read(run)
        if summary.get("status") == "running" and first_task:  # stopped outside the training
            summary = run.update_summary({"status": "failed", "interrupted": True,
                                          "error": f"stopped by {stop} (job {job})"})
        if status_of(summary) != "partial":
            return summary  # the run ended before the stop
        state, restarted = job_state(job)
        if restarted == restarts:  # Slurm does not requeue it: requeue it, or say why not
            why_not = _why_not_requeue(state, stop.signum, warning_signal, restarts,
                                       max_requeues)
            if why_not is None and first_task:
                why_not = requeue(job)
            if why_not is not None:
                print(f"job {job} not requeued: {why_not}; the run stays interrupted and the "
                      "next `commbench sweep` resumes it", file=sys.stderr)
                return summary
        if first_task and summary.get("attempts"):
            end_attempt(run, summary["attempts"][-1].get("reason") or str(stop), requeued=True)
        # no result: Slurm runs the job again and the sweep keeps waiting for it
        raise SystemExit(f"job {job} requeued after {stop}") from None


def _why_not_requeue(state: str, signum: int, warning_signal: str, restarts: int,
                     max_requeues: int) -> str | None:
    if state != "RUNNING":
        return f"the job is {state or 'gone'}, not RUNNING (cancelled?)"
    if signum not in (signal.SIGTERM, getattr(signal, f"SIG{warning_signal}")):
        return (f"{signal.Signals(signum).name} is not Slurm's stop (SIGTERM, or the time "
                f"limit's SIG{warning_signal}, executor.signal)")
    if restarts >= max_requeues:
        return f"restarted {restarts} times already (executor.max_requeues {max_requeues})"
    return None


def job_state(job_id: str | None) -> tuple[str, int]:
    """(JobState, Restarts) of a Slurm job now (`scontrol show job`); ("", 0) if unknown.
    A requeue by Slurm or by hand raises Restarts at once, while the job still runs."""
    if job_id is None:
        return "", 0
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "", 0
    fields = dict(w.split("=", 1) for w in out.split() if "=" in w)
    return fields.get("JobState", ""), int(fields.get("Restarts", "0") or 0)


def requeue(job_id: str) -> str | None:
    """`scontrol requeue JOB`; None when done, else why not."""
    done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True,
                          timeout=60)
    return None if done.returncode == 0 else f"scontrol requeue {job_id}: {done.stderr.strip()}"


def with_rendezvous(cfg: Config) -> Config:
    """A multi-node run in a Slurm job without launch.rdzv_endpoint: the job's first node,
    on port 20000 + job id % 20000 (launch is not part of the run's identity)."""
    if cfg.launch.nnodes == 1 or cfg.launch.rdzv_endpoint or "SLURM_JOB_NODELIST" not in os.environ:
        return cfg
    first = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, check=True,
                           timeout=60).stdout.split()[0]
    port = RDZV_PORT_BASE + int(os.environ["SLURM_JOB_ID"]) % RDZV_PORT_BASE
    return dataclasses.replace(cfg, launch=dataclasses.replace(
        cfg.launch, rdzv_endpoint=f"{first}:{port}"))


def _read(run: RunDir) -> dict:
    try:
        return run.read_summary() or {}
    except ValueError:
        return {}
