"""The report's tables as DataFrames of display strings (report/__init__.py lays them out).

    commbench report results/quickstart -o reports/quickstart

Each function takes a table of numbers from bench/study/report/analysis.py (or studies.py) and
returns the strings a reader sees: intervals as "2.47× [0.93, 6.6] n<3" (geometric mean,
95% interval, flagged when it rests on fewer than 3 seeds), and a reason instead of a
number where a group has none ("no speedup: 1 of 2 seeds did not reach").
"""

from __future__ import annotations

import math

import pandas as pd

from bench.study.report import chance, contention, render


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def target_text(speedup: pd.DataFrame, baseline: str = "DDP (strategy name `ddp`)") -> str:
    rows = speedup.dropna(subset=["target_loss"]).drop_duplicates(["baseline", "target_loss"])
    if rows.empty:
        return f"No {baseline} baseline to compare with."
    parts = [f"{render.num(r.target_loss)} ({r.target_source}, baseline `{r.baseline}`)"
             for r in rows.itertuples()]
    return "Target validation loss: " + "; ".join(parts) + "."


def group_columns(table: pd.DataFrame) -> pd.DataFrame:
    out = pd.DataFrame({"group": table["label"], "strategy": table["strategy"]})
    if table["sweep"].nunique() > 1:
        out.insert(0, "sweep", table["sweep"])
    return out.reset_index(drop=True)


def _count(value) -> str:
    return render.num(value) if pd.notna(value) else "—"


def _reason(row, column: str = "reason") -> str:
    """Why a group has no number ("" when it has one): `reason` for a speedup (the group's
    or its baseline's misses), `misses` for the group's own time or tokens to target."""
    reason = row.get(column)
    return reason if isinstance(reason, str) else ""


def ratio_cell(row, name: str = "speedup") -> str:
    if _reason(row):
        median = row.get(f"median_{name}")
        if isinstance(median, float) and math.isfinite(median):  # AlgoPerf's score
            return (f"{render.num(median, 3)}× median, no interval "
                    f"({_reason(row).removeprefix('no speedup: ')})")
        return _reason(row)
    return render.ratio_ci(row[name], row[f"{name}_low"], row[f"{name}_high"],
                           row.get(f"{name}_n", row.get("runs")))


def _time_cell(row) -> str:
    if _reason(row, "misses"):
        median = row.get("median_time_to_target_s")
        if isinstance(median, float) and math.isfinite(median):  # AlgoPerf's score
            return f"median {render.num(median)} ({_reason(row, 'misses')})"
        return _reason(row, "misses")
    return render.with_ci(row["time_to_target_s"], row["time_to_target_ci"], 4)


def wide_by_clock(speedup: pd.DataFrame, profiles: list[str], kind: str,
                  marks: dict | None = None) -> pd.DataFrame:
    """One row per group, one column per clock; kind "speedup" or "time". `marks`:
    (sweep, label) -> (measured mark, projected mark) (bench/study/report/contention.py
    `group_marks`), appended to the cells of the clocks whose runs shared cores, and
    said in a "shares cores" column."""
    marks = marks or {}
    first = speedup.drop_duplicates(["sweep", "label"])
    out = group_columns(first)
    out["baseline"] = first["baseline"].astype(object).fillna("—").to_numpy()
    out["runs"] = [_count(v) for v in first["runs"]]
    out["reached"] = first["reached"].astype(object).fillna("—").to_numpy()
    if kind == "speedup":  # the tallies once, beside the speedups
        out["did not reach"] = [_count(v) for v in first["did_not_reach"]]
        out["diverged"] = [_count(v) for v in first["diverged"]]
        out["failed/partial"] = [_count(f + p) if pd.notna(f) else "—"
                                 for f, p in zip(first["failed"], first["partial"],
                                                 strict=True)]
    cell = ratio_cell if kind == "speedup" else _time_cell
    for clock in ["measured", *profiles]:
        rows = speedup[speedup["clock"] == clock].set_index(["sweep", "label"])
        cells = []
        for key in zip(first["sweep"], first["label"], strict=True):
            mark = marks.get(key, ("", ""))[0 if clock == "measured" else 1]
            text = cell(rows.loc[key]) if key in rows.index else "—"
            cells.append(f"{text} {mark}" if mark and text != "—" else text)
        out[clock if clock == "measured" else f"proj. {clock}"] = cells
    if profiles:
        projected = speedup[speedup["clock"] != "measured"].groupby(
            ["sweep", "label"], sort=False)["projection"].agg(
            lambda x: "uniform-step estimate" if "uniform-step estimate" in set(x)
            else "step-wise")
        out["projected times"] = [projected.get(key, "—") for key in
                                  zip(first["sweep"], first["label"], strict=True)]
    if marks:
        out["shares cores"] = [_shares_cores(marks.get(key, ("", ""))) for key in
                               zip(first["sweep"], first["label"], strict=True)]
    return out


