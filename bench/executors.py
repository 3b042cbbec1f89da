"""Executors: how the runs of a sweep are trained, on this machine or through Slurm.

    commbench sweep configs/quickstart.yaml               # the local executor
    commbench sweep configs/sweeps/slurm-example.yaml     # the slurm executor (a login node)

bench.sweep decides which runs to train and where their records go; this module trains
them and shows their progress. A run that raises is recorded as failed, with its error,
and never stops the sweep; Ctrl-C does (the run in flight records itself as interrupted).

`local` runs one run at a time, or `max_parallel` at once. `slurm` submits one
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

import json
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from bench import jobentry, records
from bench.config import Config, config_hash, from_dict, to_dict, to_yaml

if TYPE_CHECKING:
    from bench.sweep import RunOutcome, SweepRun, SweepSpec

Runner = Callable[..., dict]
"""`runner(cfg, run_dir, progress=bool) -> summary dict`, default bench.launch.run_config."""

# ---------------------------------------------------------------------------- one run


def _record_failure(cfg: Config, run_dir: Path, error: BaseException | str) -> dict:
    """A run that raised instead of returning a summary: keep a record with the error."""
    if isinstance(error, BaseException):
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        headline = f"{type(error).__name__}: {error}"
        error = f"{headline}\n{text}"
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "config.yaml").exists():
        records.write_text(run_dir / "config.yaml", to_yaml(cfg))
    return records.update_summary(run_dir, {
        "status": "failed", "error": str(error), "run_name": cfg.run.name,
        "config_hash": config_hash(cfg), "strategy": cfg.strategy.name,
        "world_size": cfg.parallel.world_size,
    })


def _default_runner() -> Runner:
    from bench.launch import run_config

    return run_config


def execute_run(cfg: Config, run_dir: Path, runner: Runner | None = None,
                progress: bool = False) -> dict:
    """Train one run; never raises for a run's own failure (records status failed)."""
    runner = runner or _default_runner()
    try:
        summary = runner(cfg, run_dir, progress=progress)
    except Exception as err:
        summary = _record_failure(cfg, run_dir, err)
    return summary


# --------------------------------------------------------------------------- progress


