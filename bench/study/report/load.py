"""Read run records under a results directory into two pandas tables.

`load_results("results/quickstart")` finds every run directory (one holding config.yaml
or summary.json; folders named `_*` or `.*`, such as a sweep's `_retired/`, are skipped),
reads its files (defensively: bench/study/report/read.py) and returns `Results(runs, steps,
warnings)`. A symbolic link to a directory is not followed: `warnings` names it and its
target (and so does the error when no run is found):

- `runs`: one row per run. Identity (run_id = the run directory relative to results_dir,
  config_hash, sweep, variant, label, group, seed, strategy), `status` (ok, failed,
  diverged, or partial for a run killed midway: config.yaml without summary.json, or
  summary status running), summary totals, `proj.PROFILE.KEY` projected columns, and
  `eval.TASK/METRIC` columns (and `eval_n.TASK`, the items scored, from eval.json),
  `val_set` and `implied_val_set` (below), and how its compute was clocked:
  `compute_clock`, `ranks_per_core` and its source (bench/study/report/contention.py; records
  without them read as `wall`, ranks per core from env.json or unknown).
  Config columns: `optim.name`, `optim.delay`, `optim.delay_correction`, `schedule`
  (strategy.schedule) with the defaults of older records (adamw, 0, none), and `delay_ref`
  (the config minus seed and delay settings: runs that differ only by delay share it).
- `steps`: one row per logged metrics row (training rows carry `loss`, validation rows
  `val_loss`), tagged with the run's identity columns; the harness's cumulative
  `projected_elapsed_s: {profile: s}` becomes one `proj_elapsed.PROFILE` column each.
  An ok run's rows past the steps its summary.json records (appended after it ended) are
  left out, and they and its non-finite losses are warned of.

Runs are grouped for comparison by their config minus the seed: the `label` a sweep
recorded in sweep.json (variant name plus grid point), else the run name.

Validation sets (`val_set` column; `implied_val_set`: what the run's config asks for, in
words). Validation losses compare only between runs scored on the same validation set,
so every run carries the name of its set and the report splits the runs by it
(`by_validation_set`) before anything compares them:
- a record with summary.json `val_set` (bench/run/summary.py): "ID (N x L tokens)", ID the
  hash of the tokens scored;
- a run of this code that ended before writing one (killed, failed at start-up; its
  config has run.val_sequences): its group's recorded set, else the set recorded by the
  runs whose configs ask for the same one (same corpus, tokenizer, val_fraction, seq_len
  and val_sequences), when that names exactly one; else "not recorded (the run ended
  before recording it): ..." (so a failed seed still counts in its group's tallies);
- a record from before run.val_sequences: "not recorded (before run.val_sequences): the
  first B x b windows of ...", the set its config implies (val_batches x batch_size
  windows from the start of the split), so such records compare with each other only
  where that set is the same, and never with a recorded one (whose id is a hash);
- no config.yaml either: a set of its own, compared with nothing.
A group whose runs name several sets is split into one group per set, its label suffixed
with the set.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from bench.config import NON_IDENTITY_KEYS, without_keys
from bench.run import files, records
from bench.study.report import contention
from bench.study.report.read import (
    checked_rows,
    checked_summary,
    eval_samples,
    flatten_eval,
    is_number,
    read_config,
    read_json_or_none,
    read_metrics,
    rows_of_ok_run,
)

IDENTITY = ["run_id", "sweep", "variant", "label", "group", "seed", "strategy", "status"]
STEP_COLUMNS = ["step", "tokens", "elapsed_s", "loss", "val_loss"]
"""A metrics row's columns every run's rows have (bench/run/summary.py train_row, val_row)."""
SUMMARY_NUMBERS = [
    "num_params", "world_size", "steps", "total_tokens", "wall_s", "throughput_tokens_per_s",
    "compute_s_total", "comm_s_total", "comm_bytes_total", "comm_bytes_per_rank",
    "comm_wire_bytes_per_rank", "comm_peak_sync_bytes", "comm_peak_sync_wire_bytes",
    "final_val_loss", "best_val_loss",
    "bubble_fraction_measured", "bubble_fraction_theory", "peak_memory_bytes",
]
MEMORY_PER_RANK = ["memory_estimate_bytes_per_rank", "peak_memory_above_start_bytes_per_rank"]
"""Per-rank lists in summary.json; a run's row holds their max, without `_per_rank`."""
# Config fields the study sections read; absent in older records: these defaults.
CONFIG_FIELDS = {"optim.name": "adamw", "optim.delay": 0, "optim.delay_correction": "none",
                 "strategy.schedule": None, "strategy.delay": None}
