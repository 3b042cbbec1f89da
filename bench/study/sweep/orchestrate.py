"""Sweep orchestration: which runs of a spec to train, training them, then the report.

    commbench sweep configs/quickstart.yaml [--dry-run] [--retry-failed] [--output-dir DIR]
    commbench sweep configs/quickstart.yaml --status     # where each run stands; starts nothing

Reads the spec (bench/study/sweep/spec.py), looks up each run's record (bench/study/sweep/store.py),
hands the runs to train to the spec's executor (bench/launch/executors.py) and builds the report.
A stopped run (interrupted, timed out, preempted; failed, with --retry-failed) continues
from its checkpoint in its own directory, as `commbench run --resume` does; only a run
without a usable checkpoint is retrained from step 0 (its old record moved aside), and the
sweep says why.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from bench.config import Config
from bench.config.preflight import check_output_dir
from bench.launch.executors import Executor, Task, make_executor
from bench.launch.jobentry import Runner
from bench.run.files import read_jsonl
from bench.run.records import DONE_STATUSES, RunDir
from bench.study.sweep import store
from bench.study.sweep.progress import Progress
from bench.study.sweep.spec import SweepRun, SweepSpec, format_value, load_spec


@dataclass
class RunOutcome:
    run: SweepRun
    run_dir: Path
    status: str
    """ok, failed, diverged, partial (killed), or new (dry run: not started)."""
    launched: bool
    """Whether this invocation trained it (False: skipped, already recorded)."""
    error: str | None = None
    resume_from: int | None = None
    """To train: continue from the checkpoint at this step (None: from step 0)."""
    why_restart: str = ""
    """To train from step 0 over an earlier record: why its checkpoint is not usable."""

    @property
    def task(self) -> Task:
        return Task(self.run.run_id, self.run.config, self.run_dir,
                    f"{self.run.label} seed={self.run.seed}", self.resume_from is not None)


@dataclass
class SweepResult:
    name: str
    sweep_dir: Path
    outcomes: list[RunOutcome]
    report: Path | None = None
    dry_run: bool = False

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    @property
    def num_launched(self) -> int:
        return sum(o.launched for o in self.outcomes)

    @property
    def ok(self) -> bool:
        """True when no run failed (diverged runs are results; partial only in dry runs)."""
        return not any(o.status == "failed" for o in self.outcomes)


# --------------------------------------------------------------------------- execution


def _launch(spec: SweepSpec, outcomes: list[RunOutcome], todo: list[RunOutcome],
            runner: Runner | None, executor: Executor, active: set[str]) -> None:
    """Move aside the old records of the runs to train from step 0, train, update `outcomes`."""
    sweep_dir = spec.sweep_dir
    # a run another process holds (a hand --resume, eval) stops the sweep before any record
    # moves: retiring or continuing it would mix two writers' records
    store.check_not_held([o.run_dir for o in todo if o.run.run_id not in active])
    for outcome in todo:
        outcome.launched = True
        run = outcome.run
        if run.run_id in active or outcome.resume_from is not None:
            continue  # a job of an earlier invocation still runs, or it resumes in place
        if outcome.run_dir.exists():
            moved = store.retire(outcome.run_dir, sweep_dir)
            tqdm.write(f"{run.label} seed={run.seed}: {outcome.why_restart}; trains from step "
                       f"0 (the earlier record moved to {moved})", file=sys.stderr)
        outcome.run_dir = sweep_dir / run.dir_name
    store.write_sweep_json(spec, {o.run.run_id: o.run_dir for o in outcomes})

    kept = [o for o in outcomes if not o.launched]
    progress = Progress(spec.name, len(outcomes), sum(o.status in DONE_STATUSES for o in kept),
                        sum(o.status == "failed" for o in kept), len(todo))
    try:
        summaries = executor.run([o.task for o in todo], runner, progress) if todo else {}
    finally:
        progress.close()
    for outcome in outcomes:
        summary = summaries.get(outcome.run.run_id)
        if summary is not None:
            outcome.status = summary.get("status", "failed")
            outcome.error = summary.get("error")


def plan(spec: SweepSpec, retry_failed: bool = False) -> list[RunOutcome]:
    """Each run's record and what a sweep would do with it (changes nothing)."""
    outcomes = []
    for run in spec.runs:
        run_dir = store.find_run_dir(spec.sweep_dir, run)
        status = store.record_state(run_dir)
        outcome = RunOutcome(run, run_dir, status, launched=False)
        if status == "failed":
            outcome.error = (store.read_summary(run_dir) or {}).get("error")
        if status == "partial" or (status == "failed" and retry_failed):
            outcome.resume_from, outcome.why_restart = store.resumable(
                run_dir, run.config.parallel.world_size)
        outcomes.append(outcome)
    return outcomes


def _to_train(outcome: RunOutcome, retry_failed: bool) -> bool:
    return outcome.status in ("new", "partial") or (outcome.status == "failed" and retry_failed)


