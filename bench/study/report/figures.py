"""Report figures (matplotlib, Agg canvas: no display, no global pyplot state).

Each function takes the loaded tables and returns a Figure, or None when there is
nothing to draw. Curves are the mean over seeds at each logged step, with the min-max
range over seeds shaded when there are several.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, NullFormatter, PercentFormatter

from bench.run import files

_COLORS = ["#222222", "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
           "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: Path) -> Path:
    """Write `fig` as a PNG at `path`, atomically (bench.run.files.write_bytes: a link at
    `path` is replaced, never followed); returns `path`."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    files.write_bytes(path, buffer.getvalue())
    return path


def write_csv(table: pd.DataFrame, path: Path) -> None:
    """A table as CSV at `path`, atomically, like `save`."""
    files.write_text(path, table.to_csv(index=False))


LEGEND_INSIDE_MAX = 12
"""Legends with more entries go outside the axes, in columns (a study of 49 groups: an
inside legend took the whole figure and matplotlib collapsed the axes)."""


def legend(fig: Figure, ax, fontsize: float = 7) -> None:
    """The axes' legend: inside for a few entries, beside the axes in columns for many."""
    entries = len(ax.get_legend_handles_labels()[1])
    if entries <= LEGEND_INSIDE_MAX:
        ax.legend(fontsize=fontsize)
        return
    columns = math.ceil(entries / 24)
    fig.set_figwidth(fig.get_figwidth() + 2.2 * columns)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", fontsize=6,
               ncols=columns)


def colors(labels: list[str]) -> dict[str, str]:
    return {label: _COLORS[i % len(_COLORS)] for i, label in enumerate(labels)}


def _curves(steps: pd.DataFrame, column: str) -> dict[str, pd.DataFrame]:
    """label -> per-step mean over seeds of tokens, elapsed_s, fraction, the projected
    clocks (proj_elapsed.PROFILE, NaN where a seed lacks one) and `column`."""
    rows = steps[steps[column].notna()] if column in steps else steps.iloc[0:0]
    clocks = [c for c in steps.columns if c.startswith("proj_elapsed.")]
    out = {}
    for label, part in rows.groupby("label", sort=False):
        agg = part.groupby("step").agg(
            tokens=("tokens", "mean"), elapsed_s=("elapsed_s", "mean"),
            fraction=("fraction", "mean"), value=(column, "mean"), low=(column, "min"),
            high=(column, "max"), seeds=(column, "count"),
            **{c: (c, lambda x: x.mean(skipna=False)) for c in clocks})
        out[label] = agg.reset_index()
    return out


