"""Whether a run's compute, and so its projections, held waits for a CPU core.

    commbench report results/quickstart -o reports/quickstart   # marks such runs

Ranks that share cores (4 gloo ranks on 2 cores) wait for a core. A run whose compute was
measured on the wall clock (summary.json `compute_clock: wall`, and every record from
before `compute_clock` was recorded) counts those waits as compute, and the projections
price that compute on every network profile: such projections are not contention-free
and the report marks every projected figure of the run (‡). A run whose compute is CPU
time (`thread_cpu`: CPU time does not run while a thread waits for a
core) projects fine, but its measured clock (wall seconds, throughput, measured speedups)
still shares cores: the report marks its measured figures (†). GPU runs (CUDA, one
device per rank) record no ranks per core and are never marked.

Ranks per core come from summary.json `ranks_per_core` (bench/env.py: this node's ranks
over the cores they may use; null on a GPU). A record without it: the node's ranks
(world size / launch.nnodes) over env.json's `cpu_count` (all of the machine's cores,
which the job may not have had: a lower bound), on a CPU device; "unknown" when env.json
has no count.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from algorithms.clocks import CONTENTION_FREE

CPU_CLOCKS = CONTENTION_FREE
"""compute_clock values measured on CPU time: free of waiting for a core."""
PROJECTED_MARK, MEASURED_MARK = "‡", "†"


def _number(value: Any) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) and value > 0 else math.nan


def _device(summary: dict, env: dict, config: dict) -> str:
    parallel = config.get("parallel") if isinstance(config.get("parallel"), dict) else {}
    for value in (summary.get("device"), env.get("device"), parallel.get("device")):
        if isinstance(value, str) and value and value != "auto":
            return value
    return "unknown"


def run_columns(summary: dict | None, config: dict, env: dict | None) -> dict[str, Any]:
    """A run's `compute_clock` ("wall" where the record has none), whether it was recorded
    (`compute_clock_recorded`), `ranks_per_core` (NaN: none or unknown) and where that
    came from (`ranks_per_core_source`: "recorded", "GPU", "env.json cpu_count",
    "unknown")."""
    summary, env = summary or {}, env if isinstance(env, dict) else {}
    clock = summary.get("compute_clock")
    recorded = isinstance(clock, str) and bool(clock)
    out = {"compute_clock": clock if recorded else "wall", "compute_clock_recorded": recorded}
    value = _number(summary.get("ranks_per_core"))
    device = _device(summary, env, config)
    if math.isfinite(value):
        return {**out, "ranks_per_core": value, "ranks_per_core_source": "recorded"}
    if device.startswith("cuda") or (recorded and "ranks_per_core" in summary):
        # null recorded next to compute_clock: a GPU run (bench/env.py ranks_per_core)
        return {**out, "ranks_per_core": math.nan, "ranks_per_core_source": "GPU"}
    launch = config.get("launch") if isinstance(config.get("launch"), dict) else {}
    nodes = _number(launch.get("nnodes")) if launch.get("nnodes") is not None else 1.0
    world = _number(summary.get("world_size"))
    world = world if math.isfinite(world) else _number(env.get("world_size"))
    cores = _number(env.get("cpu_count"))
    if math.isfinite(world) and math.isfinite(cores) and math.isfinite(nodes):
        return {**out, "ranks_per_core": world / nodes / cores,
                "ranks_per_core_source": "env.json cpu_count"}
    return {**out, "ranks_per_core": math.nan, "ranks_per_core_source": "unknown"}


def flags(runs: pd.DataFrame) -> pd.DataFrame:
    """Per run (index as `runs`): `projections_contended` (ranks per core > 1 and compute
    not on CPU time), `measured_contended` (ranks per core > 1), `contention_unknown` (a
    CPU run whose ranks per core nobody knows)."""
    rpc = runs.get("ranks_per_core", pd.Series(math.nan, index=runs.index)).astype(float)
    clock = runs.get("compute_clock", pd.Series("wall", index=runs.index)).fillna("wall")
    source = runs.get("ranks_per_core_source", pd.Series("unknown", index=runs.index))
    shared = rpc > 1
    return pd.DataFrame({
        "projections_contended": shared & ~clock.isin(CPU_CLOCKS),
        "measured_contended": shared,
        "contention_unknown": source == "unknown",
    }, index=runs.index)


def own_marks(runs: pd.DataFrame) -> dict[tuple, tuple[str, str]]:
    """(sweep, label) -> (measured mark, projected mark) of a group's own figures
    (throughput): a mark when any of its runs shares cores."""
    marked = runs.join(flags(runs))
    return {key: (MEASURED_MARK if part["measured_contended"].any() else "",
                  PROJECTED_MARK if part["projections_contended"].any() else "")
            for key, part in marked.groupby(["sweep", "label"], sort=False)}


def group_marks(runs: pd.DataFrame, speedup: pd.DataFrame) -> dict[tuple, tuple[str, str]]:
    """(sweep, label) -> (measured mark, projected mark) of a group's times and speedups:
    a mark when any of its runs, or of its baseline's (a speedup prices both), shares
    cores."""
    own = own_marks(runs)
    out = {}
    for row in speedup.drop_duplicates(["sweep", "label"]).itertuples():
        mine = own.get((row.sweep, row.label), ("", ""))
        base = own.get((row.sweep, row.baseline), ("", ""))
        out[(row.sweep, row.label)] = (mine[0] or base[0], mine[1] or base[1])
    return out


def _rates(part: pd.DataFrame) -> str:
    values = sorted({round(v, 2) for v in part["ranks_per_core"] if math.isfinite(v)})
    text = ", ".join(f"{v:g}" for v in values)
    sources = set(part["ranks_per_core_source"])
    lower = " (from env.json's cpu_count: at least)" if "env.json cpu_count" in sources else ""
    return f"{text} ranks per core{lower}"


def _names(part: pd.DataFrame) -> str:
    return ", ".join(f"`{label}`" for label in dict.fromkeys(part["label"]))


def first_screen(runs: pd.DataFrame) -> list[str]:
    """The sentences the report's first screen says about contention ([] when none)."""
    marked = runs.join(flags(runs))
    out = []
    proj = marked[marked["projections_contended"]]
    if len(proj):
        clocks = ", ".join(sorted({"wall (not recorded: an older record)"
                                   if not r else "wall" for r in
                                   proj["compute_clock_recorded"]}))
        out.append(
            f"**The projections of {len(proj)} of {len(runs)} runs ({_names(proj)}) are not "
            f"contention-free:** they ran {_rates(proj)} and measured compute on the "
            f"{clocks} clock, so their compute holds waits for a core, priced on every "
            f"network profile. Every projected figure of these runs, and of the groups "
            f"compared with them, is marked {PROJECTED_MARK}: read it as biased, not as a "
            "result. Rerun with ranks ≤ cores, or with a build that records "
            "`compute_clock: thread_cpu`.")
    measured = marked[marked["measured_contended"]]
    if len(measured):
        out.append(
            f"The measured clock of {len(measured)} of {len(runs)} runs ({_names(measured)}) "
            f"shares cores ({_rates(measured)}): their measured times, throughputs and "
            f"measured speedups hold waits for a core and are marked {MEASURED_MARK}.")
    unknown = marked[marked["contention_unknown"]]
    if len(unknown):
        out.append(
            f"Whether {len(unknown)} runs ({_names(unknown)}) shared cores is unknown: their "
            "records hold neither `ranks_per_core` nor a CPU count (env.json), and their "
            "compute was measured on the wall clock.")
    return out


def caption(runs: pd.DataFrame) -> str:
    """What a figure's caption adds about the runs drawn that shared cores ("" if none)."""
    marked = runs.join(flags(runs))
    parts = []
    proj = marked[marked["projections_contended"]]
    if len(proj):
        parts.append(f" {PROJECTED_MARK} The projected curves or bars of {_names(proj)} are "
                     "not contention-free (compute on the wall clock, ranks sharing cores).")
    measured = marked[marked["measured_contended"]]
    if len(measured):
        parts.append(f" {MEASURED_MARK} The measured ones of {_names(measured)} ran with "
                     "ranks sharing cores.")
    return "".join(parts)
