"""The planner in the report (issue 48): each run's bandwidth for 90% utilisation, and the
what-if table of the scenario a sweep spec names.

    commbench sweep configs/sweeps/streaming.yaml    # its spec names `whatif:`

Per ok run whose summary.json has `compute_per_step`: the smallest inter-node bandwidth
of its first network profile at which its own what-if (bench/study/whatif/report.py
`measured_bandwidth_for`: its measured compute per step kind, world, ranks per node and
its strategy's traffic description, priced as `commbench whatif --run` prices it) reaches
90% utilisation. Compute is what the run measured on its machine: for a CPU run, the
bandwidth at which *that* compute would stay 90% busy, not a GPU's. A run without a
value says why (a note; never an error). The what-if section is `commbench whatif`'s
table, assumptions and figure (bench/study/whatif/report.py `evaluate`, `table_rows`,
`notes`, `figure`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from bench.study.report import figures, render, tables

TARGET = 0.9
"""The utilisation whose bandwidth each run's column gives."""
COLUMN = "bw_for_90pct"
"""runs.csv columns: COLUMN (as shown), COLUMN_Bps (bytes/s; inf: above the range),
COLUMN_profile (the profile swept), COLUMN_at_max (the utilisation at the range's top),
COLUMN_note (why none)."""


def _run_dir(results_dir: Path, run_id: str) -> Path:
    """The run's directory: `run_id` is relative to results_dir, or results_dir's own
    name when results_dir is the run (bench/study/report/load.py)."""
    path = results_dir / run_id
    return path if path.is_dir() else results_dir


def run_bandwidth(run_dir: Path) -> tuple[float, str, float, str]:
    """(bytes/s, profile, utilisation at the range's top, "") of one run's bandwidth for
    TARGET utilisation, or (nan, "", nan, why not)."""
    from bench.config import from_dict
    from bench.study.whatif.report import measured_bandwidth_for
    from bench.study.whatif.scenario import run_summary

    try:
        config, summary = run_summary(run_dir)
        found = measured_bandwidth_for(from_dict(config), summary, TARGET)
    except ValueError as err:  # the what-if's refusals name the run directory first
        why = str(err).replace(repr(str(run_dir)), "").lstrip(": ").strip()
        return math.nan, "", math.nan, why or "not computed"
    except Exception as err:  # a record this code cannot price: said, never raised
        return math.nan, "", math.nan, f"{type(err).__name__}: {err}"
    return found.bandwidth_Bps, found.profile, found.utilisation_at_high, ""


def with_bandwidth(results_dir: Path, runs: pd.DataFrame) -> pd.DataFrame:
    """`runs` with the COLUMN columns: each ok run's bandwidth for TARGET utilisation;
    other runs get none (no note: they contribute no numbers anywhere)."""
    from bench.study.whatif.report import format_bandwidth, measured_range

    low, high = measured_range()
    rows = [(math.nan, "", math.nan, "") if status != "ok" else
            run_bandwidth(_run_dir(results_dir, str(run_id)))
            for run_id, status in zip(runs["run_id"], runs["status"], strict=True)]
    values, profiles, at_max, why = (list(c) for c in zip(*rows, strict=True)) if rows \
        else ([], [], [], [])
    shown = ["—" if math.isnan(b) else format_bandwidth(b, low, high) for b in values]
    return runs.assign(**{COLUMN: shown, f"{COLUMN}_Bps": values,
                          f"{COLUMN}_profile": profiles, f"{COLUMN}_at_max": at_max,
                          f"{COLUMN}_note": why})


def group_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per group, the median over its ok seeds with a value (bandwidths above the range
    count as infinite), beside each seed's."""
    from bench.study.whatif.report import format_bandwidth, measured_range

    low, high = measured_range()
    ok = runs[runs["status"] == "ok"]
    rows = []
    for (sweep, label), part in ok.groupby(["sweep", "label"], sort=False):
        values = part[f"{COLUMN}_Bps"].dropna()
        profiles = ", ".join(dict.fromkeys(p for p in part[f"{COLUMN}_profile"] if p))
        rows.append({"sweep": sweep, "label": label, "strategy": part["strategy"].iloc[0],
                     "profile swept": profiles or "—",
                     "ok runs with a value": f"{len(values)} of {len(part)}",
                     f"bw for {TARGET:.0%} (median over seeds)":
                     format_bandwidth(float(np.median(values)), low, high)
                     if len(values) else "—",
                     "utilisation at max (median)":
                     render.percent(float(part[f"{COLUMN}_at_max"].dropna().median()))
                     if len(values) else "—",
                     "per seed": ", ".join(f"{render.num(s)}: {t}" for s, t in
                                           zip(part["seed"], part[COLUMN], strict=True))})
    if not rows:
        return pd.DataFrame()
    table = pd.DataFrame(rows)
    out = tables.group_columns(table)
    return pd.concat([out, table.drop(columns=["sweep", "label", "strategy"])], axis=1)


