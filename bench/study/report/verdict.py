"""The report's first screen: one sentence per method and network profile, in words.

    commbench report results/quickstart -o reports/quickstart   # report.md opens with it

"On wan-1g (projected), `diloco-H10` reached loss 2.1 1.9× [1.7, 2.1] faster than DDP,
ending 0.02 [0.01, 0.03] nats worse (3 seeds resolve ±11% in time, ±0.01 nats)." An
interval that holds 1 (speed) or 0 (loss) is said in words, with the smallest effect
the seeds resolve: the interval's half-width (for a speedup, on the log scale: ±X%).
A method that missed the target in some trials says so, and is scored AlgoPerf's way
(bench/study/report/algoperf.py): the median over its trials with a miss counted as never,
without an interval. The numbers are analysis.compare's (speedup and convergence tables).
"""

from __future__ import annotations

import math
import numbers

import pandas as pd

from bench.study.report import render
from bench.study.report.contention import MEASURED_MARK, PROJECTED_MARK


def _finite(*values) -> bool:
    """Every value a finite real number (numpy's too; not a bool, not None)."""
    return all(isinstance(v, numbers.Real) and not isinstance(v, bool)
               and math.isfinite(v) for v in values)


def _g(value: float) -> str:
    return f"{value:.2g}"


def _trials(n: int) -> str:
    return f"{n} trials (seeds)" if n != 1 else "1 trial (seed)"


def _baseline_name(label: str) -> str:
    return "DDP" if label.lower() == "ddp" else f"DDP (`{label}`)"


def _times_phrase(ratio: float, low: float | None = None, high: float | None = None,
                  than: str = "DDP") -> str:
    """"1.9× [1.7, 2.1] faster than DDP" or "2× [1.5, 2.6] slower than DDP"."""
    interval = _finite(low, high)
    if ratio >= 1:
        text = f"{render.num(ratio, 3)}×"
        return text + (f" {render.bounds(low, high)}" if interval else "") + f" faster than {than}"
    text = f"{render.num(1 / ratio, 3)}×"
    return (text + (f" {render.bounds(1 / high, 1 / low)}" if interval else "")
            + f" slower than {than}")


def speed_resolution(low: float, high: float) -> str:
    """The half-width of a ratio's interval on the log scale, as ±X%."""
    percent = 100 * (math.sqrt(high / low) - 1)
    return f"±{percent:.0f}%" if percent >= 10 else f"±{percent:.2g}%"


def speed_phrase(row) -> tuple[str, str]:
    """(what the method did on this clock, the speed difference the seeds resolve or "")."""
    than = _baseline_name(row["baseline"])
    target = f"loss {render.num(row['target_loss'])}"
    runs = int(row["runs"])
    reached = int(round(row["reached_fraction"] * runs)) if _finite(
        row.get("reached_fraction")) else 0
    if isinstance(row.get("reason"), str) and row["reason"]:
        median = row.get("median_speedup")
        own_missed = isinstance(row.get("misses"), str) and row["misses"]
        who = (f"missed it in {runs - reached} of {runs} trials" if own_missed
               else f"{than} missed it in some of its trials")
        if _finite(median) and median > 0:
            return (f"reached {target} in {reached} of {runs} trials; scored with its "
                    f"misses (the median over trials, a miss counted as never), it was "
                    f"{_times_phrase(median, than=than)}, with no interval: {who}"), ""
        if not _finite(row.get("median_time_to_target_s")):
            why = f" ({row['misses']})" if own_missed else ""
            if not reached:
                trials = "its only trial" if runs == 1 else f"any of its {runs} trials"
                return f"did not reach {target} in {trials}{why}", ""
            return (f"reached {target} in only {reached} of {runs} trials{why}: no time to "
                    "target, since half its trials or more missed (AlgoPerf's median, a "
                    "miss counted as never)"), ""
        return (f"reached {target} in {reached} of {runs} trials, but {than} reached it in "
                f"half its trials or fewer: no speedup"), ""
    est, low, high = row["speedup"], row["speedup_low"], row["speedup_high"]
    if not _finite(est):
        return f"has no time to {target}", ""
    if not _finite(low, high):
        n = int(row["speedup_n"]) if _finite(row.get("speedup_n")) else runs
        return (f"reached {target} {_times_phrase(est, than=than)} (n={n}: no "
                "interval)"), ""
    resolution = speed_resolution(low, high)
    if low <= 1 <= high:
        return (f"reached {target} no faster or slower than {than} that these seeds can "
                f"tell: {render.num(est, 3)}× {render.bounds(low, high)}"), resolution
    return f"reached {target} {_times_phrase(est, low, high, than)}", resolution


