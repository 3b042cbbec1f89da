"""Executors: how the runs of a sweep are trained, on this machine or through Slurm.

    commbench sweep configs/quickstart.yaml               # the local executor
    commbench sweep configs/sweeps/slurm-example.yaml     # the slurm executor (a login node)

bench.study.sweep decides which runs to train, where their records go and which continue from a
checkpoint; an `Executor` trains them (`Task`s): `prepare(tasks)` checks it can (before
any record changes) and `run(tasks, runner, progress)` trains and returns each run's
summary. Executors know nothing of sweep specs. A run that raises is recorded as failed,
with its error, and never stops the sweep; a stop signal does (the runs in flight
checkpoint at their next step boundary and are recorded interrupted, bench/launch/run.py).

`local` runs one run at a time, or `max_parallel` at once (CUDA runs: each on its own
GPUs, `gpu_blocks`, never two runs on GPUs 0..n-1). `slurm` submits one job per run, or
one job array (`array: true`, throttled by `max_parallel`), through submitit, and waits
for them, polling every `poll_s` seconds; each job trains its run with torchrun inside the
allocation, one task per node (a run's `launch.nnodes` nodes; bench/launch/jobentry.py). Jobs
ask Slurm for `signal` `signal_delay_s` seconds before their time limit; on it, or on
Slurm's SIGTERM (preemption), the run checkpoints at the next step boundary and the job
requeues itself, up to `max_requeues` times (bench/launch/jobentry.py). A cluster example (also
configs/sweeps/slurm-example.yaml):

    executor:
      name: slurm
      array: true
      max_parallel: 8              # jobs of the array running at once
      partition: gpu
      timeout_min: 240
      max_requeues: 5              # after the time limit's warning or a preemption
      signal_delay_s: 300          # a step, a checkpoint save and Slurm's ~60 s resolution
      gpus_per_node: 8
      cpus_per_task: 64
      mem_gb: 400
      sbatch: {account: my-project, qos: normal}   # any further #SBATCH options
      setup: ["source .venv/bin/activate"]         # shell lines before the job starts

Job ids are kept in NAME/_slurm/jobs.json: a re-run while jobs are still queued or running
waits for them instead of submitting duplicates, and `commbench sweep SPEC --status` shows
them. `cluster: local` (submitit's local executor) runs the same path on this machine; the
tests use it.
"""

from __future__ import annotations

import dataclasses
import queue
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import Any, Literal, Protocol

from tqdm import tqdm

from bench.config import Config, to_dict
from bench.launch import jobentry
from bench.launch.jobentry import Runner, execute_run, record_failure
from bench.run import files, records
from bench.run.records import RunDir
from bench.run.stop import stop_signals


