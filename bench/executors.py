"""Executors: how the runs of a sweep are trained, on this machine or through Slurm.

    commbench sweep configs/quickstart.yaml               # the local executor
    commbench sweep configs/sweeps/slurm-example.yaml     # the slurm executor (a login node)

bench.sweep decides which runs to train and where their records go; an `Executor` trains
them: `prepare(runs)` checks it can (before any record changes) and `run(todo, runner,
progress)` trains and returns each run's summary. Executors know nothing of sweep specs
(they import nothing of bench.sweep: a run and a progress display are `Run` and `Progress`).
A run that raises is recorded as failed, with its error, and never stops the sweep; Ctrl-C
does (the run in flight records itself as interrupted).

`local` runs one run at a time, or `max_parallel` at once (CUDA runs: each on its own
GPUs, `gpu_blocks`, never two runs on GPUs 0..n-1). `slurm` submits one
job per run, or one job array (`array: true`, throttled by `max_parallel`), through
submitit, and waits for them, polling every `poll_s` seconds; each job trains its run
with torchrun inside the allocation. A cluster example (also configs/sweeps/slurm-example.yaml):

    executor:
      name: slurm
      array: true
      max_parallel: 8              # jobs of the array running at once
      partition: gpu
      timeout_min: 240
      nodes: 1
      tasks_per_node: 1            # one task: the launcher; torchrun starts the ranks
      gpus_per_node: 8
      cpus_per_task: 64
      mem_gb: 400
      sbatch: {account: my-project, qos: normal}   # any further #SBATCH options
      setup: ["source .venv/bin/activate"]         # shell lines before the job starts

Job ids are kept in NAME/_slurm/jobs.json: a re-run while jobs are still queued or running
waits for them instead of submitting duplicates. `cluster: local` (submitit's local
executor) runs the same path on this machine; the tests use it.
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from tqdm import tqdm

from bench import jobentry, records
from bench.config import Config, from_dict, to_dict
from bench.jobentry import Runner, execute_run, record_failure


@dataclass
class ExecutorSpec:
    """The `executor:` section of a sweep spec (read by bench/typed.py like run configs)."""

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
    nodes: int = 1
    """Nodes per job (multi-node runs also need launch.nnodes and launch.rdzv_endpoint)."""
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
            if getattr(self, key) < 1:
                raise ValueError(f"executor.{key} must be >= 1, got {getattr(self, key)}")


class Run(Protocol):
    """What an executor reads of a run (bench.sweep.spec.SweepRun is one)."""

    run_id: str
    config: Config
    dir_name: str


class Progress(Protocol):
    """What an executor tells of its runs (bench.sweep.progress.Progress is one)."""

    live: bool

    def start(self, run: Run, run_dir: Path) -> None: ...

    def finish(self, run: Run, summary: dict) -> None: ...


# --------------------------------------------------------------------------- interface


class Executor:
    """How a sweep's runs are trained. Built from the spec's `executor:` section."""

    def __init__(self, spec: ExecutorSpec, name: str, sweep_dir: Path):
        self.spec, self.name, self.sweep_dir = spec, name, sweep_dir

    def prepare(self, runs: list[Run]) -> set[str]:
        """Fail (ValueError) if these runs cannot be trained; called before any record
        changes. Returns the ids of runs an earlier invocation is still training."""
        return set()

    def run(self, todo: list[tuple[Run, Path]], runner: Runner | None,
            progress: Progress) -> dict[str, dict]:
        """Train `todo` (run, run_dir) pairs; run id -> summary. A failing run is recorded
        as failed and never stops the others; Ctrl-C does."""
        raise NotImplementedError


def make_executor(spec: ExecutorSpec, name: str, sweep_dir: Path) -> Executor:
    """The executor named by `spec.name` for the sweep `name` recorded in `sweep_dir`."""
    return EXECUTORS[spec.name](spec, name, sweep_dir)


# ------------------------------------------------------------------------------- local


class LocalExecutor(Executor):
    """This machine: one run at a time, or `max_parallel` at once."""

    def prepare(self, runs: list[Run]) -> set[str]:
        from bench.config import check_device

        for run in runs:  # a config this machine cannot run fails the sweep, not the run
            check_device(run.config)
        return set()

    def run(self, todo, runner, progress):
        max_parallel = self.spec.max_parallel or 1
        blocks = gpu_blocks([run.config for run, _ in todo], max_parallel)
        return _run_local(todo, runner, max_parallel, progress, blocks)


def gpu_blocks(configs: list[Config], max_parallel: int) -> list[str] | None:
    """Disjoint CUDA_VISIBLE_DEVICES values for CUDA runs trained at once on this machine;
    None when they run one at a time or on the CPU. Each run's torchrun would otherwise
    put its ranks on GPUs 0..n-1, every run on the same ones."""
    import os

    import torch

    from bench.config import runs_on_cuda

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


def _run_local(todo: list[tuple[Run, Path]], runner: Runner | None, max_parallel: int,
               progress: Progress, gpu_blocks: list[str] | None = None) -> dict[str, dict]:
    """Train the runs here, one after another or `max_parallel` at once (with
    `gpu_blocks`: at most one run per block of GPUs at a time, each run on its block,
    `launch.cuda_visible_devices`).

    Ctrl-C stops the sweep: each run in flight records itself as interrupted (partial:
    trained again on re-run) and the KeyboardInterrupt propagates; runs not started yet
    are not started."""
    summaries: dict[str, dict] = {}
    free = None
    if gpu_blocks is not None:
        free = queue.SimpleQueue()
        for block in gpu_blocks:
            free.put(block)
        max_parallel = min(max_parallel, len(gpu_blocks))
    if max_parallel <= 1:
        for run, run_dir in todo:
            progress.start(run, run_dir)
            summaries[run.run_id] = execute_run(run.config, run_dir, runner,
                                                progress=not progress.live)
            progress.finish(run, summaries[run.run_id])
        return summaries

    in_flight: dict[str, Path] = {}  # run id -> run dir, while a thread trains it

    def work(run: Run, run_dir: Path) -> dict:
        block = free.get() if free is not None else None
        cfg = run.config
        if block is not None and cfg.launch.cuda_visible_devices is None:
            cfg = dataclasses.replace(cfg, launch=dataclasses.replace(
                cfg.launch, cuda_visible_devices=block))
        in_flight[run.run_id] = run_dir
        progress.start(run, run_dir)
        try:
            summary = execute_run(cfg, run_dir, runner, progress=False)
        finally:
            if block is not None:
                free.put(block)
        del in_flight[run.run_id]
        return summary

    pool = ThreadPoolExecutor(max_workers=max_parallel)
    try:
        futures = {pool.submit(work, run, run_dir): run for run, run_dir in todo}
        for future in as_completed(futures):
            run = futures[future]
            summaries[run.run_id] = future.result()
            progress.finish(run, summaries[run.run_id])
    except KeyboardInterrupt:
        # Ctrl-C reaches the main thread only (and, from a terminal, every torchrun child,
        # which then exits): let the runs in flight end, then mark the unfinished ones
        # interrupted (partial: a re-run trains them again).
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


_ACTIVE_SLURM_STATES = ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING",
                        "SUSPENDED", "RESIZING")


class SlurmExecutor(Executor):
    """One job per run, or one job array, through submitit; waits for them, polling."""

    def __init__(self, spec: ExecutorSpec, name: str, sweep_dir: Path):
        super().__init__(spec, name, sweep_dir)
        self.folder = sweep_dir / "_slurm"
        self.active: dict[str, Any] = {}
        self.submitit = None

    def prepare(self, runs: list[Run]) -> set[str]:
        self.submitit = _submitit_executor(self.spec, self.name, self.folder)
        self.active = _still_active_jobs(self.spec, self.folder, {r.run_id for r in runs})
        return set(self.active)

    def run(self, todo, runner, progress):
        by_id = {run.run_id: (run, run_dir) for run, run_dir in todo}
        to_submit = [(r, d) for r, d in todo if r.run_id not in self.active]
        jobs = submit(self.submitit, self.spec, self.name, to_submit, runner)
        pending = dict(self.active)
        pending.update({run.run_id: job for (run, _), job in zip(to_submit, jobs, strict=True)})
        ids = _load_jobs(self.folder)
        ids.update({run_id: job.job_id for run_id, job in pending.items()})
        records.write_json(self.folder / "jobs.json", ids)
        for run_id, job in pending.items():
            progress.start(*by_id[run_id])
            tqdm.write(f"  job {job.job_id}", file=sys.stderr)
        return _wait(pending, by_id, progress, self.spec.poll_s)


def _submitit_executor(ex: ExecutorSpec, name: str, folder: Path):
    import submitit

    try:
        executor = submitit.AutoExecutor(folder=str(folder / "%j"), cluster=ex.cluster)
    except RuntimeError as err:  # no srun/sbatch here
        raise ValueError(f"executor slurm: {err} Run the sweep on a Slurm login node, or set "
                         "executor.cluster: local (or --executor local) to run here.") from None
    params: dict[str, Any] = {
        "name": f"commbench-{name}", "timeout_min": ex.timeout_min, "nodes": ex.nodes,
        "tasks_per_node": ex.tasks_per_node, "gpus_per_node": ex.gpus_per_node,
        "cpus_per_task": ex.cpus_per_task, "mem_gb": ex.mem_gb,
        "slurm_partition": ex.partition, "slurm_additional_parameters": ex.sbatch or None,
        "slurm_setup": ex.setup or None, "local_setup": ex.setup or None,
    }
    if ex.max_parallel:
        params["slurm_array_parallelism"] = ex.max_parallel
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    return executor


def submit(executor, ex: ExecutorSpec, name: str, todo: list[tuple[Run, Path]],
           runner: Runner | None) -> list:
    """Submit one job per run (an array when `ex.array`); the submitit jobs, in order."""
    # Plain data and a runner NAME: a job queued before an upgrade still starts after it
    # (bench/jobentry.py imports the runner by name when the job starts).
    args = [(to_dict(r.config), str(d), jobentry.runner_name(runner)) for r, d in todo]
    if ex.array and len(args) > 1:
        with executor.batch():
            return [executor.submit(jobentry.run_job, *a) for a in args]
    jobs = []
    for a, (run, _) in zip(args, todo, strict=True):
        executor.update_parameters(name=f"commbench-{name}-{run.dir_name}")
        jobs.append(executor.submit(jobentry.run_job, *a))
    return jobs


def _load_jobs(folder: Path) -> dict[str, str]:
    path = folder / "jobs.json"
    return records.read_json(path) if path.exists() else {}


def _still_active_jobs(ex: ExecutorSpec, folder: Path, run_ids: set[str]) -> dict:
    """Jobs of an earlier invocation still queued or running, by run id (real Slurm only)."""
    if ex.cluster != "slurm":
        return {}
    import submitit

    active = {}
    for run_id, job_id in _load_jobs(folder).items():
        if run_id not in run_ids:
            continue
        job = submitit.SlurmJob(folder=str(folder / "%j"), job_id=str(job_id))
        if job.state.split()[0] in _ACTIVE_SLURM_STATES:
            active[run_id] = job
    return active


def _wait(pending: dict, by_id: dict, progress: Progress, poll_s: float) -> dict[str, dict]:
    """Poll the jobs until all ended; run id -> summary (failed when a job died)."""
    summaries: dict[str, dict] = {}
    try:
        while pending:
            for run_id, job in list(pending.items()):
                if not job.done():
                    continue
                run, run_dir = by_id[run_id]
                try:
                    summary = job.result()
                except Exception as err:  # killed, timed out, or crashed outside the run
                    summary = records.read_summary(run_dir) or {}
                    if summary.get("status") not in records.ENDED_STATUSES:
                        summary = record_failure(
                            run.config, run_dir, f"slurm job {job.job_id} ended without a "
                            f"result ({job.state}): {err}")
                summaries[run_id] = summary
                progress.finish(run, summary)
                del pending[run_id]
            if pending:
                time.sleep(poll_s)
    except KeyboardInterrupt:
        tqdm.write(f"stopped waiting; {len(pending)} job(s) keep running. Re-run the sweep to "
                   "wait for them and report.", file=sys.stderr)
        raise
    return summaries


def _slurm_job(config_data: dict, run_dir: str, runner: Runner | None) -> dict:
    """Entry point inside a submitit job (pickled by reference: keep it at module level)."""
    return execute_run(from_dict(config_data), Path(run_dir), runner, progress=False)


EXECUTORS: dict[str, Callable[[ExecutorSpec, str, Path], Executor]] = {
    "local": LocalExecutor, "slurm": SlurmExecutor,
}