def loss_phrase(conv, than: str = "DDP") -> tuple[str, str]:
    """(how its final validation loss compares with the baseline's, the loss difference
    the seeds resolve or "")."""
    diff, half = conv.get("val_loss_diff"), conv.get("val_loss_diff_ci")
    n = int(conv["val_loss_diff_n"]) if _finite(conv.get("val_loss_diff_n")) else 0
    if not _finite(diff):
        return "with no final validation loss to compare", ""
    if not _finite(half):
        side = "worse" if diff > 0 else "better"
        return f"ending {_g(abs(diff))} nats {side} (n={n}: no interval)", ""
    low, high = diff - half, diff + half
    resolution = f"±{_g(half)} nats"
    if low > 0:
        return f"ending {_g(diff)} {render.bounds(low, high)} nats worse", resolution
    if high < 0:
        return f"ending {_g(-diff)} {render.bounds(-high, -low)} nats better", resolution
    return (f"ending no better or worse than {than} that {n} seeds can resolve: "
            f"{resolution}"), ""


def sentence(row, conv, mark: str = "", where: str | None = None) -> str:
    """One clock's verdict on one method (a row of the speedup table and its group's row
    of the convergence table); `mark` flags a clock that shares cores; `where` names
    the clock (default: from the row)."""
    clock = row["clock"]
    if where is None:
        where = "Measured here" if clock == "measured" else f"On {clock} (projected)"
    speed, speed_res = speed_phrase(row)
    loss, loss_res = loss_phrase(conv, _baseline_name(row["baseline"]))
    resolves = [r for r in (speed_res and f"{speed_res} in time",
                            loss_res and f"{loss_res} in loss") if r]
    seeds = int(row["runs"])
    tail = (f" ({seeds} seeds resolve " + " and ".join(resolves) + ")") if resolves else ""
    note = ""
    if mark == PROJECTED_MARK:
        note = f" {mark} not contention-free"
    elif mark == MEASURED_MARK:
        note = f" {mark} ranks shared cores"
    return f"{where}, `{row['label']}` {speed}, {loss}{tail}.{note}"


def verdicts(speedup: pd.DataFrame, convergence: pd.DataFrame, profiles: list[str],
             marks: dict | None = None) -> list[str]:
    """One paragraph per compared method (not the baseline itself): its name, then one
    sentence per clock (measured, then each network profile), as markdown list items."""
    marks = marks or {}
    conv = convergence.set_index(["sweep", "label"]) if not convergence.empty else None
    out = []
    for (sweep, label), part in speedup.groupby(["sweep", "label"], sort=False):
        first = part.iloc[0]
        baseline = first["baseline"]
        if not isinstance(baseline, str) or baseline == label:
            continue
        if baseline.startswith("none"):
            out.append(f"**`{label}`**: no DDP baseline on its validation set, nothing to "
                       "compare with.")
            continue
        conv_row = conv.loc[(sweep, label)] if conv is not None else pd.Series(dtype=float)
        measured, projected = marks.get((sweep, label), ("", ""))
        lines = []
        for clock in ["measured", *profiles]:
            rows = part[part["clock"] == clock]
            if rows.empty:
                continue
            mark = measured if clock == "measured" else projected
            lines.append("- " + sentence(rows.iloc[0], conv_row, mark))
        if len(lines) > 1 and not any(_finite(v) for v in part["median_time_to_target_s"]):
            # no score on any clock: one sentence says it for all
            lines = ["- " + sentence(part.iloc[0], conv_row, where="On every clock")]
        out.append(f"**`{label}`** against {_baseline_name(baseline)}, "
                   f"{_trials(int(first['runs']))}:\n\n" + "\n".join(lines))
    return out