def _shares_cores(marks: tuple[str, str]) -> str:
    measured, projected = marks
    parts = ([f"{projected} projections not contention-free"] if projected else []) + (
        [f"{measured} measured clock shared cores"] if measured else [])
    return "; ".join(parts) or "no"


def convergence_table(conv: pd.DataFrame) -> pd.DataFrame:
    out = group_columns(conv)
    out["runs"] = [_count(v) for v in conv["runs"]]
    out["ok"] = [_count(v) for v in conv["ok"]]
    out["tokens to target"] = [
        _reason(r, "misses") or
        render.with_ci(r["tokens_to_target"], r["tokens_to_target_ci"])
        for _, r in conv.iterrows()]
    out["tokens vs DDP"] = [ratio_cell(r, "token_ratio") for _, r in conv.iterrows()]
    out["final val loss (ok runs)"] = [
        render.with_ci(m, c) + (f" (n={render.num(n)})" if pd.notna(n) else "")
        for m, c, n in zip(conv["final_val_loss"], conv["final_val_loss_ci"],
                           conv["final_val_loss_n"], strict=True)]
    out["Δ val loss vs DDP"] = [render.with_ci(m, c, 3) for m, c in
                                zip(conv["val_loss_diff"], conv["val_loss_diff_ci"],
                                    strict=True)]
    return out


def throughput_table(comm: pd.DataFrame, profiles: list[str],
                     marks: dict | None = None) -> pd.DataFrame:
    """Throughput per group; `marks` as `wide_by_clock` takes them (the group's own)."""
    marks = marks or {}
    keys = list(zip(comm["sweep"], comm["label"], strict=True))

    def cells(column: str, which: int) -> list[str]:
        return [render.si(v) + (f" {marks[k][which]}" if marks.get(k, ("", ""))[which]
                                else "") for v, k in zip(comm[column], keys, strict=True)]
    out = group_columns(comm)
    out["tokens/s measured"] = cells("throughput.measured", 0)
    for p in profiles:
        if f"throughput.{p}" in comm:
            out[f"tokens/s proj. {p}"] = cells(f"throughput.{p}", 1)
    return out


def _bytes(values) -> list[str]:
    return [render.si(v, "B") if pd.notna(v) else "n/a" for v in values]


def comm_table(comm: pd.DataFrame, profiles: list[str]) -> pd.DataFrame:
    out = group_columns(comm)
    out["logical payload B/rank (run)"] = _bytes(comm["comm_bytes_per_rank"])
    out["logical payload B/rank/step"] = _bytes(comm["comm_bytes_per_rank_step"])
    out["modelled wire B/rank (run)"] = _bytes(comm["comm_wire_bytes_per_rank"])
    out["modelled wire B/rank/step"] = _bytes(comm["comm_wire_bytes_per_rank_step"])
    out["comm s measured"] = [render.num(v) for v in comm["comm_s_total"]]
    out["compute s measured"] = [render.num(v) for v in comm["compute_s_total"]]
    out["comm share measured"] = [render.percent(v) for v in comm["comm_share.measured"]]
    for p in profiles:
        if f"comm_share.{p}" in comm:
            out[f"comm share {p}"] = [render.percent(v) for v in comm[f"comm_share.{p}"]]
    if "comm_peak_sync_bytes" in comm:
        out["peak payload B/rank/sync"] = _bytes(comm["comm_peak_sync_bytes"])
        out["peak wire B/rank/sync"] = _bytes(comm["comm_peak_sync_wire_bytes"])
    return out


