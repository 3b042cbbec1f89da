"""Report sections for two studies: the one-step-delay optimizer study and pipelines.

    commbench sweep configs/sweeps/delay-study.yaml    # its report holds the delay section
    commbench report results/pipelines -o reports/pipelines

Delay study (shown when runs differ by `optim.name`, the update delay and
`optim.delay_correction` (none|ef|predict), read from each run's config.yaml; older
records without them count as adamw, 0, none). The update delay is `optim.delay` (the
emulation) or PipeDream-2BW's `strategy.delay` (the real asynchronous pipeline), so both
mechanisms sit side by side. A cell is one group (config minus seed); its sync reference
is the group with the same config except the delay settings (delay 0, no correction).
Table: final validation loss per cell over its ok runs (mean ± 95% half-width, n), the
gap to sync (delayed minus sync, paired by seed when both ran the same seeds, else Welch)
and what each correction recovers of the plain delay's gap. The corrections are the
project's reconstructions (docs/algorithms.md), not the papers' own equations.

Pipelines (shown when a run's strategy is `pipeline` or `pipedream-2bw`): measured and
theoretical bubble fractions (summary keys `bubble_fraction_measured`,
`bubble_fraction_theory`), throughput, and the speedup to target against the
synchronous pipeline (`strategy.name: pipeline`, `schedule: 1f1b`) and against DDP.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from bench.study.report import analysis, figures, render, tables
from bench.study.report.load import Results
from bench.study.report.stats import mean_interval, paired_interval, welch_interval

PIPELINES = ("pipeline", "pipedream-2bw")
EF_CAPTION = ("EF = the error-feedback correction as reconstructed in this project "
              "(docs/algorithms.md: ũ_t = u_t + λ(u_t − u_{t−1}) on the optimizer's update), "
              "not the paper's exact equations")


def blocks(res: Results, out_dir: Path, target_loss: float | None, speedup: pd.DataFrame,
           suffix: str = "", tag: str = "") -> list[tuple]:
    """The study sections that apply to these results (none when neither does). The runs
    are those of one validation set (bench/study/report/load.py `by_validation_set`); `suffix`
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


def delay_blocks(res: Results, out_dir: Path, tag: str = "") -> list[tuple]:
    """The delay study's section alone (none when it does not apply): the study sections
    of `commbench claims --study` (bench/study/claims/__init__.py)."""
    cells = delay_study(res.runs)
    return [] if cells is None else _delay_blocks(cells, out_dir, "", tag)


def _finals(part: pd.DataFrame) -> dict:
    ok = part[part["status"] == "ok"]
    key = "seed" if ok["seed"].is_unique else "run_id"
    return dict(zip(ok[key], ok["final_val_loss"], strict=True))


def delay_study(runs: pd.DataFrame) -> pd.DataFrame | None:
    """One row per cell: optimizer, mechanism (emulation or pipeline), delay, correction,
    final loss, gap to its sync reference (or None), and what the correction recovers."""
    analysis.require_one_validation_set(runs)
    keys = ["optim.name", "update_delay", "optim.delay_correction", "strategy"]
    if runs.empty or not (runs["update_delay"] > 0).any():
        return None
    if len(runs.drop_duplicates(keys)) < 2:
        return None
    rows = []
    for _, part in runs.groupby("group", sort=False):
        first = part.iloc[0]
        finals = _finals(part)
        final = mean_interval(finals.values())
        sync = runs[(runs["delay_ref"] == first["delay_ref"]) & (runs["update_delay"] == 0)
                    & (runs["optim.delay_correction"] == "none")]
        row = {"sweep": first["sweep"], "label": first["label"],
               "optimizer": first["optim.name"],
               "mechanism": "pipeline" if first["strategy"] in PIPELINES else "emulation",
               "delay": int(first["update_delay"]), "delay_ref": first["delay_ref"],
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
    table["recovered"] = math.nan  # 1 - gap(corrected) / gap(delayed), same sync reference
    for _, part in table.groupby(["sweep", "delay_ref"], sort=False):
        plain = part[(part["delay"] > 0) & (part["correction"] == "none")]["gap"]
        if len(plain) != 1 or not plain.iloc[0] > 0:
            continue
        corrected = part[(part["delay"] > 0) & (part["correction"] != "none")]
        table.loc[corrected.index, "recovered"] = 1 - corrected["gap"] / plain.iloc[0]
    table["_order"] = [CORRECTION_ORDER.index(c) if c in CORRECTION_ORDER else 9
                       for c in table["correction"]]
    return table.sort_values(["sweep", "mechanism", "optimizer", "delay", "_order"],
                             kind="stable").drop(columns="_order").reset_index(drop=True)


CORRECTION_ORDER = ["none", "ef", "predict"]
CORRECTION_NAMES = {"none": "", "ef": " + EF", "predict": " + predict"}


def setting(delay: int, correction: str) -> str:
    """sync, delayed, delayed + EF, delayed + predict."""
    if not delay:
        return "sync"
    return "delayed" + CORRECTION_NAMES.get(correction, f" + {correction}")


def _delay_blocks(cells: pd.DataFrame, out_dir: Path, suffix: str, tag: str) -> list[tuple]:
    table = pd.DataFrame({
        "group": cells["label"], "optimizer": cells["optimizer"],
        "delay by": cells["mechanism"],
        "setting": [setting(d, c) for d, c in zip(cells["delay"], cells["correction"],
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
        "correction recovers": [render.percent(v) for v in cells["recovered"]],
    })
    if cells["sweep"].nunique() > 1:
        table.insert(0, "sweep", cells["sweep"])
    out = [("h2", "One-step delay: optimizers, delay and correction" + tag),
           ("p", "Final validation loss per cell (ok runs: mean ± 95% half-width, n seeds) "
                 "and the gap to the synchronous run of the same config (delayed minus "
                 "sync: paired by seed when both ran the same seeds, else Welch). \"delay "
                 "by\": emulation = `optim.delay: 1` on a data-parallel run; pipeline = "
                 "PipeDream-2BW's own weight versions (its sync reference: the same "
                 "executor with `strategy.delay: 0`). \"correction recovers\" = 1 − "
                 "gap(delayed + correction) / gap(delayed), from the means. "
                 + EF_CAPTION + "; predict = weight prediction after SpecTrain/PipeMare, "
                 "also a reconstruction."),
           ("table", table)]
    fig = figures.delay_gaps(cells)
    if fig is not None:
        path = figures.save(fig, out_dir / "figures" / f"delay_gaps{suffix}.png")
        out.append(("figure", path, "Gap of the final validation loss to the synchronous "
                                    "run, per sync reference and setting (error bars: 95% "
                                    "interval). " + EF_CAPTION + "."))
    figures.write_csv(cells.drop(columns="delay_ref"), out_dir / f"delay_study{suffix}.csv")
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
