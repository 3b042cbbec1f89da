"""Compare runs, groups or whole sweeps: curves overlaid, differences at matched steps, and an
exit status for regression checks.

    commbench compare results/q/ddp-1a2b3c4d5e6f results/q/ddp-6f5e4d3c2b1a
    commbench compare results/before results/after --tolerance 0    # CPU: bit-exact
    commbench compare results/quickstart:ddp results/quickstart:diloco-H10 -o reports/cmp

Each argument is a run directory, a results directory (a sweep: every run in it), or
RESULTS_DIR:LABEL (the runs of one group, the label the report shows: a sweep variant plus
its grid point). The first is the reference A; each other one (B, C, ...) is compared with
it. Runs pair up one to one when both sides hold one run; by seed when both hold one
group; else by (label, seed). Before any number, what differs between paired runs is
listed: config keys (output paths, launch, checkpoint and tracking excepted: they are
not the run's identity) and the validation set (as bench/study/report/load.py names it: the id
in summary.json `val_set`, or "not recorded ..." with what an older record's config
implies), since a loss difference then has more than one cause.

The table, per group (over its seed pairs): the logged steps both runs hold; max |Δloss|,
the largest |loss_B - loss_A| over them, training and validation loss apart; final Δ,
the difference at the last matched step (mean over pairs with its 95% t-interval); the
throughput ratio B/A (tokens per second of the run's clock) and the bytes ratio B/A
(logical payload summed over ranks), geometric means with their intervals
(bench/study/report/stats.py). The figure (compare.png) overlays training and validation loss,
throughput and comm share against tokens and against the run's clock.

`--tolerance T` makes it a gate: the exit status is 1 when, for any pair, max |Δloss| of
training or of validation loss exceeds T (absolute, in nats; 0 = bit-exact), when a
pair has no step in common, or when either run of a pair did not finish ok (failed,
diverged, interrupted: the steps both logged may agree, the run did not pass); else 0.
Each pair's statuses are shown (the table's "status" column). Throughput and bytes are
reported, never gated.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from bench.config import NON_IDENTITY_KEYS, load_raw, without_keys
from bench.config.typed import flatten
from bench.run import files, records
from bench.study.report import figures, render
from bench.study.report.load import load_results
from bench.study.report.stats import mean_interval, ratio_interval

SIDES = "ABCDEFGHIJ"
LOSSES = (("loss", "train"), ("val_loss", "val"))


@dataclass
class Side:
    """One argument: its runs (load_results' table) and their logged rows."""

    name: str
    arg: str
    root: Path
    runs: pd.DataFrame
    steps: pd.DataFrame

    def run_path(self, run_id: str) -> Path:
        return self.root if run_id == self.root.name and _is_run(self.root) else \
            self.root / run_id


@dataclass
class Pair:
    group: str
    key: str
    a: dict
    b: dict
    losses: dict = field(default_factory=dict)
    """kind -> (steps matched, max |Δ|, final Δ)."""
    differences: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _is_run(path: Path) -> bool:
    return records.RunDir(path).holds_records()


def load_side(name: str, arg: str) -> Side:
    path, label = Path(arg), None
    if not path.exists() and ":" in arg:
        head, label = arg.rsplit(":", 1)
        path = Path(head)
    for link in records.linked_dirs(path) if path.is_dir() else []:
        print(f"warning: {link} is a symbolic link to a directory: not read (runs are read "
              f"only inside {arg}; give its target {os.path.realpath(link)!r} as an "
              "argument to compare it)", file=sys.stderr)
    results = load_results(path)  # ValueError naming the directory when it has no runs
    runs, steps = results.runs, results.steps
    if label is not None:
        if label not in set(runs["label"]):
            raise ValueError(f"{arg!r}: no group {label!r} in {str(path)!r} (groups: "
                             f"{sorted(set(runs['label']))})")
        runs = runs[runs["label"] == label]
        steps = steps[steps["label"] == label] if len(steps) else steps
    return Side(name, arg, path, runs.reset_index(drop=True), steps)


def pair_runs(a: Side, b: Side) -> tuple[list[Pair], list[str]]:
    """The pairs of runs to compare, and what found no partner."""
    ra, rb = a.runs.to_dict("records"), b.runs.to_dict("records")

    def group(x: dict, y: dict) -> str:
        return x["label"] if x["label"] == y["label"] else f"{x['label']} -> {y['label']}"

    if len(ra) == 1 and len(rb) == 1:
        return [Pair(group(ra[0], rb[0]), "", ra[0], rb[0])], []
    one_group = a.runs["label"].nunique() == 1 and b.runs["label"].nunique() == 1

    def key(run: dict) -> str:
        return f"seed {run['seed']}" if one_group else f"{run['label']} seed {run['seed']}"

    by_key = {key(r): r for r in rb}
    pairs = [Pair(group(r, by_key[key(r)]), key(r), r, by_key[key(r)])
             for r in ra if key(r) in by_key]
    matched = {p.key for p in pairs}
    alone = [f"{a.name} {key(r)}" for r in ra if key(r) not in matched] + \
        [f"{b.name} {k}" for k in by_key if k not in matched]
    return pairs, alone


def loss_difference(a: pd.DataFrame, b: pd.DataFrame, column: str) -> tuple[int, float, float]:
    """(steps both logged, max |b - a| over them, b - a at the last of them)."""
    def series(steps: pd.DataFrame) -> pd.Series:
        if column not in steps:
            return pd.Series(dtype=float)
        train = steps["lr"].notna() if "lr" in steps else steps[column].notna()
        rows = steps[train if column == "loss" else ~train]  # NaN losses kept: diverged
        return rows.groupby("step")[column].last()

    sa, sb = series(a), series(b)
    common = sa.index.intersection(sb.index).sort_values()
    if common.empty:
        return 0, math.nan, math.nan
    va, vb = sa[common], sb[common]
    delta = (vb - va).where(~((va == vb) | (va.isna() & vb.isna())), 0.0)
    delta = delta.fillna(math.inf)  # one run's loss NaN where the other's is not: no match
    return len(common), float(delta.abs().max()), float(delta.iloc[-1])


def differences(a_path: Path, b_path: Path) -> list[str]:
    """Config keys that differ, A -> B (the run's identity only: not output paths, launch,
    checkpoint or tracking)."""
    def config(path: Path) -> dict:
        try:
            data = load_raw(records.RunDir(path).config)
        except ValueError:
            return {}
        return flatten(without_keys(data, NON_IDENTITY_KEYS))

    ca, cb = config(a_path), config(b_path)
    return [f"{k}: {ca.get(k, '(unset)')} -> {cb.get(k, '(unset)')}"
            for k in sorted(ca.keys() | cb.keys()) if ca.get(k) != cb.get(k)]


def compare_pair(pair: Pair, a: Side, b: Side) -> None:
    steps_a = a.steps[a.steps["run_id"] == pair.a["run_id"]] if len(a.steps) else a.steps
    steps_b = b.steps[b.steps["run_id"] == pair.b["run_id"]] if len(b.steps) else b.steps
    for column, kind in LOSSES:
        pair.losses[kind] = loss_difference(steps_a, steps_b, column)
    pair.differences = differences(a.run_path(pair.a["run_id"]), b.run_path(pair.b["run_id"]))
    va, vb = pair.a.get("val_set"), pair.b.get("val_set")  # named by report/load.py
    if va != vb:
        pair.differences.append(f"validation set: {va} -> {vb}")
    elif str(va).startswith("not recorded"):
        pair.notes.append(f"validation set {va}")


def _ratio(pairs: list[Pair], column: str):
    num = {p.key or i: p.b.get(column) for i, p in enumerate(pairs)}
    den = {p.key or i: p.a.get(column) for i, p in enumerate(pairs)}
    if all(n == 0 and d == 0 for n, d in zip(num.values(), den.values(), strict=True)):
        return render.ratio_ci(1.0, math.nan, math.nan, len(pairs)), 1.0  # no traffic either
    ci = ratio_interval(num, den)
    return render.ratio_ci(ci.estimate, ci.low, ci.high, ci.n), ci.estimate


def _signed(ci) -> str:
    if not math.isfinite(ci.estimate):
        return "—"
    text = "0" if ci.estimate == 0 else f"{ci.estimate:+.3g}"
    if math.isfinite(ci.low):
        text += f" ± {ci.half_width:.2g}" + (" n<3" if ci.n < 3 else "")
    return text


def table(pairs: list[Pair]) -> tuple[pd.DataFrame, list[dict]]:
    """One row per group: display strings, and the numbers (for compare.json)."""
    shown, numbers = [], []
    for group in dict.fromkeys(p.group for p in pairs):
        part = [p for p in pairs if p.group == group]
        row = {"group": group, "pairs": len(part)}
        num = {"group": group, "pairs": len(part)}
        for _, kind in LOSSES:
            matched = min(p.losses[kind][0] for p in part)
            worst = max((p.losses[kind][1] for p in part), default=math.nan,
                        key=lambda v: -1 if math.isnan(v) else v)
            final = mean_interval(p.losses[kind][2] for p in part)
            name = "loss" if kind == "train" else "val"
            row["steps" if kind == "train" else "val steps"] = matched
            row[f"max |Δ{name}|"] = render.num(worst, 3)
            row[f"final Δ{name}"] = _signed(final)
            num.update({f"{kind}_steps": matched, f"{kind}_max_abs_delta": worst,
                        f"{kind}_final_delta": final.estimate})
        row["status"] = ", ".join(dict.fromkeys(f"{p.a.get('status')} -> {p.b.get('status')}"
                                                for p in part))
        num["status"] = [[p.a.get("status"), p.b.get("status")] for p in part]
        row["throughput B/A"], num["throughput_ratio"] = _ratio(part, "throughput_tokens_per_s")
        row["bytes B/A"], num["bytes_ratio"] = _ratio(part, "comm_bytes_total")
        shown.append(row)
        numbers.append(num)
    return pd.DataFrame(shown), numbers


def exceeds(pair: Pair, tolerance: float, names: tuple[str, str] = ("A", "B")) -> str | None:
    """Why the pair fails the gate, or None."""
    for name, run in zip(names, (pair.a, pair.b), strict=True):
        if run.get("status") != "ok":
            return f"{name}'s run {run.get('run_id')} did not finish ok: {_status(run)}"
    for _, kind in LOSSES:
        matched, worst, _ = pair.losses[kind]
        if kind == "train" and matched == 0:
            return "no training step in common"
        if matched and worst > tolerance:
            return f"max |Δ{kind}| {worst:.3g} > tolerance {tolerance:g}"
    return None


def compare(args: list[str], out_dir: str | os.PathLike | None = None,
            tolerance: float | None = None) -> int:
    """`commbench compare`: prints the differences and the table, writes compare.png and
    compare.json under `out_dir`; returns the exit status (module docstring)."""
    if len(args) < 2:
        raise ValueError(f"compare needs at least two runs, groups or sweeps, got {len(args)}")
    if len(args) > len(SIDES):
        raise ValueError(f"compare takes at most {len(SIDES)} arguments, got {len(args)}")
    if tolerance is not None and not 0 <= tolerance < math.inf:
        raise ValueError(f"--tolerance must be a finite number >= 0 (absolute loss, nats), "
                         f"got {tolerance}")
    sides = [load_side(name, arg) for name, arg in zip(SIDES, args, strict=False)]
    ref = sides[0]
    for side in sides:
        print(f"{side.name} = {side.arg} ({len(side.runs)} run{'s' * (len(side.runs) != 1)})")
        for run in side.runs.to_dict("records"):
            if run.get("status") != "ok":
                print(f"  {side.name} {run.get('run_id')}: {_status(run)}")
    report, failures = {"sides": {s.name: s.arg for s in sides}, "comparisons": []}, []
    for other in sides[1:]:
        pairs, alone = pair_runs(ref, other)
        if not pairs:
            raise ValueError(f"{ref.name} and {other.name} have no runs to pair (runs pair by "
                             "label and seed; compare one run with one run, or a group with "
                             "a group: DIR:LABEL)")
        for pair in pairs:
            compare_pair(pair, ref, other)
        print(f"\n{other.name} vs {ref.name}: {len(pairs)} pair{'s' * (len(pairs) != 1)}")
        _print_differences(pairs)
        if alone:
            print("  without a partner: " + ", ".join(alone))
        shown, numbers = table(pairs)
        print(shown.to_string(index=False))
        for pair in pairs:
            why = exceeds(pair, tolerance, (ref.name, other.name)) \
                if tolerance is not None else None
            if why:
                failures.append(f"{other.name} vs {ref.name} {pair.group} {pair.key}: {why}")
        report["comparisons"].append({"side": other.name, "groups": numbers,
                                      "unpaired": alone,
                                      "differences": {f"{p.group} {p.key}".strip():
                                                      p.differences for p in pairs}})
    out = Path(out_dir or "reports/compare")
    out.mkdir(parents=True, exist_ok=True)
    figures.save(overlay(sides), out / "compare.png")
    report["tolerance"], report["exceeded"] = tolerance, failures
    files.write_json(out / "compare.json", report)
    print(f"\nfigure: {out / 'compare.png'}")
    if tolerance is not None:
        for line in failures:
            print(f"EXCEEDED {line}")
        print(f"tolerance {tolerance:g} on max |Δloss| (training and validation), every "
              f"run ok: {'failed' if failures else 'within'}")
    return 1 if failures else 0


def _status(run: dict) -> str:
    """A run's status with its error, as the report names them."""
    error = run.get("error")
    text = str(run.get("status"))
    if isinstance(error, str) and error:
        text += f" ({' '.join(error.split())[:160]})"
    return text


def _print_differences(pairs: list[Pair]) -> None:
    """Each distinct set of differences once, with the pairs it applies to."""
    seen: dict[tuple, list[str]] = {}
    for pair in pairs:
        seen.setdefault(tuple(pair.differences), []).append(f"{pair.group} {pair.key}".strip())
    for diff, which in seen.items():
        if not diff:
            continue
        where = "" if len(which) == len(pairs) else f" ({', '.join(which)})"
        print(f"  differences{where}, compared anyway:")
        for line in diff:
            print(f"    {line}")
    if not any(seen):
        print("  same config and validation set")
    for note in dict.fromkeys(n for p in pairs for n in p.notes):
        print(f"  note: {note}")


# ------------------------------------------------------------------------------ figure

PANELS = (("loss", "tokens", "training loss"), ("val_loss", "tokens", "validation loss"),
          ("throughput", "tokens", "throughput (tokens/s)"),
          ("loss", "elapsed_s", "training loss"), ("val_loss", "elapsed_s", "validation loss"),
          ("comm_share", "elapsed_s", "comm share"))
STYLES = ("-", "--", ":", "-.")


def curves(steps: pd.DataFrame) -> pd.DataFrame:
    """A run's rows with the per-row throughput (tokens / run clock since the previous
    training row) and comm share (comm_s / step_s) added to its training rows."""
    steps = steps.sort_values("step")
    train = steps[steps["loss"].notna()] if "loss" in steps else steps.iloc[0:0]
    steps = steps.copy()
    d_tokens = train["tokens"].diff().fillna(train["tokens"])
    d_time = train["elapsed_s"].diff().fillna(train["elapsed_s"])
    steps.loc[train.index, "throughput"] = (d_tokens / d_time.where(d_time > 0)).to_numpy()
    steps.loc[train.index, "comm_share"] = (train["comm_s"] / train["step_s"].where(
        train["step_s"] > 0)).to_numpy()
    return steps


def overlay(sides: list[Side]):
    """Each run's curves; color by group (by side when every side is one group), line
    style by side."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from bench.study.report.figures import colors

    labels = list(dict.fromkeys(label for s in sides for label in s.runs["label"]))
    by_side = len(labels) == 1 or all(s.runs["label"].nunique() == 1 for s in sides)
    palette = colors([s.name for s in sides] if by_side else labels)
    fig = Figure(figsize=(15, 8.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3).ravel()
    for i, side in enumerate(sides):
        for run in side.runs.itertuples():
            rows = side.steps[side.steps["run_id"] == run.run_id] if len(side.steps) else None
            if rows is None or rows.empty:
                continue
            rows = curves(rows)
            color = palette[side.name if by_side else run.label]
            name = f"{side.name}: {run.label} seed {run.seed}"
            for ax, (y, x, _) in zip(axes, PANELS, strict=True):
                if y not in rows:
                    continue
                part = rows[rows[y].notna()]
                ax.plot(part[x], part[y], STYLES[i % len(STYLES)], color=color, lw=1.4,
                        label=name, marker="o" if y == "val_loss" else None, ms=3)
    for ax, (_, x, title) in zip(axes, PANELS, strict=True):
        ax.set_title(title)
        ax.set_xlabel("tokens" if x == "tokens" else "seconds (the run's clock)")
        ax.grid(alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, loc="outside lower center", ncols=min(4, len(names)),
                   fontsize=8)
    fig.suptitle(" vs ".join(f"{s.name} = {s.arg}" for s in sides), fontsize=10)
    return fig
