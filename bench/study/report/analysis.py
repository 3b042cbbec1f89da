"""The numbers of a report: time and tokens to a target loss, speedup vs a baseline.

    commbench report results/quickstart -o reports/quickstart

Time to target: the step where the validation curve first reaches the target, linearly
interpolated between the two validation points around it (a run whose first validation
is already below the target crosses there). Tokens and measured seconds at that step are
interpolated linearly in the step between the logged metrics rows around it. Projected
seconds on a network profile come from the cumulative `projected_elapsed_s` the harness
writes into every metrics row, interpolated the same way ("step-wise"); records without it
fall back to the run's projected total times the fraction of its tokens seen at the
crossing, which assumes every step costs the same ("uniform-step estimate", marked).

Only runs scored on one validation set are compared (`require_one_validation_set`; the
report splits its runs by set first, bench/study/report/load.py `by_validation_set`). Each
group (a config minus its seed) is compared with the DDP group of the same sweep and grid
point (else the only DDP group). The target is the caller's, else the sweep
spec's, else the DDP group's final validation loss (the highest over its seeds, so that
every DDP seed reaches it). Only runs with status ok can reach the target: a diverged,
failed or partial run counts as a miss. A group gets a time to target and a speedup only
when every one of its runs (and of its baseline's) reached the target; otherwise the
table says why (no survivorship: counts of misses, divergences and failures are shown).
A run already below the target at its first validation has an upper bound for a time
to target (`at_first_validation` counts them; the report warns).
Beside the mean, every group and clock gets AlgoPerf's score (bench/study/report/algoperf.py):
`median_time_to_target_s`, the median over its trials (seeds) with a miss counted as
infinite time (inf: it reached the target in half its trials or fewer), its
`reached_fraction`, and `median_speedup` = the baseline's median / the group's (NaN unless
both are finite). The speedup interval needs every trial of both groups to have reached
the target: it is never computed from the seeds that reached it alone.
Speedup = baseline time / run time, as the geometric mean over seeds with the 95%
t-interval on the log-ratios (bench/study/report/stats.py): paired by seed when both groups ran
the same seeds, else Welch's two-sample interval on the logs. Intervals from fewer than 3
seeds are flagged "n<3".
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from bench.study.report import algoperf, chance
from bench.study.report.stats import (  # noqa: F401  (t_quantile_975: re-exported)
    mean_ci,
    mean_interval,
    paired_interval,
    ratio_interval,
    t_quantile_975,
    welch_interval,
)

STEPWISE, UNIFORM = "step-wise", "uniform-step estimate"


def first_crossing(val: pd.DataFrame, target: float) -> dict[str, float]:
    """Where the validation curve first reaches `target`: step, tokens, elapsed_s (NaN: never).

    `val` has columns step, tokens, elapsed_s, val_loss (one row per validation)."""
    nan = {"step": math.nan, "tokens": math.nan, "elapsed_s": math.nan}
    if val.empty or not np.isfinite(target):
        return nan
    val = val.sort_values("step")
    loss = val["val_loss"].to_numpy(dtype=float)
    below = np.flatnonzero(loss <= target)
    if len(below) == 0:
        return nan
    i = int(below[0])
    cols = ("step", "tokens", "elapsed_s")
    at = {c: float(val[c].iloc[i]) if c in val else math.nan for c in cols}
    if i == 0:
        return at
    before = {c: float(val[c].iloc[i - 1]) if c in val else math.nan for c in cols}
    frac = (loss[i - 1] - target) / (loss[i - 1] - loss[i])
    return {c: before[c] + frac * (at[c] - before[c]) for c in cols}


def value_at_step(rows: pd.DataFrame, column: str, step: float) -> float:
    """`column` linearly interpolated in the step over the rows that carry it (NaN: none)."""
    if column not in rows or not np.isfinite(step):
        return math.nan
    part = rows[["step", column]].dropna().sort_values("step")
    if part.empty:
        return math.nan
    steps, values = part["step"].to_numpy(dtype=float), part[column].to_numpy(dtype=float)
    if step < steps[0] or step > steps[-1]:
        return math.nan
    return float(np.interp(step, steps, values))


def run_rows(steps: pd.DataFrame, run_id: str) -> pd.DataFrame:
    if steps.empty or "run_id" not in steps:
        return pd.DataFrame(columns=["step", "tokens", "elapsed_s", "val_loss"])
    return steps[steps["run_id"] == run_id]


def validation_rows(steps: pd.DataFrame, run_id: str) -> pd.DataFrame:
    rows = run_rows(steps, run_id)
    if "val_loss" not in rows:
        return pd.DataFrame(columns=["step", "tokens", "elapsed_s", "val_loss"])
    return rows[rows["val_loss"].notna()].reindex(columns=["step", "tokens", "elapsed_s",
                                                           "val_loss"])


def _baselines(groups: pd.DataFrame, is_baseline) -> dict[str, str | None]:
    """group -> the baseline group (same sweep and grid point, else same sweep, else unique)."""
    base = groups[[bool(is_baseline(row)) for _, row in groups.iterrows()]]
    chosen: dict[str, str | None] = {}
    for group, row in groups.iterrows():
        same_point = base[(base["sweep"] == row["sweep"]) & (base["point"] == row["point"])]
        same_sweep = base[base["sweep"] == row["sweep"]]
        for candidates in (same_point, same_sweep, base):
            if len(candidates) == 1:
                chosen[group] = candidates.index[0]
                break
        else:
            chosen[group] = None
    return chosen


def run_times_to_target(runs: pd.DataFrame, steps: pd.DataFrame, target: float,
                        profiles: list[str]) -> pd.DataFrame:
    """Per run: tokens_to_target, time_to_target.CLOCK and projection.PROFILE (the method).

    Only runs with status ok can reach the target (others get NaN)."""
    rows = []
    for _, run in runs.iterrows():
        mine = run_rows(steps, run["run_id"])
        cross = first_crossing(validation_rows(steps, run["run_id"]), target)
        if run["status"] != "ok":
            cross = {k: math.nan for k in cross}
        val = validation_rows(steps, run["run_id"])
        # below the target at its first validation: the crossing is at or before that point
        first_val = bool(np.isfinite(cross["step"]) and len(val)
                         and cross["step"] == val["step"].min())
        step = cross["step"]
        tokens = value_at_step(mine, "tokens", step)
        elapsed = value_at_step(mine, "elapsed_s", step)
        row = {"run_id": run["run_id"], "seed": run["seed"], "status": run["status"],
               "final_val_loss": run["final_val_loss"], "at_first_validation": first_val,
               "tokens_to_target": tokens if np.isfinite(tokens) else cross["tokens"],
               "time_to_target.measured": elapsed if np.isfinite(elapsed)
               else cross["elapsed_s"]}
        fraction = (row["tokens_to_target"] / run["total_tokens"] if run["total_tokens"]
                    else math.nan)
        for profile in profiles:
            column = f"proj_elapsed.{profile}"
            if column in mine and mine[column].notna().any():
                row[f"time_to_target.{profile}"] = value_at_step(mine, column, step)
                row[f"projection.{profile}"] = STEPWISE
            else:
                row[f"time_to_target.{profile}"] = fraction * run.get(
                    f"proj.{profile}.total_s", math.nan)
                row[f"projection.{profile}"] = UNIFORM
        rows.append(row)
    return pd.DataFrame(rows)


def _by_seed(times: pd.DataFrame, column: str) -> dict:
    """seed -> value; keyed by run id when seeds repeat (then nothing pairs)."""
    key = "seed" if times["seed"].is_unique else "run_id"
    return dict(zip(times[key], times[column], strict=True))


def _counts(times: pd.DataFrame) -> dict:
    status = times["status"].value_counts()
    reached = int(times["tokens_to_target"].notna().sum())
    ok = int(status.get("ok", 0))
    return {"runs": len(times), "ok": ok, "reached": reached, "did_not_reach": ok - reached,
            "diverged": int(status.get("diverged", 0)), "failed": int(status.get("failed", 0)),
            "partial": int(status.get("partial", 0)),
            "at_first_validation": int(times["at_first_validation"].sum())}


def miss_reason(counts: dict) -> str:
    """Why a group has no time to target ("" when every run reached it)."""
    parts = []
    if counts["did_not_reach"]:
        parts.append(f"{counts['did_not_reach']} of {counts['runs']} seeds did not reach")
    parts += [f"{counts[k]} {k}" for k in ("diverged", "failed", "partial") if counts[k]]
    return ", ".join(parts)


def _target(info, base_ok: pd.DataFrame, target_loss, sweep_targets,
            baseline_name: str) -> tuple[float, str]:
    if target_loss is not None:
        return float(target_loss), "given"
    if info["sweep"] in sweep_targets:
        return sweep_targets[info["sweep"]], "sweep spec"
    if base_ok.empty:
        return math.nan, "no ok baseline run"
    # the worst baseline seed's final loss: every baseline seed reaches it
    return (float(base_ok["final_val_loss"].max()),
            f"{baseline_name} final val loss (highest over seeds)")


SPEED_COLS = ["sweep", "label", "variant", "strategy", "baseline", "target_loss",
              "target_source", "clock", "runs", "ok", "reached", "did_not_reach",
              "diverged", "failed", "partial", "at_first_validation", "misses", "reason",
              "projection", "time_to_target_s", "time_to_target_ci",
              "baseline_time_to_target_s", "speedup", "speedup_low", "speedup_high",
              "speedup_n", "speedup_method", "flag", "reached_fraction",
              "median_time_to_target_s", "baseline_median_time_to_target_s",
              "median_speedup"]
CONV_COLS = ["sweep", "label", "strategy", "baseline", "target_loss", "target_source",
             "runs", "ok", "reached", "did_not_reach", "diverged", "failed", "partial",
             "misses", "reason", "tokens_to_target", "tokens_to_target_ci",
             "baseline_tokens_to_target",
             "token_ratio", "token_ratio_low", "token_ratio_high", "final_val_loss",
             "final_val_loss_ci", "final_val_loss_n", "val_loss_diff", "val_loss_diff_ci",
             "val_loss_diff_n", "flag"]


def require_one_validation_set(runs: pd.DataFrame) -> None:
    """Fail unless every run was scored on the same validation set (column `val_set`):
    validation losses of different sets do not compare, whatever the caller wants."""
    sets = list(dict.fromkeys(runs["val_set"])) if "val_set" in runs else []
    if len(sets) > 1:
        raise ValueError(f"runs scored on {len(sets)} validation sets ({'; '.join(sets)}) "
                         "cannot be compared: split them with "
                         "bench.study.report.load.by_validation_set first")


def compare(runs: pd.DataFrame, steps: pd.DataFrame, profiles: list[str],
            target_loss: float | None = None, sweep_targets: dict[str, float] | None = None,
            is_baseline=lambda group: group["strategy"] == "ddp",
            baseline_name: str = "DDP") -> tuple[pd.DataFrame, pd.DataFrame]:
    """(speedup, convergence) tables over every group, whatever its runs' status.

    speedup: one row per group and clock (measured, then each network profile).
    convergence: one row per group: tokens to target, final validation loss (ok runs) and
    its difference from the baseline. `is_baseline(group row)` picks baseline groups (row
    fields: sweep, label, strategy, point, schedule). The runs must share one validation
    set (`require_one_validation_set`)."""
    require_one_validation_set(runs)
    if runs.empty:
        return pd.DataFrame(columns=SPEED_COLS), pd.DataFrame(columns=CONV_COLS)
    groups = runs.groupby("group", sort=False).agg(
        sweep=("sweep", "first"), label=("label", "first"), strategy=("strategy", "first"),
        point=("point", "first"), schedule=("schedule", "first"),
        variant=("variant", "first"))
    baselines = _baselines(groups, is_baseline)
    sweep_targets = sweep_targets or {}
    speed_rows, conv_rows = [], []
    for group, info in groups.iterrows():
        mine = runs[runs["group"] == group]
        base_group = baselines[group]
        common = {"sweep": info["sweep"], "label": info["label"], "variant": info["variant"],
                  "strategy": info["strategy"]}
        if base_group is None:
            note = {"baseline": f"none (no unique {baseline_name} group on this validation "
                                "set)", "runs": len(mine)}
            conv_rows.append({**common, **note})
            speed_rows.append({**common, **note, "clock": "measured"})
            continue
        base = runs[runs["group"] == base_group]
        target, source = _target(info, base[base["status"] == "ok"], target_loss,
                                 sweep_targets, baseline_name)
        mine_t = run_times_to_target(mine, steps, target, profiles)
        base_t = run_times_to_target(base, steps, target, profiles)
        counts, base_counts = _counts(mine_t), _counts(base_t)
        reason = miss_reason(counts)
        base_reason = miss_reason(base_counts)
        complete = not reason and not base_reason
        why = ("no speedup: " + reason if reason
               else f"no speedup: baseline {base_reason}" if base_reason else "")
        common.update(baseline=groups.loc[base_group, "label"], target_loss=target,
                      target_source=source,
                      **{**counts, "reached": f"{counts['reached']}/{counts['runs']}"},
                      misses=reason, reason=why)
        for clock in ["measured", *profiles]:
            column = f"time_to_target.{clock}"
            methods = set(mine_t.get(f"projection.{clock}", [])) | set(
                base_t.get(f"projection.{clock}", []))
            projection = ("measured" if clock == "measured"
                          else UNIFORM if UNIFORM in methods else STEPWISE)
            own = mean_interval(mine_t[column]) if not reason else mean_interval([])
            # the interval only when every trial of both reached: never from the lucky
            # seeds alone (a missed trial has no time to put in it)
            ratio = (ratio_interval(_by_seed(base_t, column), _by_seed(mine_t, column))
                     if complete else None)
            median, base_median = (algoperf.median_time(mine_t[column]),
                                   algoperf.median_time(base_t[column]))
            speed_rows.append({
                **common, "clock": clock, "projection": projection,
                "time_to_target_s": own.estimate, "time_to_target_ci": own.half_width,
                "baseline_time_to_target_s": mean_ci(base_t[column])[0]
                if not base_reason else math.nan,
                **_ratio_columns("speedup", ratio),
                "reached_fraction": counts["reached"] / counts["runs"],
                "median_time_to_target_s": median,
                "baseline_median_time_to_target_s": base_median,
                "median_speedup": algoperf.median_ratio(base_median, median)})
        conv_rows.append({**common, **_convergence(mine_t, base_t, reason, base_reason)})
    return (pd.DataFrame(speed_rows).reindex(columns=SPEED_COLS),
            pd.DataFrame(conv_rows).reindex(columns=CONV_COLS))


def _ratio_columns(name: str, ci) -> dict:
    if ci is None:
        return {name: math.nan, f"{name}_low": math.nan, f"{name}_high": math.nan}
    out = {name: ci.estimate, f"{name}_low": ci.low, f"{name}_high": ci.high}
    if name == "speedup":
        out.update(speedup_n=ci.n, speedup_method=ci.method, flag=ci.flag)
    return out


def _convergence(mine_t: pd.DataFrame, base_t: pd.DataFrame, reason: str,
                 base_reason: str) -> dict:
    tokens = mean_interval(mine_t["tokens_to_target"] if not reason else [])
    ratio = (ratio_interval(_by_seed(mine_t, "tokens_to_target"),
                            _by_seed(base_t, "tokens_to_target"))
             if not reason and not base_reason else None)
    ok, base_ok = mine_t[mine_t["status"] == "ok"], base_t[base_t["status"] == "ok"]
    final = mean_interval(ok["final_val_loss"])
    mine_v, base_v = _by_seed(ok, "final_val_loss"), _by_seed(base_ok, "final_val_loss")
    diff = (paired_interval(mine_v, base_v) if set(mine_v) == set(base_v)
            else welch_interval(mine_v.values(), base_v.values()))
    return {"tokens_to_target": tokens.estimate, "tokens_to_target_ci": tokens.half_width,
            "baseline_tokens_to_target": mean_ci(base_t["tokens_to_target"])[0]
            if not base_reason else math.nan,
            **_ratio_columns("token_ratio", ratio),
            "final_val_loss": final.estimate, "final_val_loss_ci": final.half_width,
            "final_val_loss_n": final.n, "val_loss_diff": diff.estimate,
            "val_loss_diff_ci": diff.half_width, "val_loss_diff_n": diff.n,
            "flag": final.flag}


def communication(runs: pd.DataFrame, profiles: list[str]) -> pd.DataFrame:
    """Per group (runs with status ok): throughput, bytes, seconds and comm share of the step.

    Measured share = exposed communication seconds / wall seconds of training; projected
    share = projected communication seconds / projected step seconds on the profile.
    Projected seconds for the whole run = projected per-step seconds x steps. Bytes per
    rank come in two kinds, never mixed: logical payload (`comm_bytes_per_rank`, the tensor
    bytes handed to each collective or send) and modelled wire bytes
    (`comm_wire_bytes_per_rank`, e.g. 2(n-1)/n x S per rank for a ring all-reduce; NaN in
    records that predate it). Peak bytes per sync (`comm_peak_sync_bytes`, and wire): the
    most one rank sent in one step (bench/run/meter.py, Bytes per step; NaN in older records)."""
    ok = runs[runs["status"] == "ok"].copy()
    world = ok["world_size"].where(ok["world_size"] > 0)
    ok["comm_bytes_per_rank"] = ok["comm_bytes_per_rank"].fillna(ok["comm_bytes_total"] / world)
    ok["comm_bytes_per_rank_step"] = ok["comm_bytes_per_rank"] / ok["steps"].where(
        ok["steps"] > 0)
    ok["comm_wire_bytes_per_rank_step"] = ok["comm_wire_bytes_per_rank"] / ok["steps"].where(
        ok["steps"] > 0)
    ok["comm_share.measured"] = ok["comm_s_total"] / ok["wall_s"].where(ok["wall_s"] > 0)
    ok["comm_bytes_per_step"] = ok["comm_bytes_total"] / ok["steps"].where(ok["steps"] > 0)
    ok["throughput.measured"] = ok["throughput_tokens_per_s"]
    columns = ["throughput.measured", "comm_bytes_total", "comm_bytes_per_step",
               "comm_bytes_per_rank", "comm_bytes_per_rank_step", "comm_wire_bytes_per_rank",
               "comm_wire_bytes_per_rank_step", "comm_peak_sync_bytes",
               "comm_peak_sync_wire_bytes", "comm_s_total", "compute_s_total",
               "comm_share.measured"]
    for profile in profiles:
        step, comm = f"proj.{profile}.step_s", f"proj.{profile}.comm_s"
        if f"proj.{profile}.throughput_tokens_per_s" in ok:
            ok[f"throughput.{profile}"] = ok[f"proj.{profile}.throughput_tokens_per_s"]
            columns.append(f"throughput.{profile}")
        if comm in ok:
            ok[f"comm_s.{profile}"] = ok[comm] * ok["steps"]
            columns.append(f"comm_s.{profile}")
        if step in ok and comm in ok:
            ok[f"comm_share.{profile}"] = ok[comm] / ok[step].where(ok[step] > 0)
            columns.append(f"comm_share.{profile}")
    if ok.empty:
        return pd.DataFrame(columns=["sweep", "label", "strategy", "runs", *columns])
    table = ok.groupby("group", sort=False).agg(
        sweep=("sweep", "first"), label=("label", "first"), strategy=("strategy", "first"),
        runs=("run_id", "count"),
        # a group where some runs lack wire bytes shows none rather than a partial mean
        **{c: (c, _strict_mean if "wire" in c or "peak" in c else "mean") for c in columns})
    return table.reset_index(drop=True)


def _strict_mean(values: pd.Series) -> float:
    return float(values.mean(skipna=False))


def downstream(runs: pd.DataFrame) -> pd.DataFrame:
    """Per group: mean, 95% half-width and chance label ("at chance", "below chance" or "":
    bench/study/report/chance.py) of every eval.TASK/METRIC column (ok runs)."""
    metrics = [c for c in runs.columns if c.startswith("eval.")]
    ok = runs[runs["status"] == "ok"]
    if not metrics or ok[metrics].notna().sum().sum() == 0:
        return pd.DataFrame()
    rows = []
    for _, mine in ok.groupby("group", sort=False):
        row = {"sweep": mine["sweep"].iloc[0], "label": mine["label"].iloc[0],
               "strategy": mine["strategy"].iloc[0], "runs": len(mine)}
        for metric in metrics:
            m, ci, n = mean_ci(mine[metric])
            name = metric.removeprefix("eval.")
            items = mine.get(f"eval_n.{name.partition('/')[0]}")
            row[name] = m
            row[name + "_ci"] = ci
            row[name + "_chance"] = chance.label(
                name, m, items.mean() if items is not None else None)
        rows.append(row)
    return pd.DataFrame(rows)
