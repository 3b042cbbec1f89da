"""Report sections for two studies: the one-step-delay optimizer study and pipelines.

    commbench sweep configs/sweeps/delay-study.yaml    # its report holds the delay section
    commbench report results/pipelines -o reports/pipelines

Delay study (shown when runs differ by `optim.name`, `optim.delay` (0|1) and
`optim.delay_correction` (none|ef), read from each run's config.yaml; older records
without them count as adamw, 0, none). A cell is one group (config minus seed); its sync
reference is the group with the same config except the delay settings (delay 0, no
correction). Table: final validation loss per cell over its ok runs (mean ± 95%
half-width, n), and the gap to sync (delayed minus sync, paired by seed when both ran the
same seeds, else Welch). The EF correction is the project's reconstruction of the
paper's error-feedback correction (docs/algorithms.md), not the paper's own equations.

Pipelines (shown when a run's strategy is `pipeline` or `pipedream-2bw`): measured and
theoretical bubble fractions (summary keys `bubble_fraction_measured`,
`bubble_fraction_theory`), throughput, and the speedup to target against the
synchronous pipeline (`strategy.name: pipeline`, `schedule: 1f1b`) and against DDP.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from bench.report import analysis, figures, render, tables
from bench.report.load import Results
from bench.report.stats import mean_interval, paired_interval, welch_interval

PIPELINES = ("pipeline", "pipedream-2bw")
EF_CAPTION = ("EF = the error-feedback correction as reconstructed in this project "
              "(docs/algorithms.md: ũ_t = u_t + λ(u_t − u_{t−1}) on the optimizer's update), "
              "not the paper's exact equations")


def blocks(res: Results, out_dir: Path, target_loss: float | None, speedup: pd.DataFrame,
           suffix: str = "", tag: str = "") -> list[tuple]:
    """The study sections that apply to these results (none when neither does). The runs
    are those of one validation set (bench/report/load.py `by_validation_set`); `suffix`
    names its files (delay_study{suffix}.csv) and `tag` ends its headings."""
    out: list[tuple] = []
    cells = delay_study(res.runs)
    if cells is not None:
        out += _delay_blocks(cells, out_dir, suffix, tag)
    pipes = pipeline_study(res, target_loss, speedup)
    if pipes is not None:
        out += _pipeline_blocks(pipes, tag)
    return out


# ------------------------------------------------------------------------- delay study


def _finals(part: pd.DataFrame) -> dict:
    ok = part[part["status"] == "ok"]
    key = "seed" if ok["seed"].is_unique else "run_id"
    return dict(zip(ok[key], ok["final_val_loss"], strict=True))


def delay_study(runs: pd.DataFrame) -> pd.DataFrame | None:
    """One row per cell: optimizer, delay, correction, final loss, gap to sync (or None)."""
    analysis.require_one_validation_set(runs)
    keys = ["optim.name", "optim.delay", "optim.delay_correction"]
    if runs.empty or not (runs["optim.delay"].astype(float) > 0).any():
        return None
    if len(runs.drop_duplicates(keys)) < 2:
        return None
    rows = []
    for _, part in runs.groupby("group", sort=False):
        first = part.iloc[0]
        finals = _finals(part)
        final = mean_interval(finals.values())
        sync = runs[(runs["delay_ref"] == first["delay_ref"])
                    & (runs["optim.delay"].astype(float) == 0)
                    & (runs["optim.delay_correction"] == "none")]
        row = {"sweep": first["sweep"], "label": first["label"],
               "optimizer": first["optim.name"], "delay": int(first["optim.delay"]),
               "correction": first["optim.delay_correction"], "runs": len(part),
               "ok": len(finals), "final_val_loss": final.estimate,
               "final_val_loss_ci": final.half_width, "gap": math.nan, "gap_ci": math.nan,
               "gap_n": 0, "gap_method": "", "sync": ""}
        if row["delay"] and not sync.empty and sync["group"].nunique() == 1:
            base = _finals(sync)
            gap = (paired_interval(finals, base) if set(finals) == set(base)
                   else welch_interval(finals.values(), base.values()))
            row.update(gap=gap.estimate, gap_ci=gap.half_width, gap_n=gap.n,
                       gap_method=gap.method, sync=sync["label"].iloc[0])
        rows.append(row)
    table = pd.DataFrame(rows)
    recovered = {}
    for (sweep, name), part in table.groupby(["sweep", "optimizer"], sort=False):
        plain = part[(part["delay"] > 0) & (part["correction"] == "none")]["gap"]
        ef = part[(part["delay"] > 0) & (part["correction"] == "ef")]["gap"]
        if len(plain) == 1 and len(ef) == 1 and plain.iloc[0] > 0:
            recovered[(sweep, name)] = 1 - ef.iloc[0] / plain.iloc[0]
    table["ef_recovered"] = [recovered.get((s, n), math.nan) if c == "ef" else math.nan
                             for s, n, c in zip(table["sweep"], table["optimizer"],
                                                table["correction"], strict=True)]
    table["_order"] = table["correction"] == "ef"  # sync, delayed, delayed + EF
    return table.sort_values(["sweep", "optimizer", "delay", "_order"], kind="stable").drop(
        columns="_order").reset_index(drop=True)


def _setting(delay: int, correction: str) -> str:
    if not delay:
        return "sync"
    return "delayed + EF" if correction == "ef" else "delayed"


def _delay_blocks(cells: pd.DataFrame, out_dir: Path, suffix: str, tag: str) -> list[tuple]:
    table = pd.DataFrame({
        "group": cells["label"], "optimizer": cells["optimizer"],
        "setting": [_setting(d, c) for d, c in zip(cells["delay"], cells["correction"],
                                                   strict=True)],
        "runs (ok)": [f"{r} ({o})" for r, o in zip(cells["runs"], cells["ok"], strict=True)],
        "final val loss": [render.with_ci(m, c) + f" (n={n})" for m, c, n in
                           zip(cells["final_val_loss"], cells["final_val_loss_ci"],
                               cells["ok"], strict=True)],
        "gap to sync": [("—" if not d else render.with_ci(g, c, 3) + f" (n={n}"
                         + (", n<3" if n < 3 else "") + f"; {m})")
                        for d, g, c, n, m in zip(cells["delay"], cells["gap"], cells["gap_ci"],
                                                 cells["gap_n"], cells["gap_method"],
                                                 strict=True)],
        "EF recovers": [render.percent(v) for v in cells["ef_recovered"]],
    })
    if cells["sweep"].nunique() > 1:
        table.insert(0, "sweep", cells["sweep"])
    out = [("h2", "One-step delay: optimizers, delay and correction" + tag),
           ("p", "Final validation loss per cell (ok runs: mean ± 95% half-width, n seeds) "
                 "and the gap to the synchronous run of the same optimizer (delayed minus "
                 "sync: paired by seed when both ran the same seeds, else Welch). "
                 "\"EF recovers\" = 1 − gap(delayed + EF) / gap(delayed), from the means. "
                 + EF_CAPTION + "."),
           ("table", table)]
    fig = figures.delay_gaps(cells)
    if fig is not None:
        path = out_dir / "figures" / f"delay_gaps{suffix}.png"
        fig.savefig(path)
        out.append(("figure", path, "Gap of the final validation loss to the synchronous "
                                    "run, per optimizer (error bars: 95% interval). "
                                    + EF_CAPTION + "."))
    cells.to_csv(out_dir / f"delay_study{suffix}.csv", index=False)
    return out


# --------------------------------------------------------------------------- pipelines


def _is_sync_pipeline(group) -> bool:
    return group["strategy"] == "pipeline" and str(group["schedule"]).lower() == "1f1b"


def pipeline_study(res: Results, target_loss: float | None,
                   speedup: pd.DataFrame) -> pd.DataFrame | None:
    """One row per pipeline group: bubble fractions, throughput, speedups (or None)."""
    runs = res.runs
    pipes = runs[runs["strategy"].isin(PIPELINES)]
    if pipes.empty:
        return None
    # the same target as the comparison with DDP, per sweep, unless one was given
    targets = ({} if speedup.empty else
               speedup.dropna(subset=["target_loss"]).groupby("sweep")["target_loss"]
               .first().to_dict())
    vs_sync, _ = analysis.compare(pipes, res.steps, [], target_loss,
                                  {**res.sweep_targets, **targets},
                                  is_baseline=_is_sync_pipeline,
                                  baseline_name="synchronous 1F1B pipeline")
    vs_sync = vs_sync[vs_sync["clock"] == "measured"].set_index(["sweep", "label"])
    vs_ddp = (speedup[speedup["clock"] == "measured"].set_index(["sweep", "label"])
              if not speedup.empty else pd.DataFrame())
    rows = []
    for _, part in pipes.groupby("group", sort=False):
        ok = part[part["status"] == "ok"]
        key = (part["sweep"].iloc[0], part["label"].iloc[0])
        rows.append({
            "sweep": key[0], "label": key[1], "strategy": part["strategy"].iloc[0],
            "schedule": part["schedule"].iloc[0], "runs": len(part), "ok": len(ok),
            "bubble_measured": ok["bubble_fraction_measured"].mean(),
            "bubble_theory": ok["bubble_fraction_theory"].mean(),
            "throughput": ok["throughput_tokens_per_s"].mean(),
            "vs_sync": _speed_cell(vs_sync, key), "vs_ddp": _speed_cell(vs_ddp, key)})
    return pd.DataFrame(rows)


def _speed_cell(table: pd.DataFrame, key) -> str:
    if table.empty or key not in table.index:
        return "—"
    row = table.loc[key]
    if not isinstance(row.get("baseline"), str) or row["baseline"].startswith("none"):
        return "no baseline"
    return tables.ratio_cell(row)


def _pipeline_blocks(pipes: pd.DataFrame, tag: str) -> list[tuple]:
    table = pd.DataFrame({
        "group": pipes["label"], "strategy": pipes["strategy"],
        "schedule": pipes["schedule"].map(lambda s: "—" if s is None or s != s else s),
        "runs (ok)": [f"{r} ({o})" for r, o in zip(pipes["runs"], pipes["ok"], strict=True)],
        "bubble measured": [render.percent(v) for v in pipes["bubble_measured"]],
        "bubble theory": [render.percent(v) for v in pipes["bubble_theory"]],
        "tokens/s measured": [render.si(v) for v in pipes["throughput"]],
        "speedup vs sync 1F1B": pipes["vs_sync"], "speedup vs DDP": pipes["vs_ddp"]})
    return [("h2", "Pipelines" + tag),
            ("p", "Bubble fraction: measured (idle share of the step) and the schedule's "
                  "theory ((S−1)/(M+S−1) for S stages and M microbatches); — where a record "
                  "lacks it. Speedup to the target loss (measured clock) against the "
                  "synchronous pipeline (`strategy.name: pipeline`, `schedule: 1f1b`) and "
                  "against DDP, computed as in the speedup section."),
            ("table", table)]
