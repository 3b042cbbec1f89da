"""Sweeps: a YAML spec expands into runs, each trained once, resumable, then reported.

    commbench sweep configs/quickstart.yaml --dry-run     # list the runs, launch nothing
    commbench sweep configs/quickstart.yaml               # run the missing ones, then report

A spec names a base run config and what varies around it:

    name: h-sweep                  # the sweep directory is OUTPUT_DIR/NAME (default: file stem)
    base: ../ddp-tiny.yaml         # run config, relative to this file; or an inline mapping
    set: {run.steps: 200}          # dotted overrides applied to the base for every run
    grid:                          # cartesian product over dotted keys
      optim.lr: [1.0e-3, 3.0e-3]
    zip:                           # lists advanced together (a list of such mappings allowed)
      data.batch_size: [8, 16]
      optim.warmup_steps: [10, 20]
    seeds: [0, 1, 2]               # run.seed values (default: the base's seed)
    variants:                      # named algorithms; run.name is set to the variant name
      ddp: {strategy.name: ddp}
      diloco-H10: {strategy.name: diloco, strategy.inner_steps: 10}
    target_loss: 3.2               # for the report (default: DDP's final validation loss)
    output_dir: results            # relative to the working directory
    report_dir: reports/h-sweep    # default reports/NAME
    executor: {name: local, max_parallel: 1}

Runs = seeds x grid x zip x variants. Each key is set in one place only (set, one grid axis,
one zip group, the variants, or seeds). When a run's `strategy.name` differs from the
base's, the base's other `strategy.*` knobs are dropped: they belong to another algorithm.

Identity and resume. A run's id is `config_hash` of its resolved config; its record is
OUTPUT_DIR/NAME/RUN_NAME-ID/ (RUN_NAME = the variant name). Re-running a sweep skips runs
recorded ok or diverged (a diverged run is a result, not an accident), keeps failed runs
with their error unless `--retry-failed`, and re-runs partial ones (killed or Ctrl-C). A record
that is re-run is moved to NAME/_retired/ first, never deleted. One failing run never
stops the sweep. One sweep process at a time per sweep directory (NAME/.sweep.lock).
NAME/sweep.json maps each run id to its variant, seed and grid point; the report reads
it. Renaming a variant changes run.name, hence the id: that run is trained again.

Executors (`local`, or `slurm` through submitit) train the runs: see bench/executors.py.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import itertools
import json
import os
import re
import shutil
import socket
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench import records
from bench.config import Config, config_hash, from_dict, load_raw, set_value
from bench.executors import (
    Runner,
    _Progress,
    _run_local,
    _run_slurm,
    _slurm_executor,
    _still_active_slurm_jobs,
)

SPEC_KEYS = ("name", "description", "base", "set", "grid", "zip", "seeds", "variants",
             "target_loss", "output_dir", "report_dir", "executor")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class ExecutorSpec:
    name: str = "local"
    """local (this machine) or slurm (submitit)."""
    max_parallel: int | None = None
    """local: runs at once (default 1); slurm: array jobs running at once (default unlimited)."""
    cluster: str = "slurm"
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
    setup: list = field(default_factory=list)
    """Shell lines run in the job before the run starts (module load, venv activation)."""


@dataclass
class SweepRun:
    """One run of a sweep: its resolved config and where it came from."""

    run_id: str
    """config_hash of the resolved config: the identity resume keys on."""
    variant: str
    seed: int
    point: dict[str, Any]
    """The grid and zip values of this run (dotted key -> value)."""
    overrides: dict[str, Any]
    """Every dotted override applied to the base (set, point, variant, seed)."""
    label: str
    """Variant name plus the grid point: the comparison group shown by the report."""
    config: Config

    @property
    def dir_name(self) -> str:
        return f"{self.config.run.name}-{self.run_id}"


@dataclass
class SweepSpec:
    name: str
    path: Path
    base: dict
    """The raw base config (file contents or the inline mapping)."""
    set: dict[str, Any]
    grid: dict[str, list]
    zip: list[dict[str, list]]
    seeds: list[int] | None
    variants: dict[str, dict[str, Any]]
    target_loss: float | None
    output_dir: Path
    report_dir: Path
    executor: ExecutorSpec
    description: str = ""
    runs: list[SweepRun] = field(default_factory=list)

    @property
    def sweep_dir(self) -> Path:
        return self.output_dir / self.name


@dataclass
class RunOutcome:
    run: SweepRun
    run_dir: Path
    status: str
    """ok, failed, diverged, partial (killed), or new (dry run: not started)."""
    launched: bool
    """Whether this invocation trained it (False: skipped, already recorded)."""
    error: str | None = None


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


# ------------------------------------------------------------------------------ spec


def _check_key(key: Any, where: str) -> str:
    if not isinstance(key, str) or not all(p.strip() for p in key.split(".")):
        raise ValueError(f"{where}: keys must be dotted config paths like run.steps, got {key!r}")
    return ".".join(p.strip() for p in key.split("."))


def _dotted_mapping(data: Any, where: str) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping of dotted keys to values, got {data!r}")
    return {_check_key(k, where): v for k, v in data.items()}


def _axes(data: Any, where: str) -> dict[str, list]:
    axes = _dotted_mapping(data, where)
    if not axes:
        raise ValueError(f"{where} is empty: give at least one axis (key: [values]) or remove it")
    for key, values in axes.items():
        if not isinstance(values, list):
            raise ValueError(f"{where}.{key} must be a list of values, got {values!r}")
        if not values:
            raise ValueError(f"{where}.{key} has no values: give at least one")
    return axes


def _unknown_key(key: Any, valid, where: str) -> ValueError:
    hint = difflib.get_close_matches(str(key), list(valid), n=1)
    maybe = f" (did you mean {hint[0]!r}?)" if hint else ""
    return ValueError(f"unknown key {where}{key!r}{maybe}; valid keys: {list(valid)}")


def _type_ok(value: Any, tp: Any) -> bool:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_type_ok(value, t) for t in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        tp = (int, float)
    return isinstance(value, tp) and (tp is bool or not isinstance(value, bool))


def _parse_executor(data: Any) -> ExecutorSpec:
    if data is None:
        return ExecutorSpec()
    if isinstance(data, str):
        data = {"name": data}
    if not isinstance(data, dict):
        raise ValueError(f"executor must be a mapping (e.g. {{name: local}}), got {data!r}")
    hints = typing.get_type_hints(ExecutorSpec)
    for key, value in data.items():
        if key not in hints:
            raise _unknown_key(key, hints, "executor.")
        if not _type_ok(value, hints[key]):
            raise ValueError(f"executor.{key} must be of type {hints[key]}, got {value!r}")
    spec = ExecutorSpec(**data)
    _check_executor(spec)
    return spec


def _check_executor(spec: ExecutorSpec) -> None:
    if spec.name not in ("local", "slurm"):
        raise ValueError(f"executor.name must be 'local' or 'slurm', got {spec.name!r}")
    if spec.cluster not in ("slurm", "local"):
        raise ValueError(f"executor.cluster must be 'slurm' or 'local', got {spec.cluster!r}")
    if spec.max_parallel is not None and spec.max_parallel < 1:
        raise ValueError(f"executor.max_parallel must be >= 1, got {spec.max_parallel}")
    if spec.poll_s <= 0:
        raise ValueError(f"executor.poll_s must be > 0, got {spec.poll_s}")


def load_spec(path: str | os.PathLike) -> SweepSpec:
    """Read and check a sweep spec, and resolve every run's config (nothing is launched).

    Raises ValueError naming the spec, the key and what is valid: unknown keys, empty or
    malformed axes, a key set in two places, zip lists of different lengths, a base config
    that does not exist, or a run whose config is invalid (unknown strategy, bad value).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"sweep spec not found: {str(path)!r}")
    raw = load_raw(path)
    try:
        return _parse_spec(raw, path)
    except ValueError as err:
        raise ValueError(f"sweep spec {str(path)!r}: {err}") from None