def run_sweep(spec_path: str | os.PathLike, *, dry_run: bool = False, retry_failed: bool = False,
              executor: str | None = None, max_parallel: int | None = None, report: bool = True,
              runner: Runner | None = None, output_dir: str | os.PathLike | None = None,
              overrides: list[str] | tuple[str, ...] = (),
              check_run: Callable[[Config], None] | None = None) -> SweepResult:
    """Run the runs of a sweep that are not recorded yet, continue the stopped ones from
    their checkpoints, then build the report.

    `executor` ('local' or 'slurm'), `max_parallel` and `output_dir` override the spec;
    `overrides` (KEY=VALUE) are set on every run. `check_run(config)` is called on every
    run before anything is written (the command line checks eval tasks with it). `runner`
    replaces bench.launch.run.run_config (tests pass a fake). Prints the report path.
    """
    spec = _load(spec_path, executor, max_parallel, output_dir, overrides)
    for run in spec.runs if check_run else ():
        check_run(run.config)
    sweep_dir = spec.sweep_dir
    outcomes = plan(spec, retry_failed)
    todo = [o for o in outcomes if _to_train(o, retry_failed)]

    if dry_run:
        _print_plan(spec, outcomes, {o.run.run_id for o in todo})
        return SweepResult(spec.name, sweep_dir, outcomes, dry_run=True)

    executor = make_executor(spec.executor, spec.name, sweep_dir)
    # nothing written yet
    active = executor.prepare([o.task for o in todo]) if todo else set()
    check_output_dir(str(sweep_dir), "the sweep's output_dir")
    with store.sweep_lock(sweep_dir):
        _launch(spec, outcomes, todo, runner, executor, active)

    result = SweepResult(spec.name, sweep_dir, outcomes)
    skipped = len(outcomes) - result.num_launched
    print(f"sweep {spec.name}: {result.count('ok')} ok, {result.count('failed')} failed, "
          f"{result.count('diverged')} diverged ({result.num_launched} trained now, {skipped} "
          f"already recorded) in {sweep_dir}")
    if result.count("failed"):
        print("failed runs keep their record; re-run them with --retry-failed")
    if report:
        from bench.study.report import build_report

        try:
            # the spec's target_loss reaches the report through sweep.json, its what-if
            # scenario (`whatif:`) from the spec itself
            result.report = build_report(sweep_dir, spec.report_dir, whatif=spec.whatif)
        except ValueError as err:
            print(f"no report: {err}")
        else:
            print(f"report: {result.report}")
    return result


def _load(spec_path, executor, max_parallel, output_dir, overrides) -> SweepSpec:
    spec = load_spec(spec_path, output_dir=output_dir, overrides=overrides)
    changes = {"name": executor, "max_parallel": max_parallel}
    spec.executor = dataclasses.replace(  # re-checked like the spec's own values
        spec.executor, **{k: v for k, v in changes.items() if v is not None})
    return spec


def sweep_status(spec_path: str | os.PathLike, *, executor: str | None = None,
                 output_dir: str | os.PathLike | None = None,
                 overrides: list[str] | tuple[str, ...] = ()) -> list[dict]:
    """Where every run of a sweep stands, printed as a table (and returned as rows):
    recorded ok / failed / diverged, running, queued in Slurm (with its job id), stopped
    (resumable from a step), or not started; its attempts and last step. Starts nothing."""
    spec = _load(spec_path, executor, None, output_dir, overrides)
    outcomes = plan(spec)
    queued = make_executor(spec.executor, spec.name, spec.sweep_dir).queued(
        {o.run.run_id for o in outcomes})
    sweeping = store.lock_holder(spec.sweep_dir)
    rows = []
    for o in outcomes:
        summary = store.read_summary(o.run_dir) or {}
        state = {"new": "not started", "partial": "stopped"}.get(o.status, o.status)
        if o.run.run_id in queued:
            state = queued[o.run.run_id]
        elif summary.get("status") == "running" and sweeping is not None:
            state = (f"running (sweep process {sweeping.get('pid')} on "
                     f"{sweeping.get('host')})")
        elif o.status == "partial":
            state = (f"stopped, resumes from step {o.resume_from}" if o.resume_from
                     else "stopped, no checkpoint")
        rows.append({"run_id": o.run.run_id, "variant": o.run.variant, "seed": o.run.seed,
                     "state": state, "attempts": len(summary.get("attempts") or []),
                     "last_step": _last_step(o.run_dir, summary), "run_dir": str(o.run_dir)})
    header = ("run id", "variant", "seed", "state", "attempts", "last step")
    table = [header] + [(r["run_id"], r["variant"], str(r["seed"]), r["state"],
                         str(r["attempts"]), str(r["last_step"] if r["last_step"] is not None
                                                 else "-")) for r in rows]
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    print(f"sweep {spec.name}: {len(rows)} runs in {spec.sweep_dir} (executor "
          f"{spec.executor.name})")
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return rows


def _last_step(run_dir: Path, summary: dict) -> int | None:
    """The run's last recorded step: its summary's, else its last metrics row's."""
    if isinstance(summary.get("steps"), int):
        return summary["steps"]
    rows = read_jsonl(RunDir(run_dir).metrics, skipped=[])
    return max((r["step"] for r in rows if isinstance(r.get("step"), int)), default=None)


def _print_plan(spec: SweepSpec, outcomes: list[RunOutcome], todo: set[str]) -> None:
    rows = []
    for i, o in enumerate(outcomes, 1):
        action = "run" if o.run.run_id in todo else "skip"
        if o.status == "failed" and o.run.run_id not in todo:
            action = "skip (failed; --retry-failed)"
        elif o.run.run_id in todo and o.resume_from is not None:
            action = f"resume from step {o.resume_from}"
        elif o.run.run_id in todo and o.status != "new":
            action = "run from step 0"
        shown = {k: v for k, v in o.run.overrides.items() if k not in ("run.name", "run.seed")}
        text = " ".join(f"{k}={format_value(v)}" for k, v in shown.items())
        rows.append((str(i), o.run.run_id, o.run.variant, str(o.run.seed), o.status, action, text))
    header = ("#", "run id", "variant", "seed", "state", "action", "overrides")
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header) - 1)]
    print(f"sweep {spec.name}: {len(outcomes)} runs, {len(todo)} to run, into {spec.sweep_dir} "
          f"(executor {spec.executor.name})")
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
