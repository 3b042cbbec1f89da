"""One run's record files read for the report, defensively: what is missing, torn or of
the wrong type is warned of and read as missing, never fails the report of every run.

    pytest tests/test_report.py tests/test_crash_safety.py

`read_json_or_none`, `read_config`, `read_metrics`: a file, or None / {} / its readable
rows, with a warning naming the file. `checked_summary`: summary.json with every field the
report reads of its type (`SUMMARY_TYPES`); `checked_rows`: metrics rows with an integer
step and numbers as `is_number` reads them (finite, at most `LARGEST`); `rows_of_ok_run`:
an ok run's rows without those appended after it ended. `flatten_eval`, `eval_samples`:
summary.json's or eval.json's scores as flat columns. The tables they feed:
bench/study/report/load.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.config import load_raw
from bench.run import files
from bench.run.summary import nonfinite_loss_steps


def read_metrics(path: Path, warnings: list[str]) -> list[dict]:
    """metrics.jsonl rows; a torn last line (killed run) or a corrupt one is skipped with a
    warning."""
    return [row for row in files.read_jsonl(path, skipped=warnings) if isinstance(row, dict)]


def read_json_or_none(path: Path, warnings: list[str]) -> Any:
    """A JSON record file's value; None when it is missing or unreadable (with a warning)."""
    if not path.exists():
        return None
    try:
        return files.read_json(path)
    except (ValueError, OSError) as err:
        reason = str(err).removeprefix(f"{path}: ")  # read_json's message names the file
        warnings.append(f"{path}: unreadable ({reason}); treated as missing")
        return None


def read_config(path: Path, warnings: list[str]) -> dict:
    """A config.yaml's raw mapping; {} when it is missing or unreadable (with a warning)."""
    if not path.exists():
        return {}
    try:
        return load_raw(path)
    except (ValueError, OSError) as err:
        warnings.append(str(err))  # load_raw's message names the file
        return {}


def flatten_eval(data: Any) -> dict[str, float]:
    """Flat {"task/metric": value} from summary["eval"] or an lm-eval-style eval.json."""
    if not isinstance(data, dict):
        return {}
    if isinstance(data.get("summary"), dict):
        return flatten_eval(data["summary"])
    if isinstance(data.get("results"), dict):
        data = data["results"]
    flat: dict[str, float] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            for metric, v in value.items():
                name = str(metric).split(",")[0]  # lm-eval's "acc,none" filter suffix
                if "stderr" in name or not is_number(v):
                    continue
                flat[f"{key}/{name}"] = float(v)
        elif is_number(value) and "stderr" not in str(key):
            flat[str(key)] = float(value)
    return flat


def eval_samples(data: Any) -> dict[str, float]:
    """{task: items scored} from eval.json's `tasks` (eval/runner.py `num_samples`)."""
    tasks = data.get("tasks") if isinstance(data, dict) else None
    return {str(task): float(record["num_samples"]) for task, record in
            (tasks.items() if isinstance(tasks, dict) else ())
            if isinstance(record, dict) and is_number(record.get("num_samples"))}


def is_number(value: Any) -> bool:
    """A number as a record holds one: not a bool, finite and no larger in magnitude than
    `LARGEST` (a crafted or corrupted 1e308 would overflow the statistics)."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and abs(value) <= LARGEST)


LARGEST = 1e30
"""No quantity commbench records (seconds, tokens, bytes, losses) comes near this."""
SUMMARY_TYPES = {"status": str, "run_name": str, "strategy": str, "config_hash": str,
                 "error": str, "eval_error": str, "started": str, "projected": dict,
                 "val_set": dict, "eval": dict, "compute_clock": str, "device": str}
"""summary.json fields the report reads that are not numbers, and their types."""


def checked_summary(summary: Any, path: Path, warnings: list[str]) -> dict | None:
    """summary.json with every field the report reads of the right type: a field of
    another type (a hand-edited or corrupted record) is dropped, with a warning, instead
    of failing the report of every run."""
    if summary is None:
        return None
    if not isinstance(summary, dict):
        warnings.append(f"{path}: not a JSON object ({type(summary).__name__}); treated as "
                        "missing")
        return None
    out = dict(summary)
    for key, kind in SUMMARY_TYPES.items():
        if key in out and out[key] is not None and not isinstance(out[key], kind):
            warnings.append(f"{path}: {key} is not a {kind.__name__} (got "
                            f"{out.pop(key)!r:.60}); treated as missing")
    projected = out.get("projected") or {}
    if any(not isinstance(v, dict) for v in projected.values()):
        warnings.append(f"{path}: projected holds values that are not mappings; those "
                        "profiles are treated as missing")
        out["projected"] = {k: v for k, v in projected.items() if isinstance(v, dict)}
    return out


def checked_rows(rows: list[dict], path: Path, warnings: list[str]) -> list[dict]:
    """metrics.jsonl rows with an integer step >= 0, their numbers as `is_number` reads
    them (others NaN: a non-finite loss marks a diverged run and stays NaN), other keys
    kept only when they are mappings of numbers (per-profile clocks, extra losses)."""
    out, bad = [], 0
    for row in rows:
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            bad += 1
            continue
        clean = {"step": step}
        for key, value in row.items():
            if key == "step":
                continue
            if isinstance(value, dict):
                clean[key] = {k: v for k, v in value.items() if is_number(v)}
            elif isinstance(value, int | float) and not isinstance(value, bool):
                clean[key] = float(value) if is_number(value) else math.nan
            else:
                bad += 1
        out.append(clean)
    if bad:
        warnings.append(f"{path}: {bad} rows or values are not a metrics row's (a step >= 0, "
                        "numbers); skipped")
    return out


def rows_of_ok_run(raw_rows: list[dict], rows: list[dict], summary: dict | None,
                    path: Path, warnings: list[str]) -> list[dict]:
    """The checked metrics `rows` of a run whose summary.json says ok, with a warning for
    what such a run cannot hold (rows appended after it ended were read without a word):
    a loss that is not finite (kept, read as missing like any other) and rows past the
    steps summary.json records (left out: the report uses the recorded steps, curves and
    time to target included)."""
    bad = nonfinite_loss_steps(raw_rows)
    if bad:
        warnings.append(f"{path}: loss or val_loss is not finite (NaN or Infinity) at {bad} "
                        "of a run whose summary.json status is ok: rows appended after the "
                        "run? The report reads those losses as missing and the run as ok")
    recorded = (summary or {}).get("steps")
    if not isinstance(recorded, int) or isinstance(recorded, bool) or recorded < 0:
        return rows
    past = [row["step"] for row in rows if row["step"] > recorded]
    if past:
        warnings.append(f"{path}: {len(past)} rows past the {recorded} steps summary.json "
                        f"records (steps up to {max(past)}): appended after the run? The "
                        f"report uses the {recorded} recorded steps and leaves those rows out")
    return [row for row in rows if row["step"] <= recorded]