_DELAY_KEYS = ("run.name", "optim.delay", "optim.delay_correction", "optim.ef_lambda",
               "strategy.delay")
# Config keys that say where things go or which repetition it is: not what is compared.
_NOT_COMPARED = ("run.seed", *NON_IDENTITY_KEYS)


@dataclass
class Results:
    runs: pd.DataFrame
    steps: pd.DataFrame
    profiles: list[str]
    """Network profiles the runs were projected onto, in first-seen order."""
    sweep_targets: dict[str, float] = field(default_factory=dict)
    """target_loss set by each sweep's spec, by sweep name."""
    warnings: list[str] = field(default_factory=list)


def _update_delay(row: dict) -> int:
    """Steps by which a run's updates lag their gradients: `optim.delay` (the emulation),
    or PipeDream-2BW's own `strategy.delay` (1 unless set), as algorithms.contract
    StrategyConfig.update_delay says."""
    if row["optim.delay"]:
        return int(row["optim.delay"])
    if row["strategy"] == "pipedream-2bw":
        return 1 if row["strategy.delay"] is None else int(row["strategy.delay"])
    return 0


def find_run_dirs(results_dir: Path, warnings: list[str] | None = None) -> list[Path]:
    """Every run directory under `results_dir`: one holding config.yaml, or a summary.json
    that reads as a run's summary (a JSON object). A stray or garbage summary.json (no
    config.yaml beside it) is not a run: the runs below it are found, and `warnings` says
    so (it used to hide every run under it). A symbolic link to a directory is not
    followed (a received tree's link could point anywhere): `warnings` names each one where
    a run directory could be, with its target to give instead."""
    found = []
    for dirpath, dirnames, _ in os.walk(results_dir):
        dirnames[:] = sorted(d for d in dirnames if not _skipped(d))
        run = records.RunDir(dirpath)
        if run.config.is_file() or (run.summary.is_file() and _summary_alone(run, warnings)):
            found.append(run.path)
            dirnames[:] = []  # logs/ and checkpoints/ of a run are not runs
    if warnings is not None:
        for link in records.linked_dirs(results_dir):
            inside = Path(link).relative_to(results_dir).parts
            if any(map(_skipped, inside)) or any(run in Path(link).parents for run in found):
                continue  # where no run directory is looked for either
            warnings.append(f"{link} is a symbolic link to a directory: not read (runs are "
                            f"read only inside {str(results_dir)!r}; give its target "
                            f"{os.path.realpath(link)!r} to read the runs there)")
    return found


def _skipped(name: str) -> bool:
    """Folders no run is looked for in: `_*` (a sweep's `_retired/`) and `.*`."""
    return name.startswith(("_", "."))


def _summary_alone(run: records.RunDir, warnings: list[str] | None) -> bool:
    """Whether a summary.json without config.yaml beside it is a run's (a JSON object)."""
    try:
        summary = files.read_json(run.summary)
    except (ValueError, OSError) as err:
        summary, why = None, str(err).removeprefix(f"{run.summary}: ")
    else:
        why = f"not a JSON object: {type(summary).__name__}"
    if isinstance(summary, dict):
        return True
    if warnings is not None:
        warnings.append(f"{run.summary}: not a run's summary ({why}) and no config.yaml "
                        "beside it; looked for runs below it")
    return False


