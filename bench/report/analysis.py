"""The numbers of a report: time and tokens to a target loss, speedup vs DDP, confidence.

Time to target is the first crossing of the validation curve, linearly interpolated
between the two validation points around it (tokens and seconds alike); a run whose
first validation point is already below the target crosses there. A projected time to
target on a network profile is the run's projected total time on that profile times the
fraction of the run's tokens seen at the crossing (it assumes every step costs the same).

Each group (a config minus its seed) is compared with the DDP group of the same sweep
and grid point (else the only DDP group). The target is the caller's, else the sweep
spec's, else the DDP group's final validation loss (the highest over its seeds, so
that every DDP seed reaches it). Per seed, a speedup is the
baseline's time over the run's time, paired by seed when the baseline ran that seed, else
against the baseline mean; groups report the mean over seeds ± the 95% confidence
half-width of the t-distribution (blank with one seed).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import pandas as pd

# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom.
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
         2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
         2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)
_Z975 = 1.959964


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975  # Cornish-Fisher expansion: error < 1e-4 beyond 30 degrees of freedom
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def mean_ci(values: Iterable[float]) -> tuple[float, float, int]:
    """(mean, 95% half-width, n) over the finite values; half-width NaN when n < 2."""
    x = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=float)
    if len(x) == 0:
        return math.nan, math.nan, 0
    if len(x) == 1:
        return float(x[0]), math.nan, 1
    half = t_quantile_975(len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    return float(x.mean()), float(half), len(x)


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


def validation_rows(steps: pd.DataFrame, run_id: str) -> pd.DataFrame:
    if steps.empty or "val_loss" not in steps:
        return pd.DataFrame(columns=["step", "tokens", "elapsed_s", "val_loss"])
    rows = steps[(steps["run_id"] == run_id) & steps["val_loss"].notna()]
    return rows.reindex(columns=["step", "tokens", "elapsed_s", "val_loss"])


def _baselines(groups: pd.DataFrame) -> dict[str, str | None]:
    """group -> the DDP group it is compared with (same sweep and grid point, else unique)."""
    ddp = groups[groups["strategy"] == "ddp"]
    chosen: dict[str, str | None] = {}
    for group, row in groups.iterrows():
        same_point = ddp[(ddp["sweep"] == row["sweep"]) & (ddp["point"] == row["point"])]
        same_sweep = ddp[ddp["sweep"] == row["sweep"]]
        for candidates in (same_point, same_sweep, ddp):
            if len(candidates) == 1:
                chosen[group] = candidates.index[0]
                break
        else:
            chosen[group] = None
    return chosen


def _clocks(profiles: list[str]) -> list[str]:
    return ["measured", *profiles]


def run_times_to_target(runs: pd.DataFrame, steps: pd.DataFrame, target: float,
                        profiles: list[str]) -> pd.DataFrame:
    """Per run: tokens_to_target and time_to_target.CLOCK (measured and per profile)."""
    rows = []
    for _, run in runs.iterrows():
        cross = first_crossing(validation_rows(steps, run["run_id"]), target)
        row = {"run_id": run["run_id"], "seed": run["seed"], "final_val_loss":
               run["final_val_loss"], "tokens_to_target": cross["tokens"],
               "time_to_target.measured": cross["elapsed_s"]}
        fraction = cross["tokens"] / run["total_tokens"] if run["total_tokens"] else math.nan
        for profile in profiles:
            total = run.get(f"proj.{profile}.total_s", math.nan)
            row[f"time_to_target.{profile}"] = fraction * total
        rows.append(row)
    return pd.DataFrame(rows)


def _paired(values: pd.Series, seeds: pd.Series, reference: pd.DataFrame, column: str,
            combine) -> list[float]:
    """combine(run value, baseline value of the same seed, else the baseline mean)."""
    ref_mean = mean_ci(reference[column])[0]
    by_seed = dict(zip(reference["seed"], reference[column], strict=True))
    out = []
    for value, seed in zip(values, seeds, strict=True):
        ref = by_seed.get(seed, ref_mean)
        ref = ref if ref is not None and np.isfinite(ref) else ref_mean
        out.append(combine(value, ref))
    return out


def compare(runs: pd.DataFrame, steps: pd.DataFrame, profiles: list[str],
            target_loss: float | None = None,
            sweep_targets: dict[str, float] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(speedup, convergence) tables over the runs with status ok.

    speedup: one row per group and clock (measured, then each network profile).
    convergence: one row per group: tokens to target, final validation loss and its
    difference from the baseline."""
    ok = runs[runs["status"] == "ok"]
    speed_cols = ["sweep", "label", "strategy", "baseline", "target_loss", "target_source",
                  "clock", "runs", "reached", "time_to_target_s", "time_to_target_ci",
                  "baseline_time_to_target_s", "speedup", "speedup_ci"]
    conv_cols = ["sweep", "label", "strategy", "baseline", "target_loss", "target_source",
                 "runs", "reached", "tokens_to_target", "tokens_to_target_ci",
                 "baseline_tokens_to_target", "token_ratio", "token_ratio_ci", "final_val_loss",
                 "final_val_loss_ci", "val_loss_diff", "val_loss_diff_ci"]
    if ok.empty:
        return pd.DataFrame(columns=speed_cols), pd.DataFrame(columns=conv_cols)
    groups = ok.groupby("group", sort=False).agg(
        sweep=("sweep", "first"), label=("label", "first"), strategy=("strategy", "first"),
        point=("point", "first"))
    baselines = _baselines(groups)
    sweep_targets = sweep_targets or {}
    speed_rows, conv_rows = [], []
    for group, info in groups.iterrows():
        mine = ok[ok["group"] == group]
        base_group = baselines[group]
        common = {"sweep": info["sweep"], "label": info["label"], "strategy": info["strategy"]}
        if base_group is None:
            note = {"baseline": "none (no unique DDP group)", "runs": len(mine)}
            conv_rows.append({**common, **note})
            speed_rows.append({**common, **note, "clock": "measured"})
            continue
        base = ok[ok["group"] == base_group]
        if target_loss is not None:
            target, source = float(target_loss), "given"
        elif info["sweep"] in sweep_targets:
            target, source = sweep_targets[info["sweep"]], "sweep spec"
        else:
            # the worst DDP seed's final loss: every DDP seed reaches it
            target = float(base["final_val_loss"].max())
            source = "DDP final val loss (highest over seeds)"
        mine_t = run_times_to_target(mine, steps, target, profiles)
        base_t = run_times_to_target(base, steps, target, profiles)
        reached = int(mine_t["tokens_to_target"].notna().sum())
        common.update(baseline=groups.loc[base_group, "label"], target_loss=target,
                      target_source=source, runs=len(mine), reached=f"{reached}/{len(mine)}")
        for clock in _clocks(profiles):
            column = f"time_to_target.{clock}"  # run_times_to_target has every clock
            t_mean, t_ci, _ = mean_ci(mine_t[column])
            speedups = _paired(mine_t[column], mine_t["seed"], base_t, column,
                               lambda v, ref: ref / v if v > 0 else math.nan)
            s_mean, s_ci, _ = mean_ci(speedups)
            speed_rows.append({**common, "clock": clock, "time_to_target_s": t_mean,
                               "time_to_target_ci": t_ci,
                               "baseline_time_to_target_s": mean_ci(base_t[column])[0],
                               "speedup": s_mean, "speedup_ci": s_ci})
        tok_mean, tok_ci, _ = mean_ci(mine_t["tokens_to_target"])
        ratios = _paired(mine_t["tokens_to_target"], mine_t["seed"], base_t,
                         "tokens_to_target", lambda v, ref: v / ref if ref > 0 else math.nan)
        r_mean, r_ci, _ = mean_ci(ratios)
        v_mean, v_ci, _ = mean_ci(mine_t["final_val_loss"])
        diffs = _paired(mine_t["final_val_loss"], mine_t["seed"], base_t, "final_val_loss",
                        lambda v, ref: v - ref)
        d_mean, d_ci, _ = mean_ci(diffs)
        conv_rows.append({**common, "tokens_to_target": tok_mean, "tokens_to_target_ci": tok_ci,
                          "baseline_tokens_to_target": mean_ci(base_t["tokens_to_target"])[0],
                          "token_ratio": r_mean, "token_ratio_ci": r_ci,
                          "final_val_loss": v_mean, "final_val_loss_ci": v_ci,
                          "val_loss_diff": d_mean, "val_loss_diff_ci": d_ci})
    return (pd.DataFrame(speed_rows).reindex(columns=speed_cols),
            pd.DataFrame(conv_rows).reindex(columns=conv_cols))