def bandwidth_blocks(runs: pd.DataFrame) -> list[tuple]:
    """The section: what the number means, the group table, why some runs have none."""
    if COLUMN not in runs or not (runs["status"] == "ok").any():
        return []
    from bench.study.whatif.report import MEASURED_RANGE

    blocks: list[tuple] = [
        ("h2", f"Bandwidth for {TARGET:.0%} utilisation (each run's own what-if)"),
        ("p", f"Per ok run: the smallest bandwidth of its first network profile's "
              f"inter-node link (swept from {MEASURED_RANGE[0]} to {MEASURED_RANGE[1]}) at "
              f"which the run's own what-if keeps compute {TARGET:.0%} busy: its measured "
              "compute per step kind (summary.json `compute_per_step`, each rank's median), "
              "its world and ranks per node, and its strategy's traffic description, "
              "priced every step as `commbench whatif --run` prices it (docs/whatif.md). "
              "The compute is the one measured on this machine: for a CPU run it is the "
              f"bandwidth at which *this* compute would stay {TARGET:.0%} busy (a GPU's "
              "faster steps would need more). "
              "\"> max\": not reached within the range (the utilisation at its top says "
              "how far: a link's latency, or traffic that cannot overlap compute, caps it "
              "whatever the bandwidth); \"≤ min\": reached at its low end. "
              "Median over each group's seeds; each run's value is in the All runs table "
              f"and `runs.csv` (`{COLUMN}_Bps`, bytes/s)."),
        ("table", group_table(runs)),
    ]
    missing = runs[(runs["status"] == "ok") & runs[f"{COLUMN}_note"].astype(bool)]
    if not missing.empty:
        lines = [f"- {len(part)} run(s) ({', '.join(f'`{r}`' for r in part['run_id'])}): "
                 f"{why}" for why, part in missing.groupby(f"{COLUMN}_note", sort=False)]
        blocks.append(("p", "No value (—) for these ok runs:\n\n" + "\n".join(lines)))
    return blocks


def whatif_blocks(path: str | Path, out_dir: Path) -> list[tuple]:
    """The what-if of the scenario at `path` (a sweep spec's `whatif:`): `commbench
    whatif`'s table with its assumptions and figure; a scenario that cannot be evaluated
    says why."""
    from bench.study.whatif.report import at_bandwidth, evaluate, figure, notes, table_rows
    from bench.study.whatif.scenario import load_scenario

    try:
        s = load_scenario(str(path))
        results = evaluate(s)
    except ValueError as err:
        return [("h2", "What-if"),
                ("p", f"The sweep's what-if scenario `{path}` was not evaluated: {err}")]
    blocks: list[tuple] = [
        ("h2", f"What-if: {s.name} (at {at_bandwidth(results)})"),
        ("p", f"The scenario this sweep's spec names (`whatif: {path}`), priced as "
              "`commbench whatif` prices it (docs/whatif.md): each method's traffic "
              "description on the network model for the model, world and network the "
              "scenario plans, without training. \"bw for X%\": the swept link's bandwidth "
              "at which the method reaches X% compute utilisation (\"> range\": not within "
              "the scenario's network.bandwidth)."),
        ("p", "Assumptions:\n\n" + "\n".join("- " + " ".join(str(n).split())
                                              for n in notes(s, results))),
        ("table", table_rows(s, results)),
    ]
    if results:
        drawn = figures.save(figure(s, results), out_dir / "figures" / "whatif.png")
        blocks.append(("figure", drawn, f"What-if {s.name}: compute utilisation against "
                                        "the swept link's bandwidth, one line per method."))
    return blocks