def recorded_val_set(summary: dict | None) -> str | None:
    """The name of the validation set a summary records ("ID (N x L tokens)"), else None."""
    val_set = (summary or {}).get("val_set")
    if not isinstance(val_set, dict) or not val_set.get("id"):
        return None
    return f"{val_set['id']} ({val_set.get('sequences')} x {val_set.get('seq_len')} tokens)"


def implied_val_set(config: dict) -> tuple[str, bool]:
    """The validation set a run's config asks for, in words (the defaults of its time
    where a key is absent), and whether the config predates run.val_sequences (then it
    scored the first run.val_batches x data.batch_size windows of the split)."""
    run, data, model = (config.get(k) if isinstance(config.get(k), dict) else {}
                        for k in ("run", "data", "model"))
    old = "val_sequences" not in run
    what = (f"the first {run.get('val_batches', 8)} x {data.get('batch_size', 8)} windows of"
            if old else f"{run['val_sequences']} windows spread over")
    return (f"{what} the held-out split of {data.get('corpus', 'embedded')!r} "
            f"({data.get('tokenizer', 'byte')}, val_fraction {data.get('val_fraction', 0.05)}, "
            f"seq_len {model.get('seq_len', 128)})"), old


def _val_set_columns(summary: dict | None, config: dict, run_id: str) -> dict[str, str | None]:
    """`val_set` (None: a run of this code that ended before recording it, resolved by
    `_resolve_val_sets`) and `implied_val_set`."""
    implied, old = implied_val_set(config)
    name = recorded_val_set(summary)
    if name is None and not config:
        name = f"not recorded, no config.yaml (run {run_id})"  # a set of its own
    elif name is None and old:
        name = f"not recorded (before run.val_sequences): {implied}"
    return {"val_set": name, "implied_val_set": implied}


def _resolve_val_sets(runs: pd.DataFrame) -> None:
    """Name the set of each run of this code that ended before recording it: its group's
    recorded set, else the one recorded by the runs whose configs ask for the same set
    (when either names exactly one). Then split a group whose runs name several sets
    into one group per set."""
    recorded = runs.dropna(subset=["val_set"])
    by_group = recorded.groupby("group")["val_set"].unique()
    by_implied = recorded.groupby("implied_val_set")["val_set"].unique()
    for i in runs.index[runs["val_set"].isna()]:
        implied = runs.at[i, "implied_val_set"]
        names = by_group.get(runs.at[i, "group"], [])
        names = names if len(names) else by_implied.get(implied, [])
        runs.at[i, "val_set"] = (names[0] if len(names) == 1 else
                                 f"not recorded (the run ended before recording it): {implied}")
    for group, part in runs.groupby("group", sort=False):
        names = list(dict.fromkeys(part["val_set"]))
        for k, name in enumerate(names if len(names) > 1 else [], 1):
            mine = part.index[part["val_set"] == name]
            tag = f"set {k}" if name.startswith("not recorded") else name.split(" ")[0]
            runs.loc[mine, "group"] = f"{group} @ val {name}"
            runs.loc[mine, "label"] = [f"{label} [val {tag}]"
                                       for label in part.loc[mine, "label"]]


def by_validation_set(res: Results) -> list[tuple[str, Results]]:
    """The results split by validation set, in first-seen order: (set name, its runs and
    their steps). Whatever compares validation losses takes one part at a time."""
    parts = []
    for name in dict.fromkeys(res.runs["val_set"]):
        runs = res.runs[res.runs["val_set"] == name].reset_index(drop=True)
        steps = (res.steps[res.steps["run_id"].isin(runs["run_id"])]
                 if len(res.steps) and "run_id" in res.steps else res.steps)
        parts.append((name, Results(runs=runs, steps=steps, profiles=res.profiles,
                                    sweep_targets=res.sweep_targets, warnings=res.warnings)))
    return parts