def communication(runs: pd.DataFrame, profiles: list[str]) -> pd.DataFrame:
    """Per group (runs with status ok): throughput, bytes, seconds and comm share of the step.

    Measured share = exposed communication seconds / wall seconds of training; projected
    share = projected communication seconds / projected step seconds on the profile.
    Projected seconds for the whole run = projected per-step seconds x steps."""
    ok = runs[runs["status"] == "ok"].copy()
    ok["comm_share.measured"] = ok["comm_s_total"] / ok["wall_s"].where(ok["wall_s"] > 0)
    ok["comm_bytes_per_step"] = ok["comm_bytes_total"] / ok["steps"].where(ok["steps"] > 0)
    ok["throughput.measured"] = ok["throughput_tokens_per_s"]
    columns = ["throughput.measured", "comm_bytes_total", "comm_bytes_per_step",
               "comm_s_total", "compute_s_total", "comm_share.measured"]
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
        runs=("run_id", "count"), **{c: (c, "mean") for c in columns})
    return table.reset_index(drop=True)


def downstream(runs: pd.DataFrame) -> pd.DataFrame:
    """Per group: mean and 95% half-width of every eval.TASK/METRIC column (ok runs)."""
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
            row[metric.removeprefix("eval.")] = m
            row[metric.removeprefix("eval.") + "_ci"] = ci
        rows.append(row)
    return pd.DataFrame(rows)
