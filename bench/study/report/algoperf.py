"""Time to target scored AlgoPerf's way, and the performance profile over cases.

    commbench report results/quickstart -o reports/quickstart   # performance_profile.csv

AlgoPerf (Dahl et al. 2023, arXiv:2306.07179) scores a submission on a workload by the
median over its trials (here: seeds) of the time to reach the target, a trial that misses
counted as infinite time. A diverged, failed or killed run is a trial that missed. So a
method that reached the target in fewer than half its trials (or in exactly half of an
even number) has no finite score, and one that missed in some trials is scored with
those misses, never by its lucky seeds: 3 trials with one miss score the slower of the
two that reached.

Performance profile (Dolan & Moré 2002, as AlgoPerf uses it): a case is one workload (the
runs compared with one baseline group: its config, grid point and target) on one clock
(measured here, or projected onto a network profile). In each case the best method is the
one with the smallest median time; for each method, rho(tau) is the fraction of cases in
which its median time is within a factor tau of the best's. A miss (infinite median) is
never within; a case no method solved counts against every method; a method that did not
run a case counts it as a miss.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import pandas as pd

DESCRIPTION = (
    "A case is one workload (the runs compared with one DDP group: its config, grid point "
    "and target loss) on one clock (measured here, or projected onto a network profile). "
    "In each case the best method has the smallest median time to target over its seeds "
    "(AlgoPerf: a missed trial, diverged, failed or killed run counted as infinite time, "
    "so a method that reached the target in half its seeds or fewer has no time). For "
    "each method: the fraction of all cases in which its median time is within a factor "
    "τ of the best's. A miss is never within; a case no method solved, or that a method "
    "did not run, counts against it.")
TAU_MAX = 4.0
"""The profile is drawn and tabulated for tau from 1 to this factor."""
TAU_POINTS = 61


def median_time(times: Iterable[float]) -> float:
    """The median over trials with a miss (NaN or inf) counted as infinite time; NaN for
    no trials. Infinite when half or more of the trials missed."""
    values = [math.inf if v is None or not math.isfinite(float(v)) else float(v)
              for v in times]
    if not values:
        return math.nan
    values.sort()
    n = len(values)
    if n % 2:
        return values[n // 2]
    low, high = values[n // 2 - 1], values[n // 2]
    return math.inf if math.isinf(high) else (low + high) / 2


def median_ratio(baseline: float, own: float) -> float:
    """baseline median / own median: a speedup; NaN unless both are finite and positive."""
    if not (math.isfinite(baseline) and math.isfinite(own)) or own <= 0 or baseline <= 0:
        return math.nan
    return baseline / own


def cases(speedup: pd.DataFrame) -> pd.DataFrame:
    """One row per case and method: workload, clock, method, median time (inf: no score).

    `speedup` is analysis.compare's table (columns sweep, variant, baseline, clock,
    median_time_to_target_s; val_set when the report concatenated several sets). Groups
    without a baseline are in no workload."""
    if speedup.empty or "median_time_to_target_s" not in speedup:
        return pd.DataFrame(columns=["workload", "clock", "method", "time"])
    rows = speedup[speedup["baseline"].map(lambda b: isinstance(b, str)
                                           and not b.startswith("none"))]
    val_set = rows["val_set"] if "val_set" in rows else pd.Series("", index=rows.index)
    method = rows["variant"] if "variant" in rows else rows["label"]
    return pd.DataFrame({
        "workload": [f"{s}/{b}" + (f" @ {v}" if val_set.nunique() > 1 else "")
                     for s, b, v in zip(rows["sweep"], rows["baseline"], val_set,
                                        strict=True)],
        "clock": rows["clock"].to_numpy(), "method": method.to_numpy(),
        "time": rows["median_time_to_target_s"].astype(float).fillna(math.inf).to_numpy()})


def ratios(table: pd.DataFrame) -> pd.DataFrame:
    """Per case and method, its median time over the case's best (inf: a miss)."""
    table = table.copy()
    best = table.groupby(["workload", "clock"])["time"].transform("min")
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = table["time"] / best
    table["ratio"] = ratio.where(np.isfinite(table["time"]) & (best > 0), math.inf)
    return table


def performance_profile(table: pd.DataFrame, taus: Iterable[float] | None = None
                        ) -> pd.DataFrame:
    """Columns method, tau, fraction: the share of every case (workload x clock present in
    `table`, from `cases`) in which the method's median time is within tau of the best.
    Default taus: log-spaced from 1 to TAU_MAX, plus every ratio reached on the way
    (so the steps of the profile sit where they are)."""
    if table.empty:
        return pd.DataFrame(columns=["method", "tau", "fraction"])
    with_ratio = ratios(table)
    num_cases = len(with_ratio.drop_duplicates(["workload", "clock"]))
    if taus is None:
        grid = np.geomspace(1.0, TAU_MAX, TAU_POINTS)
        reached = with_ratio["ratio"][with_ratio["ratio"] <= TAU_MAX]
        taus = np.unique(np.concatenate([grid, reached.to_numpy(dtype=float)]))
    taus = [float(t) for t in taus]
    rows = []
    for method in dict.fromkeys(with_ratio["method"]):
        mine = with_ratio[with_ratio["method"] == method]
        # a method's best entry per case (one group per method and workload, normally)
        per_case = mine.groupby(["workload", "clock"])["ratio"].min().to_numpy()
        for tau in taus:
            rows.append({"method": method, "tau": tau,
                         "fraction": float((per_case <= tau * (1 + 1e-12)).sum()) / num_cases})
    return pd.DataFrame(rows)


def summary_text(profile: pd.DataFrame, table: pd.DataFrame) -> str:
    """One line per method: the share of cases it was best in (tau = 1) and within 2x."""
    if profile.empty:
        return ""
    num_cases = len(table.drop_duplicates(["workload", "clock"]))
    parts = []
    for method, part in profile.groupby("method", sort=False):
        at = part.sort_values("tau")
        best = at.loc[at["tau"] <= 1.0 + 1e-9, "fraction"].max()
        within2 = at.loc[at["tau"] <= 2.0 + 1e-9, "fraction"].max()
        parts.append(f"`{method}` best in {best:.0%}, within 2× of the best in "
                     f"{within2:.0%}")
    workloads, clocks = table["workload"].nunique(), table["clock"].nunique()
    return (f"Over {num_cases} cases ({workloads} workload{'s' * (workloads != 1)} × "
            f"{clocks} clock{'s' * (clocks != 1)}): " + "; ".join(parts) + ".")
