"""Results -> pandas tables -> matplotlib figures -> markdown and a self-contained HTML report.

    commbench report results/quickstart -o reports/quickstart [--target-loss 3.2]

`build_report(results_dir, out_dir)` reads every run record under `results_dir` (a sweep
directory, a folder of sweeps, or single runs) and writes to `out_dir`:

    report.html         everything in one file (figures embedded as PNG, tables as HTML)
    report.md           the same as markdown, figures linked from figures/
    runs.csv            one row per run (status, totals, projections, eval numbers)
    steps.csv           one row per logged step of every run
    speedup.csv         time to target and speedup vs DDP, per group and clock
    convergence.csv     tokens to target, final validation loss and its gap to DDP
    communication.csv   throughput, bytes, seconds and share of the step, per group
    downstream.csv      lm-eval metrics per group (when runs were evaluated)
    figures/*.png

Failed, diverged and partial (killed) runs are listed with their error, never dropped
silently; only runs with status ok enter the comparisons. How times to target, speedups
and confidence intervals are computed: see bench/report/analysis.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pandas as pd

from bench import records
from bench.report import analysis, figures, render
from bench.report.load import Results, load_results

__all__ = ["build_report", "load_results", "Results"]

_METHOD = (
    "Time to target = first crossing of the validation curve, linearly interpolated "
    "between the two validation points around it. Projected time to target on a profile = "
    "the run's projected total time on that profile × the fraction of its tokens seen at "
    "the crossing (assumes uniform steps). Speedup = DDP time / run time, paired by seed "
    "when DDP ran that seed (else vs the DDP mean); values are the mean over seeds "
    "± the 95% confidence half-width (t-distribution), shown only with 2+ seeds."
)


def build_report(results_dir: str | os.PathLike, out_dir: str | os.PathLike,
                 target_loss: float | None = None) -> Path:
    """Write the report of every run under `results_dir` into `out_dir`; returns report.html.

    `target_loss` overrides the target validation loss (default: the sweep spec's, else the
    DDP baseline's final validation loss, the highest over its seeds). Raises ValueError
    when `results_dir` does not exist or holds no run records."""
    results_dir, out_dir = Path(results_dir), Path(out_dir)
    res = load_results(results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "figures").mkdir(exist_ok=True)

    runs, steps, profiles = res.runs, res.steps, res.profiles
    speedup, convergence = analysis.compare(runs, steps, profiles, target_loss,
                                            res.sweep_targets)
    comm = analysis.communication(runs, profiles)
    evals = analysis.downstream(runs)

    runs.to_csv(out_dir / "runs.csv", index=False)
    steps.to_csv(out_dir / "steps.csv", index=False)
    speedup.to_csv(out_dir / "speedup.csv", index=False)
    convergence.to_csv(out_dir / "convergence.csv", index=False)
    comm.to_csv(out_dir / "communication.csv", index=False)
    if not evals.empty:
        evals.to_csv(out_dir / "downstream.csv", index=False)

    targets = speedup["target_loss"].dropna().unique() if not speedup.empty else []
    target_line = float(targets[0]) if len(targets) == 1 else None
    palette = figures.colors(list(dict.fromkeys(runs["label"])))
    drawn = {}
    for name, fig in (
        ("loss_vs_tokens", figures.loss_vs_tokens(runs, steps, palette, target_line)),
        ("loss_vs_time", figures.loss_vs_time(runs, steps, palette, target_line, profiles)),
        ("throughput", figures.throughput(comm, profiles)),
        ("communication", figures.communication(comm, profiles, palette)),
    ):
        if fig is not None:
            path = out_dir / "figures" / f"{name}.png"
            fig.savefig(path)
            drawn[name] = path

    blocks = _blocks(results_dir, res, speedup, convergence, comm, evals, drawn, profiles)
    title = f"commbench report: {results_dir.resolve().name}"
    records.write_text(out_dir / "report.md", render.to_markdown(blocks, out_dir))
    html_path = out_dir / "report.html"
    records.write_text(html_path, render.to_html(blocks, title))
    return html_path


def _blocks(results_dir: Path, res: Results, speedup: pd.DataFrame, convergence: pd.DataFrame,
            comm: pd.DataFrame, evals: pd.DataFrame, drawn: dict, profiles: list[str]) -> list:
    runs = res.runs
    counts = runs["status"].value_counts()
    status_text = ", ".join(f"{counts.get(s, 0)} {s}" for s in ("ok", "failed", "diverged",
                                                                 "partial") if counts.get(s, 0))
    blocks: list[tuple] = [
        ("h1", f"commbench report: {results_dir.resolve().name}"),
        ("p", f"Generated {time.strftime('%Y-%m-%d %H:%M')} from `{results_dir}`: "
              f"{_plural(len(runs), 'run')} in {_plural(runs['group'].nunique(), 'group')} "
              f"({status_text}). "
              "A group is one config minus its seed."),
    ]
    if res.warnings:
        blocks.append(("p", "Warnings:\n\n" + "\n".join(f"- {w}" for w in res.warnings)))

    blocks.append(("h2", "Speedup vs DDP (time to target loss)"))
    if speedup.empty:
        blocks.append(("p", "No run finished ok: nothing to compare."))
    else:
        blocks.append(("p", _target_text(speedup) + " " + _METHOD))
        blocks.append(("table", _wide_by_clock(speedup, profiles, "speedup", "speedup_ci",
                                               suffix="×")))
        blocks.append(("p", "Time to target, seconds (measured here, then projected):"))
        blocks.append(("table", _wide_by_clock(speedup, profiles, "time_to_target_s",
                                               "time_to_target_ci")))
        blocks.append(("h2", "Convergence"))
        blocks.append(("table", _convergence_table(convergence)))

    blocks.append(("h2", "Loss curves"))
    for name, caption in (
        ("loss_vs_tokens", "Loss vs tokens (mean over seeds; band: min-max over seeds; "
                           "dashed: target)."),
        ("loss_vs_time", "Loss vs time: measured on this machine, and projected onto each "
                         "network profile (projected run time × fraction of tokens)."),
    ):
        if name in drawn:
            blocks.append(("figure", drawn[name], caption))

    blocks.append(("h2", "Throughput and communication"))
    if comm.empty:
        blocks.append(("p", "No run finished ok."))
    else:
        for name, caption in (
            ("throughput", "Throughput in tokens/s over the whole run (log scale)."),
            ("communication", "Bytes sent (all ranks), communication seconds over the run "
                              "(measured = exposed, not overlapped with compute; projected = "
                              "modelled per profile) and communication share of the step."),
        ):
            if name in drawn:
                blocks.append(("figure", drawn[name], caption))
        blocks.append(("table", _throughput_table(comm, profiles)))
        blocks.append(("table", _comm_table(comm, profiles)))

    if not evals.empty:
        blocks.append(("h2", "Downstream evaluation"))
        blocks.append(("table", _downstream_table(evals)))

    blocks.append(("h2", "Runs not in the comparison"))
    bad = runs[runs["status"] != "ok"]
    if bad.empty:
        blocks.append(("p", "None: every run finished ok."))
    else:
        blocks.append(("p", "Failed, diverged and partial runs (killed midway, or still "
                            "running); only ok runs enter the comparisons above."))
        blocks.append(("table", _problem_table(bad)))

    blocks.append(("h2", "All runs"))
    blocks.append(("table", _runs_table(runs)))
    files = ["runs.csv", "steps.csv", "speedup.csv", "convergence.csv", "communication.csv"]
    if not evals.empty:
        files.append("downstream.csv")
    blocks.append(("p", "Tables as CSV beside this report: " + ", ".join(f"`{f}`" for f in files)
                   + "."))
    return blocks


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _target_text(speedup: pd.DataFrame) -> str:
    rows = speedup.dropna(subset=["target_loss"]).drop_duplicates(["baseline", "target_loss"])
    if rows.empty:
        return "No DDP baseline to compare with (strategy name `ddp`)."
    parts = [f"{render.num(r.target_loss)} ({r.target_source}, baseline `{r.baseline}`)"
             for r in rows.itertuples()]
    return "Target validation loss: " + "; ".join(parts) + "."


def _group_columns(table: pd.DataFrame) -> pd.DataFrame:
    out = pd.DataFrame({"group": table["label"], "strategy": table["strategy"]})
    if table["sweep"].nunique() > 1:
        out.insert(0, "sweep", table["sweep"])
    return out


def _wide_by_clock(speedup: pd.DataFrame, profiles: list[str], value: str, ci: str,
                   suffix: str = "") -> pd.DataFrame:
    first = speedup.drop_duplicates(["sweep", "label"])
    out = _group_columns(first).reset_index(drop=True)
    out["baseline"] = first["baseline"].astype(object).fillna("—").to_numpy()
    out["reached target"] = first["reached"].astype(object).fillna("—").to_numpy()
    for clock in ["measured", *profiles]:
        rows = speedup[speedup["clock"] == clock].set_index(["sweep", "label"])
        cells = []
        for key in zip(first["sweep"], first["label"], strict=True):
            if key not in rows.index:
                cells.append("—")
                continue
            row = rows.loc[key]
            text = render.with_ci(row[value], row[ci], 3 if suffix else 4, suffix)
            if text == "—" and str(row["reached"]).startswith("0/"):
                text = "not reached"
            cells.append(text)
        out[clock if clock == "measured" else f"proj. {clock}"] = cells
    return out


def _convergence_table(conv: pd.DataFrame) -> pd.DataFrame:
    out = _group_columns(conv).reset_index(drop=True)
    out["runs"] = conv["runs"].to_numpy()
    out["tokens to target"] = [render.with_ci(m, c) for m, c in
                               zip(conv["tokens_to_target"], conv["tokens_to_target_ci"],
                                   strict=True)]
    out["tokens vs DDP"] = [render.with_ci(m, c, 3, "×") for m, c in
                            zip(conv["token_ratio"], conv["token_ratio_ci"], strict=True)]
    out["final val loss"] = [render.with_ci(m, c) for m, c in
                             zip(conv["final_val_loss"], conv["final_val_loss_ci"], strict=True)]
    out["Δ val loss vs DDP"] = [render.with_ci(m, c, 3) for m, c in
                                zip(conv["val_loss_diff"], conv["val_loss_diff_ci"], strict=True)]
    return out


def _throughput_table(comm: pd.DataFrame, profiles: list[str]) -> pd.DataFrame:
    out = _group_columns(comm).reset_index(drop=True)
    out["tokens/s measured"] = [render.si(v) for v in comm["throughput.measured"]]
    for p in profiles:
        if f"throughput.{p}" in comm:
            out[f"tokens/s proj. {p}"] = [render.si(v) for v in comm[f"throughput.{p}"]]
    return out


def _comm_table(comm: pd.DataFrame, profiles: list[str]) -> pd.DataFrame:
    out = _group_columns(comm).reset_index(drop=True)
    out["bytes (run, all ranks)"] = [render.si(v, "B") for v in comm["comm_bytes_total"]]
    out["bytes/step"] = [render.si(v, "B") for v in comm["comm_bytes_per_step"]]
    out["comm s measured"] = [render.num(v) for v in comm["comm_s_total"]]
    out["compute s measured"] = [render.num(v) for v in comm["compute_s_total"]]
    out["comm share measured"] = [render.percent(v) for v in comm["comm_share.measured"]]
    for p in profiles:
        if f"comm_share.{p}" in comm:
            out[f"comm share {p}"] = [render.percent(v) for v in comm[f"comm_share.{p}"]]
    return out


def _downstream_table(evals: pd.DataFrame) -> pd.DataFrame:
    """One row per task/metric, one column per group (metrics outnumber groups)."""
    names = (evals["sweep"] + "/" + evals["label"] if evals["sweep"].nunique() > 1
             else evals["label"])
    metrics = [c for c in evals.columns
               if c not in ("sweep", "label", "strategy", "runs") and not c.endswith("_ci")]
    out = pd.DataFrame({"task/metric": ["runs", *metrics]})
    for i, name in enumerate(names):
        row = evals.iloc[i]
        out[name] = [str(row["runs"]), *[render.with_ci(row[m], row[f"{m}_ci"])
                                         for m in metrics]]
    return out


def _first_line(text) -> str:
    if not isinstance(text, str) or not text.strip():
        return ""
    line = text.strip().splitlines()[0]
    return line if len(line) <= 160 else line[:157] + "..."


_PARTIAL = "no summary: killed midway, or still running"


def _problem_table(bad: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "run": bad["run_id"], "group": bad["label"], "seed": bad["seed"].map(render.num),
        "status": bad["status"],
        "steps": [f"{render.num(d)}/{render.num(p)}" for d, p in
                  zip(bad["steps_done"], bad["steps_planned"], strict=True)],
        "last train loss": bad["last_train_loss"].map(render.num),
        "error": [_first_line(e) or (_PARTIAL if s == "partial" else "")
                  for e, s in zip(bad["error"], bad["status"], strict=True)],
    })


def _runs_table(runs: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "run": runs["run_id"], "group": runs["label"], "seed": runs["seed"].map(render.num),
        "strategy": runs["strategy"], "status": runs["status"],
        "steps": runs["steps_done"].map(render.num),
        "tokens": runs["total_tokens"].map(render.si),
        "wall s": runs["wall_s"].map(render.num),
        "tokens/s": runs["throughput_tokens_per_s"].map(render.si),
        "final val loss": runs["final_val_loss"].map(render.num),
    })