def _prepare(runs: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Steps of the ok runs, with `fraction` = tokens / the run's total tokens."""
    ok = runs[runs["status"] == "ok"]
    part = steps[steps["run_id"].isin(ok["run_id"])].copy()
    total = dict(zip(ok["run_id"], ok["total_tokens"], strict=True))
    part["fraction"] = part["tokens"] / part["run_id"].map(total).astype(float)
    return part


def _plot_curves(ax, curves_train, curves_val, x_of, palette) -> None:
    for label, curve in curves_train.items():
        # light smoothing on long curves only: a window of 1/25 of the points, centred
        window = max(1, len(curve) // 25)
        y = curve["value"].rolling(window, min_periods=1, center=True).mean()
        ax.plot(x_of(label, curve), y, color=palette[label], alpha=0.35, linewidth=1)
    for label, curve in curves_val.items():
        x = x_of(label, curve)
        ax.plot(x, curve["value"], color=palette[label], marker="o", markersize=3,
                linewidth=1.8, label=label)
        if (curve["seeds"] > 1).any():
            ax.fill_between(x, curve["low"], curve["high"], color=palette[label], alpha=0.15,
                            linewidth=0)


def _finish_axes(ax, xlabel: str, target: float | None, x_formatter=None) -> None:
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    if x_formatter is not None:
        ax.xaxis.set_major_formatter(x_formatter)
    if target is not None and np.isfinite(target):
        ax.axhline(target, color="grey", linestyle="--", linewidth=1)


def loss_vs_tokens(runs, steps, palette, target: float | None) -> Figure | None:
    part = _prepare(runs, steps)
    train, val = _curves(part, "loss"), _curves(part, "val_loss")
    if not train and not val:
        return None
    fig = _figure(7.5, 4.5)
    ax = fig.add_subplot()
    _plot_curves(ax, train, val, lambda _l, c: c["tokens"], palette)
    _finish_axes(ax, "tokens (global)", target, EngFormatter())
    ax.set_ylabel("loss")
    ax.set_title("Validation loss (markers) and training loss (faint) vs tokens")
    _limit_y(ax, val, train)
    legend(fig, ax, 8)
    return fig


def loss_vs_time(runs, steps, palette, target: float | None,
                 profiles: list[str]) -> Figure | None:
    """Measured wall-clock, then the projected clock of each network profile."""
    part = _prepare(runs, steps)
    train, val = _curves(part, "loss"), _curves(part, "val_loss")
    if not train and not val:
        return None
    ok = runs[runs["status"] == "ok"]
    clocks = ["measured", *profiles]
    ncols = min(3, len(clocks))
    nrows = math.ceil(len(clocks) / ncols)
    fig = _figure(4.2 * ncols, 3.4 * nrows + 0.4)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=True).ravel()
    for ax, clock in zip(axes, clocks, strict=False):
        if clock == "measured":
            def x_of(_label, curve):
                return curve["elapsed_s"]
        else:
            column = f"proj.{clock}.total_s"
            totals = ok.groupby("label")[column].mean() if column in ok else pd.Series()

            def x_of(label, curve, totals=totals, clock=f"proj_elapsed.{clock}"):
                if clock in curve and curve[clock].notna().all():
                    return curve[clock]  # the cumulative projected clock the run logged
                return curve["fraction"] * totals.get(label, math.nan)  # uniform steps
        _plot_curves(ax, train, val, x_of, palette)
        _finish_axes(ax, "seconds" if clock == "measured" else "projected seconds", target)
        ax.set_title(clock if clock == "measured" else f"projected: {clock}", fontsize=10)
        _limit_y(ax, val, train)
    for ax in axes[len(clocks):]:
        ax.set_visible(False)
    axes[0].set_ylabel("loss")
    legend(fig, axes[0])
    fig.suptitle("Loss vs time: measured here, and projected onto each network profile "
                 "(markers: validation, faint: training)", fontsize=10)
    return fig


def _limit_y(ax, val, train) -> None:
    """Clip the initial loss spike so that the end of training stays readable."""
    values = [c["value"].to_numpy() for c in (*val.values(), *train.values())]
    values = np.concatenate(values) if values else np.array([])
    values = values[np.isfinite(values)]
    if len(values) > 30:
        low, high = values.min(), np.quantile(values, 0.95)
        pad = 0.05 * (high - low) if high > low else 0.1
        ax.set_ylim(low - pad, high + pad)


def _grouped_bars(ax, table: pd.DataFrame, columns: list[str], names: list[str],
                  palette_bars: list[str]) -> None:
    n = len(columns)
    width = 0.8 / max(n, 1)
    x = np.arange(len(table))
    for i, (column, name) in enumerate(zip(columns, names, strict=True)):
        ax.bar(x + (i - (n - 1) / 2) * width, table[column].to_numpy(dtype=float), width,
               label=name, color=palette_bars[i % len(palette_bars)])
    ax.set_xticks(x, table["label"], rotation=20, ha="right", fontsize=8)
    ax.grid(axis="y", alpha=0.3)


_CLOCK_COLORS = ["#222222", "#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974", "#64b5cd"]


def throughput(comm: pd.DataFrame, profiles: list[str]) -> Figure | None:
    if comm.empty:
        return None
    clocks = ["measured", *[p for p in profiles if f"throughput.{p}" in comm]]
    fig = _figure(max(6.0, 1.2 * len(comm) * len(clocks) / 3 + 3), 4.2)
    ax = fig.add_subplot()
    _grouped_bars(ax, comm, [f"throughput.{c}" for c in clocks],
                  ["measured" if c == "measured" else f"projected: {c}" for c in clocks],
                  _CLOCK_COLORS)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(EngFormatter())
    ax.set_ylabel("tokens / s (log scale)")
    ax.set_title("Throughput: measured here, and projected per network profile")
    ax.legend(fontsize=7, ncols=2)
    return fig


def communication(comm: pd.DataFrame, profiles: list[str],
                  palette: dict[str, str]) -> Figure | None:
    if comm.empty:
        return None
    fig = _figure(13, 4.2)
    ax_bytes, ax_secs, ax_share = fig.subplots(1, 3)
    # two kinds of bytes, two bar series: logical payload and modelled wire (n/a: no bar)
    wire_known = comm["comm_wire_bytes_per_rank"].notna().any()
    _grouped_bars(ax_bytes, comm, ["comm_bytes_per_rank", "comm_wire_bytes_per_rank"],
                  ["logical payload", "modelled wire" if wire_known
                   else "modelled wire: n/a (not recorded)"], ["#4c72b0", "#dd8452"])
    ax_bytes.yaxis.set_major_formatter(EngFormatter(unit="B"))
    ax_bytes.set_title("Bytes per rank (whole run)", fontsize=10)
    ax_bytes.legend(fontsize=7)

    sec_clocks = [p for p in profiles if f"comm_s.{p}" in comm]
    _grouped_bars(ax_secs, comm, ["comm_s_total", *[f"comm_s.{p}" for p in sec_clocks]],
                  ["measured (exposed)", *sec_clocks], _CLOCK_COLORS)
    if (comm[["comm_s_total", *[f"comm_s.{p}" for p in sec_clocks]]] > 0).any().any():
        ax_secs.set_yscale("log")
    ax_secs.set_ylabel("seconds")
    ax_secs.set_title("Communication seconds (whole run)", fontsize=10)
    ax_secs.legend(fontsize=7)

    share_clocks = ["measured", *[p for p in profiles if f"comm_share.{p}" in comm]]
    _grouped_bars(ax_share, comm, [f"comm_share.{c}" for c in share_clocks], share_clocks,
                  _CLOCK_COLORS)
    ax_share.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax_share.set_ylim(0, 1)
    ax_share.set_title("Communication share of the step", fontsize=10)
    ax_share.legend(fontsize=7)
    return fig


def bytes_per_step(runs: pd.DataFrame, palette: dict[str, str]) -> Figure | None:
    """Steps: the bytes series (`comm_bytes_series`) of the first ok run of each group."""
    if "comm_bytes_series" not in runs:
        return None
    ok = runs[(runs["status"] == "ok") & runs["comm_bytes_series"].notna()]
    first = ok.drop_duplicates("group")
    if first.empty:
        return None
    fig = _figure(8, 3.6)
    ax = fig.add_subplot()
    for _, run in first.iterrows():
        steps, values = [], []
        for start, count, nbytes, *_ in run["comm_bytes_series"]:
            steps += [start, start + count]
            values += [nbytes, nbytes]
        ax.plot(steps, values, drawstyle="steps-post", linewidth=1,
                color=palette.get(run["label"]), label=run["label"])
    ax.yaxis.set_major_formatter(EngFormatter(unit="B"))
    ax.set_xlabel("step")
    ax.set_ylabel("bytes sent by a rank")
    ax.set_title("Bytes per step (largest over ranks, logical payload)", fontsize=10)
    legend(fig, ax)
    return fig


def delay_gaps(cells: pd.DataFrame) -> Figure | None:
    """Bars: gap to sync per sync reference (optimizer and mechanism), one bar per delayed
    setting (plain delay and each correction), 95% error bars.

    `cells` is bench/study/report/studies.py's delay_study table."""
    gaps = cells[cells["delay"] > 0].dropna(subset=["gap"])
    if gaps.empty:
        return None
    refs = list(dict.fromkeys(gaps["sync"]))
    settings = [("none", "delayed", "#c44e52"), ("ef", "+ EF (reconstruction)", "#4c72b0"),
                ("predict", "+ predict (reconstruction)", "#55a868")]
    settings = [s for s in settings if (gaps["correction"] == s[0]).any()]
    width = 0.8 / len(settings)
    fig = _figure(max(5.0, 1.2 * len(refs) + 2), 3.8)
    ax = fig.add_subplot()
    x = np.arange(len(refs))
    for i, (corr, label, color) in enumerate(settings):
        part = gaps[gaps["correction"] == corr].drop_duplicates("sync").set_index("sync")
        values = [part["gap"].get(r, np.nan) for r in refs]
        errors = [part["gap_ci"].get(r, np.nan) for r in refs]
        errors = [0 if not np.isfinite(e) else e for e in errors]
        ax.bar(x + (i - (len(settings) - 1) / 2) * width, values, width, yerr=errors,
               capsize=3, color=color, label=label)
    ax.axhline(0, color="grey", linewidth=1)
    ax.set_xticks(x, refs, rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("final val loss − sync")
    ax.set_title("One-step delay: validation-loss gap to the synchronous run", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def performance_profile(profile: pd.DataFrame, palette: dict[str, str]) -> Figure | None:
    """Step curves: per method, the fraction of cases within tau of the best (log tau).

    `profile` is bench/study/report/algoperf.py's performance_profile table."""
    if profile.empty:
        return None
    fig = _figure(6.5, 4.0)
    ax = fig.add_subplot()
    for i, (method, part) in enumerate(profile.groupby("method", sort=False)):
        part = part.sort_values("tau")
        ax.plot(part["tau"], part["fraction"], drawstyle="steps-post", linewidth=1.8,
                color=palette.get(method, _COLORS[i % len(_COLORS)]), label=method)
    ax.set_xscale("log")
    ax.set_xlim(1.0, float(profile["tau"].max()))
    ax.set_ylim(-0.02, 1.02)
    ticks = [t for t in (1, 1.25, 1.5, 2, 3, 4, 6, 8) if t <= profile["tau"].max()]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("τ: within this factor of the best method's median time to target")
    ax.set_ylabel("fraction of cases")
    ax.set_title("Performance profile over workloads × network profiles (misses never "
                 "within)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    legend(fig, ax, 8)
    return fig