def _parse_spec(raw: dict, path: Path) -> SweepSpec:
    for key in raw:
        if key not in SPEC_KEYS:
            raise _unknown_key(key, SPEC_KEYS, "")
    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"name must be letters, digits, '.', '_' or '-', got {name!r}")

    base = raw.get("base")
    if base is None:
        base_data = {}
    elif isinstance(base, str):
        base_path = path.parent / base
        if not base_path.is_file():
            raise ValueError(f"base config {base!r} not found (looked for {str(base_path)!r}; "
                             "a path is relative to the spec's folder)")
        base_data = load_raw(base_path)
    elif isinstance(base, dict):
        base_data = copy.deepcopy(base)
    else:
        raise ValueError(f"base must be a config path or an inline mapping, got {base!r}")

    common = _dotted_mapping(raw.get("set"), "set")
    grid = _axes(raw["grid"], "grid") if "grid" in raw else {}
    zip_raw = raw.get("zip")
    zip_groups = []
    if zip_raw is not None:
        groups = zip_raw if isinstance(zip_raw, list) else [zip_raw]
        if not groups:
            raise ValueError("zip is empty: give a mapping of key: [values] or remove it")
        for i, group in enumerate(groups):
            where = "zip" if len(groups) == 1 and not isinstance(zip_raw, list) else f"zip[{i}]"
            axes = _axes(group, where)
            lengths = {k: len(v) for k, v in axes.items()}
            if len(set(lengths.values())) > 1:
                raise ValueError(f"{where}: lists advanced together must have the same length, "
                                 f"got {lengths}")
            zip_groups.append(axes)

    seeds = raw.get("seeds")
    if seeds is not None:
        if (not isinstance(seeds, list) or not seeds
                or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
            raise ValueError(f"seeds must be a non-empty list of integers, got {seeds!r}")
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds has duplicates: {seeds}")

    variants_raw = raw.get("variants")
    if variants_raw is None:
        variants = {}
    elif not isinstance(variants_raw, dict) or not variants_raw:
        raise ValueError("variants must be a non-empty mapping of name -> dotted overrides, "
                         f"got {variants_raw!r}")
    else:
        variants = {}
        for vname, overrides in variants_raw.items():
            if not isinstance(vname, str) or not _NAME_RE.match(vname):
                raise ValueError(f"variant name must be letters, digits, '.', '_' or '-' "
                                 f"(it names directories), got {vname!r}")
            variants[vname] = _dotted_mapping(overrides, f"variants.{vname}")

    _check_axes_disjoint(common, grid, zip_groups, variants, seeds)

    target = raw.get("target_loss")
    if target is not None and (isinstance(target, bool) or not isinstance(target, int | float)):
        raise ValueError(f"target_loss must be a number, got {target!r}")
    output_dir = raw.get("output_dir", "results")
    report_dir = raw.get("report_dir", str(Path("reports") / name))
    for key, value in (("output_dir", output_dir), ("report_dir", report_dir)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{key} must be a directory path, got {value!r}")
    description = raw.get("description", "")
    spec = SweepSpec(
        name=name, path=path, base=base_data, set=common, grid=grid, zip=zip_groups,
        seeds=seeds, variants=variants,
        target_loss=float(target) if target is not None else None,
        output_dir=Path(output_dir), report_dir=Path(report_dir),
        executor=_parse_executor(raw.get("executor")),
        description=str(description or ""),
    )
    spec.runs = expand(spec)
    return spec


def _check_axes_disjoint(common, grid, zip_groups, variants, seeds) -> None:
    """A key set in two places is ambiguous: say which places."""
    sources: list[tuple[str, str]] = [(k, "set") for k in common]
    sources += [(k, "grid") for k in grid]
    for i, group in enumerate(zip_groups):
        sources += [(k, f"zip[{i}]" if len(zip_groups) > 1 else "zip") for k in group]
    variant_keys = {k for overrides in variants.values() for k in overrides}
    sources += [(k, "variants") for k in sorted(variant_keys)]
    if seeds is not None:
        sources.append(("run.seed", "seeds"))
    for (k1, s1), (k2, s2) in itertools.combinations(sources, 2):
        if k1 == k2 or k1.startswith(k2 + ".") or k2.startswith(k1 + "."):
            same = f"{k1!r}" if k1 == k2 else f"{k1!r} and {k2!r}"
            raise ValueError(f"{same} is set twice: in {s1} and in {s2}; set each key in one place")


def _points(spec: SweepSpec) -> list[dict[str, Any]]:
    """Grid points: the cartesian product of the grid axes and the zip groups."""
    factors: list[list[dict[str, Any]]] = [
        [{key: value} for value in values] for key, values in spec.grid.items()
    ]
    for group in spec.zip:
        keys = list(group)
        rows = zip(*group.values(), strict=True)
        factors.append([dict(zip(keys, vals, strict=True)) for vals in rows])
    points = []
    for combo in itertools.product(*factors):
        point: dict[str, Any] = {}
        for part in combo:
            point.update(part)
        points.append(point)
    return points


def _short_keys(keys: list[str]) -> dict[str, str]:
    """Last component of each dotted key, or the full key where the short ones collide."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: s if last.count(s) == 1 else k for k, s in zip(keys, last, strict=True)}


def _format_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, list | dict) else str(value)


def expand(spec: SweepSpec) -> list[SweepRun]:
    """Every run of the spec, seeds outermost so that a partial sweep is comparable early."""
    base_strategy = spec.set.get("strategy.name",
                                 (spec.base.get("strategy") or {}).get("name", "ddp"))
    variants = spec.variants or {None: {}}
    seeds = spec.seeds if spec.seeds is not None else [None]
    points = _points(spec)
    short = _short_keys(list(spec.grid) + [k for g in spec.zip for k in g])
    runs: list[SweepRun] = []
    seen: dict[str, str] = {}
    for seed in seeds:
        for point in points:
            for vname, voverrides in variants.items():
                data = copy.deepcopy(spec.base)
                changes = {**point, **voverrides}
                if (changes.get("strategy.name", base_strategy) != base_strategy
                        and isinstance(data.get("strategy"), dict)):
                    data["strategy"] = {}  # the base's knobs belong to another algorithm
                overrides = {**spec.set, **({"run.name": vname} if vname is not None else {}),
                             **changes, **({"run.seed": seed} if seed is not None else {})}
                for key, value in overrides.items():
                    set_value(data, key, value)
                set_value(data, "run.output_dir", str(spec.sweep_dir))
                where = _describe(vname, point, seed)
                try:
                    cfg = from_dict(data)
                except ValueError as err:
                    raise ValueError(f"run {where}: {err}") from None
                run_id = config_hash(cfg)
                if run_id in seen:
                    raise ValueError(f"runs {seen[run_id]} and {where} resolve to the same "
                                     f"config ({run_id}); make the variants differ")
                seen[run_id] = where
                name = vname if vname is not None else cfg.run.name
                suffix = " ".join(f"{short[k]}={_format_value(v)}" for k, v in point.items())
                runs.append(SweepRun(
                    run_id=run_id, variant=name, seed=cfg.run.seed, point=point,
                    overrides=overrides, label=f"{name} {suffix}".strip(), config=cfg,
                ))
    return runs


def _describe(variant: str | None, point: dict, seed: int | None) -> str:
    parts = [f"variant {variant!r}"] if variant is not None else []
    parts += [f"{k}={_format_value(v)}" for k, v in point.items()]
    if seed is not None:
        parts.append(f"seed {seed}")
    return "(" + ", ".join(parts) + ")" if parts else "(base)"


# ---------------------------------------------------------------------------- records


def run_status(run_dir: Path) -> str:
    """records.status_of the run's summary.json (partial if torn), or new if absent."""
    if not (run_dir / "config.yaml").exists() and not (run_dir / "summary.json").exists():
        return "new"
    try:
        summary = records.read_summary(run_dir)
    except ValueError:
        return "partial"  # a torn summary: the run was killed while writing it
    return records.status_of(summary)


def find_run_dir(sweep_dir: Path, run: SweepRun) -> Path:
    """The run's record, keyed on the hash (any NAME-HASH directory), else the new path."""
    expected = sweep_dir / run.dir_name
    if expected.exists():
        return expected
    matches = sorted(p for p in sweep_dir.glob(f"*{run.run_id}")
                     if p.is_dir() and (p.name == run.run_id or p.name.endswith("-" + run.run_id)))
    return matches[0] if matches else expected


def retire(run_dir: Path, sweep_dir: Path) -> Path:
    """Move a record aside to SWEEP/_retired/NAME.N (never deleted)."""
    retired = sweep_dir / "_retired"
    retired.mkdir(parents=True, exist_ok=True)
    n = 1
    while (retired / f"{run_dir.name}.{n}").exists():
        n += 1
    dest = retired / f"{run_dir.name}.{n}"
    shutil.move(str(run_dir), str(dest))
    return dest


@contextlib.contextmanager
def _sweep_lock(sweep_dir: Path):
    """One sweep process per sweep directory: a second one would retire the first's runs."""
    path = sweep_dir / ".sweep.lock"
    me = f"{socket.gethostname()} {os.getpid()}"
    try:
        host, pid = path.read_text().split()
    except (OSError, ValueError):
        host, pid = None, "0"
    if host is not None and (host != socket.gethostname() or _alive(int(pid))):
        raise ValueError(f"sweep directory {str(sweep_dir)!r} is in use by process {pid} on "
                         f"{host} (another `commbench sweep` of this spec). Wait for it, or "
                         f"delete {path} if that process is gone.")
    records.write_text(path, me)
    try:
        yield
    finally:
        if path.exists() and path.read_text() == me:
            path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_sweep_json(spec: SweepSpec, run_dirs: dict[str, Path]) -> None:
    path = spec.sweep_dir / "sweep.json"
    old = records.read_json(path) if path.exists() else {}
    entries = dict(old.get("runs", {}))
    for run in spec.runs:
        entries[run.run_id] = {
            "dir": run_dirs[run.run_id].name, "variant": run.variant, "seed": run.seed,
            "label": run.label, "point": run.point, "overrides": run.overrides,
            "strategy": run.config.strategy.name,
        }
    records.write_json(path, {
        "name": spec.name,
        "spec": str(spec.path),
        "description": spec.description,
        "target_loss": spec.target_loss,
        "axes": {"grid": list(spec.grid), "zip": [list(g) for g in spec.zip],
                 "seeds": spec.seeds, "variants": list(spec.variants)},
        "runs": entries,
    })


# --------------------------------------------------------------------------- execution


def _launch(spec: SweepSpec, outcomes: list[RunOutcome], todo: list[tuple[SweepRun, Path]],
            runner: Runner | None) -> None:
    """Move old records of the runs to redo aside, train them, update `outcomes`."""
    sweep_dir = spec.sweep_dir
    active, slurm = {}, None
    if spec.executor.name == "slurm" and todo:
        slurm = _slurm_executor(spec, sweep_dir / "_slurm")  # fails here, before any change
        active = _still_active_slurm_jobs(spec, sweep_dir / "_slurm", {r.run_id for r, _ in todo})
    launch_dirs: dict[str, Path] = {}
    for run, run_dir in todo:
        if run.run_id in active:  # a job of an earlier invocation still runs: wait for it
            launch_dirs[run.run_id] = run_dir
            continue
        if run_dir.exists():
            moved = retire(run_dir, sweep_dir)
            tqdm.write(f"moved the earlier record of {run.label} seed={run.seed} to {moved}",
                       file=sys.stderr)
        launch_dirs[run.run_id] = sweep_dir / run.dir_name
    todo = [(run, launch_dirs[run.run_id]) for run, _ in todo]
    for outcome in outcomes:
        if outcome.run.run_id in launch_dirs:
            outcome.launched = True
            outcome.run_dir = launch_dirs[outcome.run.run_id]
    _write_sweep_json(spec, {o.run.run_id: o.run_dir for o in outcomes})

    progress = _Progress(spec.name, outcomes, len(todo))
    try:
        if not todo:
            summaries = {}
        elif spec.executor.name == "local":
            summaries = _run_local(todo, runner, spec.executor.max_parallel or 1, progress)
        else:
            summaries = _run_slurm(spec, slurm, todo, runner, progress, active)
    finally:
        progress.close()
    for outcome in outcomes:
        summary = summaries.get(outcome.run.run_id)
        if summary is not None:
            outcome.status = summary.get("status", "failed")
            outcome.error = summary.get("error")


def run_sweep(spec_path: str | os.PathLike, *, dry_run: bool = False, retry_failed: bool = False,
              executor: str | None = None, max_parallel: int | None = None, report: bool = True,
              runner: Runner | None = None) -> SweepResult:
    """Run the runs of a sweep that are not recorded yet, then build the report.

    `executor` ('local' or 'slurm') and `max_parallel` override the spec. `runner`
    replaces bench.launch.run_config (tests pass a fake). Prints the report path.
    """
    spec = load_spec(spec_path)
    if executor is not None:
        spec.executor.name = executor
    if max_parallel is not None:
        spec.executor.max_parallel = max_parallel
    _check_executor(spec.executor)
    sweep_dir = spec.sweep_dir

    outcomes: list[RunOutcome] = []
    todo: list[tuple[SweepRun, Path]] = []
    for run in spec.runs:
        run_dir = find_run_dir(sweep_dir, run)
        status = run_status(run_dir)
        summary = records.read_summary(run_dir) if status == "failed" else None
        outcome = RunOutcome(run, run_dir, status, launched=False,
                             error=(summary or {}).get("error"))
        outcomes.append(outcome)
        if status == "new" or status == "partial" or (status == "failed" and retry_failed):
            todo.append((run, run_dir))

    if dry_run:
        _print_plan(spec, outcomes, {r.run_id for r, _ in todo})
        return SweepResult(spec.name, sweep_dir, outcomes, dry_run=True)

    sweep_dir.mkdir(parents=True, exist_ok=True)
    with _sweep_lock(sweep_dir):
        _launch(spec, outcomes, todo, runner)

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
        text = " ".join(f"{k}={_format_value(v)}" for k, v in shown.items())
        rows.append((str(i), o.run.run_id, o.run.variant, str(o.run.seed), o.status, action, text))
    header = ("#", "run id", "variant", "seed", "state", "action", "overrides")
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header) - 1)]
    print(f"sweep {spec.name}: {len(outcomes)} runs, {len(todo)} to run, into {spec.sweep_dir} "
          f"(executor {spec.executor.name})")
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