class _RunLine:
    """One running run's line: steps done, loss and tokens/s, read from its metrics.jsonl."""

    def __init__(self, run: SweepRun, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self.offset = 0
        self.bar = tqdm(total=run.config.run.steps, desc=f"  {run.label} seed={run.seed}",
                        unit="step", leave=False, dynamic_ncols=True)

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written waits
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            step, loss = row.get("step"), row.get("loss")
            if not isinstance(step, int) or not isinstance(loss, float) or step <= self.bar.n:
                continue
            self.bar.update(step - self.bar.n)
            elapsed = row.get("elapsed_s") or 0
            speed = f"  {row.get('tokens', 0) / elapsed:,.0f} tok/s" if elapsed else ""
            self.bar.set_postfix_str(f"loss {loss:.4f}{speed}", refresh=False)
        self.bar.refresh()


class _Progress:
    """The sweep-level bar (done / failed / remaining, ETA) above one line per running run.

    On a terminal, tqdm draws both and each run's line follows its metrics.jsonl (so runs
    train with their own progress printing off). Elsewhere (logs, CI, batch jobs) there
    are no bars: one line per run start and end, and the runs print their own progress."""

    def __init__(self, name: str, outcomes: list[RunOutcome], num_todo: int):
        self.total = len(outcomes)
        self.ok = sum(o.status in records.DONE_STATUSES for o in outcomes if not o.launched)
        self.failed = sum(o.status == "failed" for o in outcomes if not o.launched)
        self.started = 0
        self.num_todo = num_todo
        self.lock = threading.RLock()
        self.bar = tqdm(total=self.total, initial=self.total - num_todo, unit="run",
                        desc=f"sweep {name}", position=0, dynamic_ncols=True, disable=None)
        self.live = not self.bar.disable
        """Bars are drawn: runs should not print their own progress."""
        self.lines: dict[str, _RunLine] = {}
        self.stop = threading.Event()
        self._postfix()
        if self.live:
            self.poller = threading.Thread(target=self._poll, daemon=True)
            self.poller.start()

    def _postfix(self) -> None:
        left = self.total - self.ok - self.failed
        self.bar.set_postfix_str(f"done={self.ok} failed={self.failed} remaining={left}")

    def _poll(self) -> None:
        while not self.stop.wait(0.5):
            with self.lock:
                for line in self.lines.values():
                    line.poll()

    def start(self, run: SweepRun, run_dir: Path) -> None:
        with self.lock:
            self.started += 1
            tqdm.write(f"[{self.started}/{self.num_todo}] {run.label} seed={run.seed}: "
                       f"training -> {run_dir}", file=sys.stderr)
            if self.live:
                self.lines[run.run_id] = _RunLine(run, run_dir)

    def finish(self, run: SweepRun, summary: dict) -> None:
        status = summary.get("status", "failed")
        with self.lock:
            line = self.lines.pop(run.run_id, None)
            if line is not None:
                line.bar.close()
            if status == "failed":
                self.failed += 1
            else:
                self.ok += 1
            val = summary.get("final_val_loss")
            detail = f"final val loss {val:.4f}" if isinstance(val, float) else ""
            if status == "failed":
                detail = (summary.get("error") or "").strip().splitlines()[:1]
                detail = detail[0] if detail else "no error text"
            tqdm.write(f"  {run.label} seed={run.seed}: {status} {detail}".rstrip(),
                       file=sys.stderr)
            self._postfix()
            self.bar.update(1)

    def close(self) -> None:
        self.stop.set()
        with self.lock:
            for line in self.lines.values():
                line.bar.close()
            self.lines.clear()
        self.bar.close()


# ------------------------------------------------------------------------------- local


def _run_local(todo: list[tuple[SweepRun, Path]], runner: Runner | None, max_parallel: int,
               progress: _Progress) -> dict[str, dict]:
    """Train the runs here, one after another or `max_parallel` at once.

    Ctrl-C stops the sweep: each run in flight records itself as interrupted (partial:
    trained again on re-run) and the KeyboardInterrupt propagates; runs not started yet
    are not started."""
    summaries: dict[str, dict] = {}
    if max_parallel <= 1:
        for run, run_dir in todo:
            progress.start(run, run_dir)
            summaries[run.run_id] = execute_run(run.config, run_dir, runner,
                                                progress=not progress.live)
            progress.finish(run, summaries[run.run_id])
        return summaries

    in_flight: dict[str, Path] = {}  # run id -> run dir, while a thread trains it

    def work(run: SweepRun, run_dir: Path) -> dict:
        in_flight[run.run_id] = run_dir
        progress.start(run, run_dir)
        summary = execute_run(run.config, run_dir, runner, progress=False)
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


def _slurm_executor(spec: SweepSpec, folder: Path):
    import submitit

    ex = spec.executor
    try:
        executor = submitit.AutoExecutor(folder=str(folder / "%j"), cluster=ex.cluster)
    except RuntimeError as err:  # no srun/sbatch here
        raise ValueError(f"executor slurm: {err} Run the sweep on a Slurm login node, or set "
                         "executor.cluster: local (or --executor local) to run here.") from None
    params: dict[str, Any] = {
        "name": f"commbench-{spec.name}", "timeout_min": ex.timeout_min, "nodes": ex.nodes,
        "tasks_per_node": ex.tasks_per_node, "gpus_per_node": ex.gpus_per_node,
        "cpus_per_task": ex.cpus_per_task, "mem_gb": ex.mem_gb,
        "slurm_partition": ex.partition, "slurm_additional_parameters": ex.sbatch or None,
        "slurm_setup": ex.setup or None, "local_setup": ex.setup or None,
    }
    if ex.max_parallel:
        params["slurm_array_parallelism"] = ex.max_parallel
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    return executor


def _load_jobs(folder: Path) -> dict[str, str]:
    path = folder / "jobs.json"
    return records.read_json(path) if path.exists() else {}


def _still_active_slurm_jobs(spec: SweepSpec, folder: Path, run_ids: set[str]) -> dict:
    """Jobs of an earlier invocation still queued or running, by run id (real Slurm only)."""
    if spec.executor.cluster != "slurm":
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


def _run_slurm(spec: SweepSpec, executor, todo: list[tuple[SweepRun, Path]],
               runner: Runner | None, progress: _Progress, active: dict) -> dict[str, dict]:
    folder = spec.sweep_dir / "_slurm"
    by_id = {run.run_id: (run, run_dir) for run, run_dir in todo}
    to_submit = [(r, d) for r, d in todo if r.run_id not in active]
    args = [(to_dict(r.config), str(d), jobentry.runner_name(runner)) for r, d in to_submit]
    if spec.executor.array and len(args) > 1:
        with executor.batch():
            jobs = [executor.submit(jobentry.run_job, *a) for a in args]
    else:
        jobs = []
        for a, (run, _) in zip(args, to_submit, strict=True):
            executor.update_parameters(name=f"commbench-{spec.name}-{run.dir_name}")
            jobs.append(executor.submit(jobentry.run_job, *a))
    pending = dict(active)
    pending.update({run.run_id: job for (run, _), job in zip(to_submit, jobs, strict=True)})
    ids = _load_jobs(folder)
    ids.update({run_id: job.job_id for run_id, job in pending.items()})
    records.write_json(folder / "jobs.json", ids)
    for run_id, job in pending.items():
        run, run_dir = by_id[run_id]
        progress.start(run, run_dir)
        tqdm.write(f"  job {job.job_id}", file=sys.stderr)

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
                        summary = _record_failure(
                            run.config, run_dir, f"slurm job {job.job_id} ended without a "
                            f"result ({job.state}): {err}")
                summaries[run_id] = summary
                progress.finish(run, summary)
                del pending[run_id]
            if pending:
                time.sleep(spec.executor.poll_s)
    except KeyboardInterrupt:
        tqdm.write(f"stopped waiting; {len(pending)} job(s) keep running. Re-run the sweep to "
                   "wait for them and report.", file=sys.stderr)
        raise
    return summaries


def _slurm_job(config_data: dict, run_dir: str, runner: Runner | None) -> dict:
    """Entry point inside a submitit job (pickled by reference: keep it at module level)."""
    return execute_run(from_dict(config_data), Path(run_dir), runner, progress=False)