def downstream_table(evals: pd.DataFrame) -> pd.DataFrame:
    """One row per task/metric, one column per group (metrics outnumber groups)."""
    names = (evals["sweep"] + "/" + evals["label"] if evals["sweep"].nunique() > 1
             else evals["label"])
    metrics = [c for c in evals.columns if c not in ("sweep", "label", "strategy", "runs")
               and not c.endswith(("_ci", "_chance"))]
    out = pd.DataFrame({"task/metric": ["runs", *[
        f"{m} ({chance.describe(m)})" if chance.describe(m) else m for m in metrics]]})
    for i, name in enumerate(names):
        row = evals.iloc[i]
        out[name] = [str(row["runs"]), *[_score_cell(row, m) for m in metrics]]
    return out


def _score_cell(row, metric: str) -> str:
    """A downstream score; at or below chance level it says so first (the number after,
    in parentheses, is not a result)."""
    text = render.with_ci(row[metric], row[f"{metric}_ci"])
    verdict = row.get(f"{metric}_chance")
    return f"{verdict} ({text})" if isinstance(verdict, str) and verdict else text


def _first_line(text) -> str:
    if not isinstance(text, str) or not text.strip():
        return ""
    line = text.strip().splitlines()[0]
    return line if len(line) <= 160 else line[:157] + "..."


_PARTIAL = "no summary: killed midway, or still running"


def problem_table(bad: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "run": bad["run_id"], "group": bad["label"], "seed": bad["seed"].map(render.num),
        "status": bad["status"],
        "steps": [f"{render.num(d)}/{render.num(p)}" for d, p in
                  zip(bad["steps_done"], bad["steps_planned"], strict=True)],
        "last train loss": bad["last_train_loss"].map(render.num),
        "error": [_first_line(e) or (_PARTIAL if s == "partial" else "")
                  for e, s in zip(bad["error"], bad["status"], strict=True)],
    })


def runs_table(runs: pd.DataFrame, set_numbers: dict[str, int] | None = None) -> pd.DataFrame:
    """One row per run; with `set_numbers` (validation set name -> its number in the
    report), the set each run was scored on."""
    table = pd.DataFrame({
        "run": runs["run_id"], "group": runs["label"], "seed": runs["seed"].map(render.num),
        "strategy": runs["strategy"], "status": runs["status"],
        "steps": runs["steps_done"].map(render.num),
        "tokens": runs["total_tokens"].map(render.si),
        "wall s": runs["wall_s"].map(render.num),
        "tokens/s": runs["throughput_tokens_per_s"].map(render.si),
        "final val loss": runs["final_val_loss"].map(render.num),
    })
    if set_numbers:
        table["validation set"] = runs["val_set"].map(set_numbers)
    if "bw_for_90pct" in runs:  # bench/study/report/planner.py COLUMN
        table["bw for 90% (own what-if)"] = runs["bw_for_90pct"].to_numpy()
    if "compute_clock" in runs:
        flags = contention.flags(runs)
        table["ranks/core"] = [render.num(v, 3) if math.isfinite(v) else
                               ("GPU" if s == "GPU" else "unknown") for v, s in
                               zip(runs["ranks_per_core"], runs["ranks_per_core_source"],
                                   strict=True)]
        table["compute clock"] = [c if r else f"{c} (not recorded)" for c, r in
                                  zip(runs["compute_clock"], runs["compute_clock_recorded"],
                                      strict=True)]
        table["shares cores"] = [
            _shares_cores((contention.MEASURED_MARK if m else "",
                           contention.PROJECTED_MARK if p else ""))
            if not u else "unknown"
            for m, p, u in zip(flags["measured_contended"], flags["projections_contended"],
                               flags["contention_unknown"], strict=True)]
    return table


def memory_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per run, the largest rank's memory plan beside what the ranks measured."""
    estimate, above = runs["memory_estimate_bytes"], runs["peak_memory_above_start_bytes"]
    return pd.DataFrame({
        "run": runs["run_id"], "group": runs["label"], "strategy": runs["strategy"],
        "world": runs["world_size"].map(render.num),
        "estimate (largest rank)": _bytes(estimate),
        "measured peak above start": _bytes(above),
        "measured / estimate": [render.num(a / e, 3) if e > 0 else "n/a"
                                for a, e in zip(above, estimate, strict=True)],
        "peak memory": _bytes(runs["peak_memory_bytes"]),
    })
