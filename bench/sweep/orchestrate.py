"""Sweep orchestration: which runs of a spec to train, training them, then the report.

    commbench sweep configs/quickstart.yaml [--dry-run] [--retry-failed] [--output-dir DIR]

Reads the spec (bench/sweep/spec.py), looks up each run's record (bench/sweep/store.py),
hands the runs to train to the spec's executor (bench/executors.py) and builds the report.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from bench import records
from bench.config import Config, check_output_dir
from bench.executors import Executor, Runner, make_executor
from bench.sweep import store
from bench.sweep.progress import Progress
from bench.sweep.spec import SweepRun, SweepSpec, format_value, load_spec
from bench.sweep.store import RunOutcome


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


def _launch(spec: SweepSpec, outcomes: list[RunOutcome], todo: list[tuple[SweepRun, Path]],
            runner: Runner | None, executor: Executor, active: set[str]) -> None:
    """Move old records of the runs to redo aside, train them, update `outcomes`."""
    sweep_dir = spec.sweep_dir
    store.check_not_held([run_dir for run, run_dir in todo if run.run_id not in active])
    launch_dirs: dict[str, Path] = {}
    for run, run_dir in todo:
        if run.run_id in active:  # a job of an earlier invocation still runs: wait for it
            launch_dirs[run.run_id] = run_dir
            continue
        if run_dir.exists():
            moved = store.retire(run_dir, sweep_dir)
            tqdm.write(f"moved the earlier record of {run.label} seed={run.seed} to {moved}",
                       file=sys.stderr)
        launch_dirs[run.run_id] = sweep_dir / run.dir_name
    todo = [(run, launch_dirs[run.run_id]) for run, _ in todo]
    for outcome in outcomes:
        if outcome.run.run_id in launch_dirs:
            outcome.launched = True
            outcome.run_dir = launch_dirs[outcome.run.run_id]
    store.write_sweep_json(spec, {o.run.run_id: o.run_dir for o in outcomes})

    progress = Progress(spec.name, outcomes, len(todo))
    try:
        summaries = executor.run(todo, runner, progress) if todo else {}
    finally:
        progress.close()
    for outcome in outcomes:
        summary = summaries.get(outcome.run.run_id)
        if summary is not None:
            outcome.status = summary.get("status", "failed")
            outcome.error = summary.get("error")


def run_sweep(spec_path: str | os.PathLike, *, dry_run: bool = False, retry_failed: bool = False,
              executor: str | None = None, max_parallel: int | None = None, report: bool = True,
              runner: Runner | None = None, output_dir: str | os.PathLike | None = None,
              overrides: list[str] | tuple[str, ...] = (),
              check_run: Callable[[Config], None] | None = None) -> SweepResult:
    """Run the runs of a sweep that are not recorded yet, then build the report.

    `executor` ('local' or 'slurm'), `max_parallel` and `output_dir` override the spec;
    `overrides` (KEY=VALUE) are set on every run. `check_run(config)` is called on every
    run before anything is written (the command line checks eval tasks with it). `runner`
    replaces bench.launch.run_config (tests pass a fake). Prints the report path.
    """
    spec = load_spec(spec_path, output_dir=output_dir, overrides=overrides)
    for run in spec.runs if check_run else ():
        check_run(run.config)
    changes = {"name": executor, "max_parallel": max_parallel}
    spec.executor = dataclasses.replace(  # re-checked like the spec's own values
        spec.executor, **{k: v for k, v in changes.items() if v is not None})
    sweep_dir = spec.sweep_dir

    outcomes: list[RunOutcome] = []
    todo: list[tuple[SweepRun, Path]] = []
    for run in spec.runs:
        run_dir = store.find_run_dir(sweep_dir, run)
        status = store.record_state(run_dir)
        summary = records.read_summary(run_dir) if status == "failed" else None
        outcome = RunOutcome(run, run_dir, status, launched=False,
                             error=(summary or {}).get("error"))
        outcomes.append(outcome)
        if status == "new" or status == "partial" or (status == "failed" and retry_failed):
            todo.append((run, run_dir))

    if dry_run:
        _print_plan(spec, outcomes, {r.run_id for r, _ in todo})
        return SweepResult(spec.name, sweep_dir, outcomes, dry_run=True)

    executor = make_executor(spec.executor, spec.name, sweep_dir)
    active = executor.prepare([run for run, _ in todo]) if todo else set()  # nothing written yet
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
        from bench.report import build_report

        try:
            # the spec's target_loss reaches the report through sweep.json
            result.report = build_report(sweep_dir, spec.report_dir)
        except ValueError as err:
            print(f"no report: {err}")
        else:
            print(f"report: {result.report}")
    return result


def _print_plan(spec: SweepSpec, outcomes: list[RunOutcome], todo: set[str]) -> None:
    rows = []
    for i, o in enumerate(outcomes, 1):
        action = "run" if o.run.run_id in todo else "skip"
        if o.status == "failed" and o.run.run_id not in todo:
            action = "skip (failed; --retry-failed)"
        shown = {k: v for k, v in o.run.overrides.items() if k not in ("run.name", "run.seed")}
        text = " ".join(f"{k}={format_value(v)}" for k, v in shown.items())
        rows.append((str(i), o.run.run_id, o.run.variant, str(o.run.seed), o.status, action, text))
    header = ("#", "run id", "variant", "seed", "state", "action", "overrides")
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header) - 1)]
    print(f"sweep {spec.name}: {len(outcomes)} runs, {len(todo)} to run, into {spec.sweep_dir} "
          f"(executor {spec.executor.name})")
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