@dataclass
class ExecutorSpec:
    """The `executor:` section of a sweep spec (read by bench/config/typed.py like run configs)."""

    name: Literal["local", "slurm"] = "local"
    """local (this machine) or slurm (submitit)."""
    max_parallel: int | None = None
    """local: runs at once (default 1); slurm: array jobs running at once (default unlimited)."""
    cluster: Literal["slurm", "local"] = "slurm"
    """slurm; or local, submitit's local executor (tests, or a workstation without Slurm)."""
    array: bool = True
    """slurm: submit one job array (true) or one job per run (false)."""
    poll_s: float = 30.0
    """slurm: seconds between checks of the jobs' state."""
    partition: str | None = None
    """slurm partition."""
    timeout_min: int = 60
    """Wall-clock limit of each job, minutes."""
    max_requeues: int = 3
    """slurm: times a job requeues itself on Slurm's warning before its time limit or on
    SIGTERM (preemption), each time continuing from the checkpoint its run saves at the
    stop; after that the run stays recorded interrupted and the next sweep resumes it."""
    signal: Literal["USR1", "USR2"] = "USR2"
    """slurm: the signal a job asks for before its time limit (sbatch --signal)."""
    signal_delay_s: int = 120
    """slurm: seconds before the time limit at which it comes: a step and a checkpoint save
    must fit, plus Slurm's timer resolution (it may come up to 60 s early)."""
    nodes: int | None = None
    """Nodes per job; null = each run's launch.nnodes (a run of several nodes is one job
    of that many nodes, a task on each starting torchrun, rendezvous on the first)."""
    tasks_per_node: int = 1
    """Tasks per node; 1 = the launcher, which starts the ranks with torchrun."""
    gpus_per_node: int | None = None
    """GPUs per node."""
    cpus_per_task: int | None = None
    """CPU cores per task."""
    mem_gb: float | None = None
    """Memory per node, GB."""
    sbatch: dict = field(default_factory=dict)
    """Further #SBATCH options, e.g. {account: proj, qos: high, constraint: a100}."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run in the job before the run starts (module load, venv activation)."""

    def __post_init__(self):
        if self.max_parallel is not None and self.max_parallel < 1:
            raise ValueError(f"executor.max_parallel must be >= 1, got {self.max_parallel}")
        if self.poll_s <= 0:
            raise ValueError(f"executor.poll_s must be > 0, got {self.poll_s}")
        for key in ("timeout_min", "nodes", "tasks_per_node"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"executor.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("max_requeues", "signal_delay_s"):
            if getattr(self, key) < 0:
                raise ValueError(f"executor.{key} must be >= 0, got {getattr(self, key)}")


@dataclass(frozen=True)
class Task:
    """A run for an executor to train."""

    run_id: str
    config: Config
    run_dir: Path
    label: str
    """How progress lines name it."""
    resume: bool = False
    """Continue the run recorded in run_dir from its checkpoint (`commbench run --resume`)."""


class Progress(Protocol):
    """What executors report to (bench/study/sweep/progress.py draws it)."""

    live: bool
    """Bars are drawn: runs should not print their own progress."""

    def start(self, task: Task, note: str = "") -> None: ...

    def finish(self, task: Task, summary: dict) -> None: ...


# --------------------------------------------------------------------------- interface


class Executor:
    """How a sweep's runs are trained. Built from the spec's `executor:` section."""

    def __init__(self, spec: ExecutorSpec, name: str, sweep_dir: Path):
        self.spec, self.name, self.sweep_dir = spec, name, sweep_dir

    def prepare(self, tasks: list[Task]) -> set[str]:
        """Fail (ValueError) if these runs cannot be trained; called before any record
        changes. Returns the ids of runs an earlier invocation is still training."""
        return set()

    def run(self, tasks: list[Task], runner: Runner | None,
            progress: Progress) -> dict[str, dict]:
        """Train the tasks; run id -> summary. A failing run is recorded as failed and never
        stops the others; a stop signal does."""
        raise NotImplementedError

    def queued(self, run_ids: set[str]) -> dict[str, str]:
        """Runs an earlier invocation left queued or running here: run id -> its state in
        words (with a job id). Nothing is started."""
        return {}


def make_executor(spec: ExecutorSpec, name: str, sweep_dir: Path) -> Executor:
    """The executor named by `spec.name` for the sweep `name` recorded in `sweep_dir`."""
    return EXECUTORS[spec.name](spec, name, sweep_dir)


# ------------------------------------------------------------------------------- local


class LocalExecutor(Executor):
    """This machine: one run at a time, or `max_parallel` at once."""

    def prepare(self, tasks: list[Task]) -> set[str]:
        from bench.config.preflight import check_device

        for task in tasks:  # a config this machine cannot run fails the sweep, not the run
            check_device(task.config)
        return set()

    def run(self, tasks, runner, progress):
        max_parallel = self.spec.max_parallel or 1
        blocks = gpu_blocks([task.config for task in tasks], max_parallel)
        return _run_local(tasks, runner, max_parallel, progress, blocks)


def gpu_blocks(configs: list[Config], max_parallel: int) -> list[str] | None:
    """Disjoint CUDA_VISIBLE_DEVICES values for CUDA runs trained at once on this machine;
    None when they run one at a time or on the CPU. Each run's torchrun would otherwise
    put its ranks on GPUs 0..n-1, every run on the same ones."""
    import os

    import torch

    from bench.config.preflight import runs_on_cuda

    on_cuda = [c for c in configs if runs_on_cuda(c)]
    if max_parallel <= 1 or not on_cuda:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = ([d.strip() for d in visible.split(",") if d.strip()] if visible is not None
           else [str(i) for i in range(torch.cuda.device_count())])
    per_run = max(c.parallel.world_size // c.launch.nnodes for c in on_cuda)
    blocks = [",".join(ids[i:i + per_run]) for i in range(0, len(ids) - per_run + 1, per_run)]
    if not blocks:
        raise ValueError(f"a run needs {per_run} GPUs and this machine has {len(ids)} "
                         "visible: lower parallel.world_size")
    return blocks


def _run_local(tasks: list[Task], runner: Runner | None, max_parallel: int,
               progress: Progress, gpu_blocks: list[str] | None = None) -> dict[str, dict]:
    """Train the runs here, one after another or `max_parallel` at once (with
    `gpu_blocks`: at most one run per block of GPUs at a time, each run on its block,
    `launch.cuda_visible_devices`).

    A stop signal stops the sweep: the runs in flight stop at their next step boundary,
    with a checkpoint, and are recorded interrupted (partial: a re-run continues them,
    bench/launch/run.py), then `Stopped` propagates; runs not started yet are not started."""
    summaries: dict[str, dict] = {}
    free = None
    if gpu_blocks is not None:
        free = queue.SimpleQueue()
        for block in gpu_blocks:
            free.put(block)
        max_parallel = min(max_parallel, len(gpu_blocks))
    if max_parallel <= 1:
        with stop_signals():
            for task in tasks:
                progress.start(task)
                summaries[task.run_id] = execute_run(task.config, task.run_dir, runner,
                                                     progress=not progress.live,
                                                     resume=task.resume)
                progress.finish(task, summaries[task.run_id])
        return summaries

    in_flight: dict[str, Path] = {}  # run id -> run dir, while a thread trains it

    def work(task: Task) -> dict:
        block = free.get() if free is not None else None
        try:  # the block goes back whatever happens: the other runs wait for it
            cfg = task.config
            if block is not None and cfg.launch.cuda_visible_devices is None:
                cfg = dataclasses.replace(cfg, launch=dataclasses.replace(
                    cfg.launch, cuda_visible_devices=block))
            in_flight[task.run_id] = task.run_dir
            progress.start(task)
            summary = execute_run(cfg, task.run_dir, runner, progress=False,
                                  resume=task.resume)
        finally:
            if block is not None:
                free.put(block)
        del in_flight[task.run_id]
        return summary

    pool = ThreadPoolExecutor(max_workers=max_parallel)
    try:
        with stop_signals():  # the main thread relays a stop to every run in flight
            futures = {pool.submit(work, task): task for task in tasks}
            for future in as_completed(futures):
                task = futures[future]
                summaries[task.run_id] = future.result()
                progress.finish(task, summaries[task.run_id])
    except KeyboardInterrupt:
        # a stop reaches the main thread only: let the runs in flight end (they stop at
        # their next step boundary), then mark any that did not record the stop
        stopped = list(in_flight.values())
        pool.shutdown(wait=True, cancel_futures=True)
        for run_dir in stopped:
            if records.status_of(records.read_summary(run_dir)) not in records.DONE_STATUSES:
                records.update_summary(run_dir, {"status": "failed", "interrupted": True,
                                                 "error": "interrupted by the user"})
        raise
    finally:  # runs not started yet are never started
        pool.shutdown(wait=True, cancel_futures=True)
    return summaries


# ------------------------------------------------------------------------------- slurm


class SlurmExecutor(Executor):
    """One job per run, or one job array, through submitit; waits for them, polling."""

    def __init__(self, spec: ExecutorSpec, name: str, sweep_dir: Path):
        super().__init__(spec, name, sweep_dir)
        self.folder = sweep_dir / "_slurm"
        self.active: dict[str, Any] = {}
        self.submitit = None

    def prepare(self, tasks: list[Task]) -> set[str]:
        for task in tasks:
            self.nodes(task)  # refuses a mismatch before anything is submitted
        self.submitit = _submitit_executor(self.spec, self.name, self.folder)
        self.active = _still_active_jobs(self.spec, self.folder, {t.run_id for t in tasks})
        return set(self.active)

    def nodes(self, task: Task) -> int:
        """The nodes of a task's job: its run's launch.nnodes (ValueError on a mismatch)."""
        nnodes = task.config.launch.nnodes
        if self.spec.nodes is not None and self.spec.nodes != nnodes:
            raise ValueError(f"executor.nodes is {self.spec.nodes} but run {task.label} has "
                             f"launch.nnodes {nnodes}: a run of N nodes is one job of N nodes "
                             "(leave executor.nodes null to take each run's launch.nnodes)")
        if nnodes > 1 and self.spec.cluster == "local":
            raise ValueError(f"run {task.label}: launch.nnodes {nnodes} needs a Slurm cluster; "
                             "executor.cluster: local runs one node")
        return nnodes

    def run(self, tasks, runner, progress):
        by_id = {task.run_id: task for task in tasks}
        to_submit = [task for task in tasks if task.run_id not in self.active]
        pending = dict(self.active)
        pending.update(zip([t.run_id for t in to_submit],
                           submit(self.submitit, self.spec, self.name, to_submit, runner,
                                  self.nodes), strict=True))
        ids = _load_jobs(self.folder)
        ids.update({run_id: job.job_id for run_id, job in pending.items()})
        files.write_json(self.folder / "jobs.json", ids)
        for run_id, job in pending.items():
            progress.start(by_id[run_id], f"job {job.job_id}")
        return _wait(pending, by_id, progress, self.spec.poll_s)

    def queued(self, run_ids: set[str]) -> dict[str, str]:
        jobs = {r: str(j) for r, j in _load_jobs(self.folder).items() if r in run_ids}
        if self.spec.cluster != "slurm" or not jobs:
            return {}
        try:
            out = subprocess.run(["squeue", "-h", "-r", "-o", "%i %T", "-j",
                                  ",".join(jobs.values())], capture_output=True, text=True,
                                 timeout=60).stdout
        except (OSError, subprocess.TimeoutExpired):
            return {}
        states = dict(line.split(maxsplit=1) for line in out.splitlines() if " " in line)
        return {r: f"{states[j].lower()} (job {j})" for r, j in jobs.items()
                if states.get(j, "COMPLETING") != "COMPLETING"}  # completing: its record says


def _submitit_executor(ex: ExecutorSpec, name: str, folder: Path):
    import submitit

    try:
        executor = submitit.AutoExecutor(folder=str(folder / "%j"), cluster=ex.cluster)
    except RuntimeError as err:  # no srun/sbatch here
        raise ValueError(f"executor slurm: {err} Run the sweep on a Slurm login node, or set "
                         "executor.cluster: local (or --executor local) to run here.") from None
    params: dict[str, Any] = {
        "name": f"commbench-{name}", "timeout_min": ex.timeout_min,
        "tasks_per_node": ex.tasks_per_node, "gpus_per_node": ex.gpus_per_node,
        "cpus_per_task": ex.cpus_per_task, "mem_gb": ex.mem_gb,
        "slurm_partition": ex.partition, "slurm_setup": ex.setup or None,
        "local_setup": ex.setup or None, "slurm_signal_delay_s": ex.signal_delay_s,
        # the warning signal before the time limit (bench/launch/jobentry.py requeues on it)
        "slurm_additional_parameters": {"signal": f"{ex.signal}@{ex.signal_delay_s}",
                                        **ex.sbatch},
    }
    if ex.max_parallel:
        params["slurm_array_parallelism"] = ex.max_parallel
    if ex.cluster == "local":
        params = {k: v for k, v in params.items() if not k.startswith("slurm_")}
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    return executor


def submit(executor, ex: ExecutorSpec, name: str, tasks: list[Task], runner: Runner | None,
           nodes: Callable[[Task], int]) -> list:
    """Submit one job per run (arrays when `ex.array`, one per node count); the submitit
    jobs, in the order of `tasks`."""
    # Plain data and a runner NAME: a job queued before an upgrade still starts after it
    # (bench/launch/jobentry.py imports the runner by name when the job starts).
    def args(task: Task) -> tuple:
        return (to_dict(task.config), str(task.run_dir), jobentry.runner_name(runner),
                task.resume, ex.max_requeues, ex.signal)

    jobs: dict[str, Any] = {}
    for num_nodes, group in groupby(sorted(tasks, key=nodes), key=nodes):
        group = list(group)
        if ex.cluster == "slurm":
            executor.update_parameters(nodes=num_nodes)
        if ex.array and len(group) > 1:
            executor.update_parameters(name=f"commbench-{name}")
            with executor.batch():
                submitted = [executor.submit(jobentry.run_job, *args(t)) for t in group]
        else:
            submitted = []
            for task in group:
                executor.update_parameters(name=f"commbench-{name}-{task.run_dir.name}")
                submitted.append(executor.submit(jobentry.run_job, *args(task)))
        jobs.update(zip([t.run_id for t in group], submitted, strict=True))
    return [jobs[task.run_id] for task in tasks]


def _load_jobs(folder: Path) -> dict[str, str]:
    path = folder / "jobs.json"
    return files.read_json(path) if path.exists() else {}


def _still_active_jobs(ex: ExecutorSpec, folder: Path, run_ids: set[str]) -> dict:
    """Jobs of an earlier invocation still queued or running, by run id (real Slurm only):
    not done, as submitit sees it (no result yet, and a state that is not an end: a job
    that returned its result while Slurm completes it is done)."""
    if ex.cluster != "slurm":
        return {}
    import submitit

    active = {}
    for run_id, job_id in _load_jobs(folder).items():
        if run_id not in run_ids:
            continue
        job = submitit.SlurmJob(folder=str(folder / "%j"), job_id=str(job_id))
        if not job.done(force_check=True):
            active[run_id] = job
    return active


def _wait(pending: dict, by_id: dict[str, Task], progress: Progress,
          poll_s: float) -> dict[str, dict]:
    """Poll the jobs until all ended; run id -> summary, as the run directory records it
    (a job's tasks may end without a result while its run is recorded: one per node, a
    node lost); failed, with the job's state, when a job died before recording its run;
    failed with the job's own error when it was refused the run directory (another
    process held it: `jobentry.UNRECORDED`), whose record is then an earlier attempt's."""
    summaries: dict[str, dict] = {}
    try:
        while pending:
            for run_id, job in list(pending.items()):
                if not job.done():
                    continue
                task = by_id[run_id]
                try:
                    results = job.results()
                    error = None
                except Exception as err:  # killed, timed out, or crashed outside the run
                    results = []
                    error = f"slurm job {job.job_id} ended without a result ({job.state}): {err}"
                refused = [r for r in results if isinstance(r, dict) and r.get(jobentry.UNRECORDED)]
                try:
                    summary = RunDir(task.run_dir).read_summary() or {}
                except ValueError:
                    summary = {}
                if refused:  # the job wrote nothing: the record there is an earlier attempt's
                    summary = {**refused[0], "error": f"slurm job {job.job_id}: "
                               f"{refused[0].get('error')} (the run's record is left as it was)"}
                elif summary.get("status") not in records.ENDED_STATUSES:
                    summary = record_failure(task.config, task.run_dir,
                                             error or f"slurm job {job.job_id} left no record")
                summaries[run_id] = summary
                progress.finish(task, summary)
                del pending[run_id]
            if pending:
                time.sleep(poll_s)
    except KeyboardInterrupt:
        tqdm.write(f"stopped waiting; {len(pending)} job(s) keep running. Re-run the sweep to "
                   "wait for them and report.", file=sys.stderr)
        raise
    return summaries


EXECUTORS: dict[str, Callable[[ExecutorSpec, str, Path], Executor]] = {
    "local": LocalExecutor, "slurm": SlurmExecutor,
}