def _compared_config_key(config: dict, extra: tuple[str, ...] = ()) -> str:
    data = without_keys(json.loads(json.dumps(config, default=str)), (*_NOT_COMPARED, *extra))
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


def _nearest_sweep(run_dir: Path, root: Path, cache: dict, warnings: list[str]) -> dict | None:
    for parent in [run_dir.parent, *run_dir.parent.parents]:
        if parent not in cache:
            cache[parent] = read_json_or_none(parent / "sweep.json", warnings)
        if cache[parent] is not None:
            return cache[parent]
        if parent == root or root not in parent.parents:
            return None
    return None


def load_results(results_dir: str | os.PathLike) -> Results:
    root = Path(results_dir)
    if not root.is_dir():
        raise ValueError(f"results directory not found: {str(root)!r}")
    warnings: list[str] = []
    run_dirs = find_run_dirs(root, warnings)
    if not run_dirs:  # what was passed over says why, e.g. a run directory that is a link
        raise ValueError(f"no run records under {str(root)!r} (a run directory holds "
                         "config.yaml and summary.json; run `commbench run` or `commbench sweep`)"
                         + "".join(f"\n- {w}" for w in warnings))
    sweeps: dict[Path, Any] = {}
    sweep_targets: dict[str, float] = {}
    profiles: list[str] = []
    run_rows, step_rows = [], []
    for run_dir in run_dirs:
        run = records.RunDir(run_dir)
        config = read_config(run.config, warnings)
        summary = checked_summary(read_json_or_none(run.summary, warnings), run.summary, warnings)
        raw_rows = read_metrics(run.metrics, warnings)
        metrics = checked_rows(raw_rows, run.metrics, warnings)
        run_cfg = config.get("run", {}) if isinstance(config.get("run"), dict) else {}
        match = re.search(r"([0-9a-f]{12})$", run_dir.name)
        config_hash = (summary or {}).get("config_hash") or (match.group(1) if match else None)

        sweep = _nearest_sweep(run_dir, root, sweeps, warnings)
        entry = None
        if sweep:
            entries = sweep.get("runs", {})
            entry = entries.get(config_hash) or next(
                (e for e in entries.values() if e.get("dir") == run_dir.name), None)
            if sweep.get("target_loss") is not None:
                sweep_targets[sweep.get("name", "")] = float(sweep["target_loss"])
        run_name = (summary or {}).get("run_name") or run_cfg.get("name") or run_dir.name
        strategy = (summary or {}).get("strategy") or (config.get("strategy") or {}).get("name")
        row: dict[str, Any] = {
            "run_id": str(run_dir.relative_to(root)) if run_dir != root else run_dir.name,
            "sweep": sweep.get("name", "") if sweep else "",
            "variant": entry["variant"] if entry else run_name,
            "label": entry["label"] if entry else run_name,
            "group": (f"{sweep.get('name', '')}/{entry['label']}" if entry
                      else f"{run_name}#{_compared_config_key(config)}"),
            "point": json.dumps(entry.get("point", {}), sort_keys=True) if entry else "{}",
            "seed": run_cfg.get("seed", (entry or {}).get("seed")),
            "strategy": strategy or "unknown",
            "status": records.status_of(summary),
            "config_hash": config_hash,
            "error": (summary or {}).get("error") or (summary or {}).get("eval_error"),
            "steps_planned": run_cfg.get("steps"),
        }
        row.update(_val_set_columns(summary, config, row["run_id"]))
        for key, default in CONFIG_FIELDS.items():
            section, name = key.split(".")
            value = (config.get(section) or {}).get(name) if isinstance(
                config.get(section), dict) else None
            row["schedule" if key == "strategy.schedule" else key] = (
                default if value is None else value)
        row["update_delay"] = _update_delay(row)
        row["delay_ref"] = f"{row['sweep']}#{_compared_config_key(config, _DELAY_KEYS)}"
        row.update(contention.run_columns(summary, config, read_json_or_none(run.env, warnings)))
        row["projection_model"] = (summary or {}).get(
            "projection_model", "naive formulas, no overlap (record without projection_model)")
        network = config.get("network") if isinstance(config.get("network"), dict) else {}
        emulated, links = network.get("emulate"), network.get("links")
        row["links"] = (f"sleep-based emulation of {emulated}" if emulated
                        else str(links) if links else "this machine's own links")
        for key in SUMMARY_NUMBERS:
            value = (summary or {}).get(key)
            row[key] = float(value) if is_number(value) else math.nan
        series = (summary or {}).get("comm_bytes_series")
        row["comm_bytes_series"] = series if isinstance(series, list) else None
        for key in MEMORY_PER_RANK:
            values = (summary or {}).get(key)
            row[key.removesuffix("_per_rank")] = (
                float(max(values)) if isinstance(values, list) and values else math.nan)
        if row["status"] == "ok":
            metrics = rows_of_ok_run(raw_rows, metrics, summary, run.metrics, warnings)
        train = [m for m in metrics if "loss" in m]
        row["steps_done"] = max((m.get("step", 0) for m in metrics), default=0)
        if math.isnan(row["total_tokens"]) and metrics:
            row["total_tokens"] = float(max(m.get("tokens", 0) for m in metrics))
        row["last_train_loss"] = float(train[-1]["loss"]) if train else math.nan
        for profile, values in ((summary or {}).get("projected") or {}).items():
            if profile not in profiles:
                profiles.append(profile)
            for key, value in (values or {}).items():
                if is_number(value):
                    row[f"proj.{profile}.{key}"] = float(value)
        eval_json = read_json_or_none(run.eval, warnings)
        evals = flatten_eval((summary or {}).get("eval")) or flatten_eval(eval_json)
        for key, value in evals.items():
            row[f"eval.{key}"] = value
        for task, samples in eval_samples(eval_json).items():
            row[f"eval_n.{task}"] = samples
        run_rows.append(row)
        for m in metrics:
            m = dict(m)
            clock = m.pop("projected_elapsed_s", None)
            for profile, seconds in (clock.items() if isinstance(clock, dict) else ()):
                if is_number(seconds):
                    m[f"proj_elapsed.{profile}"] = float(seconds)
                    if profile not in profiles:
                        profiles.append(profile)
            step_rows.append({**{k: row[k] for k in IDENTITY}, **m})

    runs = pd.DataFrame(run_rows)
    _resolve_val_sets(runs)
    # The same label from two sweeps, or two unrelated runs with one name: keep them apart.
    labels = runs.groupby("label")["group"].nunique()
    clash = runs["label"].isin(labels[labels > 1].index)
    runs.loc[clash, "label"] = [
        f"{s}/{lab}" if s else f"{lab}#{g.rsplit('#', 1)[-1]}"
        for s, lab, g in zip(runs.loc[clash, "sweep"], runs.loc[clash, "label"],
                             runs.loc[clash, "group"], strict=True)
    ]
    # no metrics row at all (every run failed before its first): the columns readers expect
    steps = pd.DataFrame(step_rows, columns=None if step_rows else [*IDENTITY, *STEP_COLUMNS])
    if len(steps):
        for column in ("label", "group"):
            steps[column] = steps["run_id"].map(dict(zip(runs["run_id"], runs[column],
                                                         strict=True)))
    runs["_baseline_first"] = runs["strategy"] != "ddp"
    runs = runs.sort_values(["sweep", "_baseline_first", "label", "seed", "run_id"],
                            kind="stable").drop(columns="_baseline_first").reset_index(drop=True)
    return Results(runs=runs, steps=steps, profiles=profiles, sweep_targets=sweep_targets,
                   warnings=warnings)
