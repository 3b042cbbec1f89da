"""`commbench whatif`: price each method of a scenario over a bandwidth range.

Per method (bench/study/whatif/scenario.py builds its run config): the model's facts
(bench/study/whatif/engine.py `traffic_facts`, or `synthetic_facts` for a size-only model), the
strategy's own traffic description (its class's `traffic`: algorithms/base.py
`strategy_of(cfg).traffic(cfg, facts)`), one `plan`, priced at every
bandwidth of the sweep (`price` on the profile with the swept tier replaced). Reported:
step time, exposed communication, compute utilisation and time for the token budget at
`network.at`; the bandwidth needed for each target utilisation (bisection,
`bandwidth_for`); utilisation against bandwidth as a figure. Every assumption is listed
with the result (`assumptions`). A measured run's own what-if
(`measured_whatif`, `commbench whatif --run`) and the bandwidth it needs for a target
utilisation on its first profile (`measured_bandwidth_for`: the sweep report's column,
bench/study/report/planner.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from algorithms.base import strategy_of
from bench.network.profiles import parse_bandwidth
from bench.study.whatif import assume
from bench.study.whatif.assume import restate, speed_of
from bench.study.whatif.engine import (
    Compute,
    Plan,
    bandwidth_for,
    plan,
    price,
    synthetic_facts,
    traffic_facts,
    with_tier,
)
from bench.study.whatif.scenario import (
    Scenario,
    bandwidth_range,
    base_profile,
    method_config,
    profile_at,
    tokens_per_step,
)


@dataclass
class MethodResult:
    name: str
    strategy: str
    world: int
    steps: int
    compute_step_s: float
    at: dict
    """step_s, comm_s, utilisation, total_s at `network.at`."""
    needed: dict[float, float]
    """target utilisation -> bandwidth (bytes/s); inf: not reached in the range."""
    curve: list[tuple[float, float]]
    """(bandwidth bytes/s, utilisation)."""
    notes: list[str]


def step_compute_s(s: Scenario, cfg, flops: float) -> float:
    """One GPU's compute seconds for a full data-parallel step of `data.batch_size`
    sequences: given, or FLOPs / (peak x MFU), or FLOPs / a measured run's FLOP/s."""
    h = s.hardware
    if h.compute_s_per_step is not None:
        return h.compute_s_per_step
    step_flops = flops * cfg.data.batch_size * cfg.model.seq_len
    if h.run is not None:
        return step_flops / measured_flops_per_s(h.run)
    peak = h.peak_flops
    if peak is None and h.gpu is not None:
        from bench.env import PEAK_FLOPS

        if h.gpu not in PEAK_FLOPS:
            raise ValueError(f"hardware.gpu must be one of {sorted(PEAK_FLOPS)}, got {h.gpu!r}")
        peak = PEAK_FLOPS[h.gpu]["bf16" if cfg.model.precision == "bf16" else "fp32"]
    if peak is None:
        raise ValueError("hardware: give gpu, peak_flops, compute_s_per_step or run")
    return step_flops / (peak * h.mfu)


def measured_flops_per_s(run_dir: str) -> float:
    """A run's achieved FLOP/s per rank: its FLOPs per step over the median compute of
    its most frequent step kind that reads a batch (rank 0's)."""
    from bench.study.whatif.scenario import run_summary

    config, summary = run_summary(run_dir)
    kinds = {k: v for k, v in summary["compute_per_step"].items()
             if not k.startswith("no batch") and v["median_s"][0]}
    if not kinds or not summary.get("flops_per_token"):
        raise ValueError(f"hardware.run={run_dir!r}: no measured step that reads a batch, or "
                         "no flops_per_token in its summary.json")
    kind = max(kinds, key=lambda k: kinds[k]["steps"][0])
    tokens = config["data"]["batch_size"] * config["model"]["seq_len"]
    return summary["flops_per_token"] * tokens / kinds[kind]["median_s"][0]


def model_facts(cfg, cache: dict | None = None) -> tuple:
    """(TrafficFacts, FLOPs per token) of `cfg`'s model from one meta-device build, kept in
    `cache` for methods that share the model, batch and microbatches."""
    from bench.memory import _meta_model

    key = (repr(cfg.model), cfg.data.batch_size, cfg.parallel.num_microbatches)
    if cache is not None and key in cache:
        return cache[key]
    model = _meta_model(cfg)
    out = traffic_facts(cfg, model), model.flops_per_token()
    if cache is not None:
        cache[key] = out
    return out


def method_plan(s: Scenario, name: str, profile, models: dict | None = None) -> tuple:
    """(run config, Plan, compute seconds per step, FLOPs per token) of method `name`
    (`models`: `model_facts`' cache)."""
    cfg = method_config(s, name)
    size = s.model_size
    if size.num_params is not None:
        if cfg.parallel.num_stages > 1:
            raise ValueError(f"methods.{name}: a size-only model (model_size.num_params) has "
                             "no layers or hidden size to cut into pipeline stages; give "
                             "base.model instead")
        facts = synthetic_facts(int(size.num_params), size.n_layer)
        flops = size.flops_per_token or 6 * size.num_params
    else:
        facts, flops = model_facts(cfg, models)
    compute_s = step_compute_s(s, cfg, flops)
    traffic = restate(strategy_of(cfg).traffic(cfg, facts), s.assume.exchange_dtype,
                      s.assume.dp_overlap)
    speed = (speed_of(s.hardware.replica_speed, s.world.gpus_per_replica)
             if s.hardware.replica_speed else None)
    try:
        p = plan(traffic, Compute(step_s=compute_s, backward_share=s.hardware.backward_share,
                                  speed=speed),
                 cfg.parallel.world_size, s.world.gpus_per_node, profile)
    except ValueError as err:
        raise ValueError(f"methods.{name}: {err}") from None
    return cfg, p, compute_s, flops


def evaluate(s: Scenario) -> list[MethodResult]:
    """Every method of the scenario over the bandwidth sweep."""
    profile, swept = base_profile(s)
    low, high = bandwidth_range(s)
    at = high if s.network.at is None else parse_bandwidth(s.network.at, "network.at")
    n = s.network.points
    grid = [low * (high / low) ** (i / (n - 1)) for i in range(n)] if n > 1 else [high]
    results, models = [], {}
    for name in s.methods:
        cfg, p, compute_s, flops = method_plan(s, name, profile, models)
        cache: dict[float, object] = {}

        def priced(bandwidth: float, p: Plan = p, cache: dict = cache):
            if bandwidth not in cache:
                cache[bandwidth] = price(p, profile_at(s, profile, swept, bandwidth),
                                         s.network.model)
            return cache[bandwidth]

        curve = [(b, priced(b).utilisation) for b in grid]
        needed = {}
        for target in s.targets:  # bracket by the curve, then bisect
            above = [b for b, u in curve if u >= target]
            hi = min(above) if above else high
            below = [b for b, u in curve if u < target and b < hi]
            lo = max(below) if below else low
            needed[target] = bandwidth_for(target, lambda b: priced(b).utilisation, lo, hi)
        r = priced(at)
        results.append(MethodResult(
            name, cfg.strategy.name, cfg.parallel.world_size, p.steps, compute_s,
            {"bandwidth_Bps": at, "step_s": r.step_s, "comm_s": r.comm_s,
             "utilisation": r.utilisation, "total_s": r.total_s,
             "no_overlap_step_s": r.no_overlap_s / r.steps},
            needed, curve, p.notes + [f"compute {compute_s:.4g} s per step "
                                      f"({flops:.4g} FLOPs per token), "
                                      f"{tokens_per_step(cfg):,} tokens per step"]))
    return results


def assumptions(s: Scenario) -> list[str]:
    """What every method's projection assumes, in words."""
    w, net, a = s.world, s.network, s.assume
    sites = (f"{w.nodes_per_site} nodes per site, sites joined by the swept link"
             if w.nodes_per_site else "one site: the swept link joins the nodes")
    if w.slow_nodes:
        sites += (f"; node(s) {', '.join(map(str, w.slow_nodes))} slow: every link touching "
                  f"them at {w.slow_share:g} x the swept bandwidth (world.slow_nodes)")
    size = s.model_size
    model = (f"a size-only model of {size.num_params:.4g} parameters in {size.n_layer} equal "
             "blocks" if size.num_params else "the model of base.model, measured on the meta "
             "device")
    h = s.hardware
    compute = (f"{h.compute_s_per_step} s per step, given (hardware.compute_s_per_step)"
               if h.compute_s_per_step else
               f"FLOPs / the measured FLOP/s of {h.run} (hardware.run)" if h.run else
               f"FLOPs / ({h.gpu or h.peak_flops} peak x MFU {h.mfu}) (hardware.mfu)")
    speeds = (f"; replica speeds {h.replica_speed} relative to it (hardware.replica_speed; "
              "the rest 1): ranks wait for the slowest where they communicate, and "
              "utilisation counts the straggler's compute as compute" if h.replica_speed
              else "")
    batch = s.base.get("data", {}).get("batch_size")
    tokens = (f"tokens per step {a.tokens_per_step:.4g} (assume.tokens_per_step), each "
              "method's per-GPU batch derived from it" if a.tokens_per_step else
              f"tokens per step = data.batch_size ({batch}) x seq_len x the data-parallel "
              "GPUs, the same per-GPU batch for every method (each method's figure in "
              "its notes); steps = the token budget over it")
    return [
        model, f"compute per step: {compute}; backward {h.backward_share:.3g} of it{speeds}",
        *assume.lines(a.exchange_dtype, a.dp_overlap, tokens),
        f"{w.gpus_per_node} GPUs per node over {net.profile}'s intra tier; {sites}",
        f"collectives priced with the {net.model} model (docs/network-model.md), "
        "the swept link's bandwidth per node shared by concurrent flows",
        "steady state: one period of each phase priced after one that warms the links; "
        "ranks wait for each other only at steps where one of them communicates",
    ]


def _bw(bps: float) -> str:
    if math.isinf(bps):
        return "> range"
    gbit = bps * 8 / 1e9
    return f"{gbit:.3g} Gbit/s" if gbit < 1000 else f"{gbit:,.0f} Gbit/s"


def format_bandwidth(bps: float, low: float, high: float) -> str:
    """A needed bandwidth (bytes/s, `bandwidth_for`'s answer over [low, high]) as the
    what-if prints it: Gbit/s; "> HIGH" when the range falls short, "≤ LOW" when its low
    end already reaches the target."""
    if math.isinf(bps):
        return f"> {_bw(high)}"
    if bps <= low:
        return f"≤ {_bw(low)}"
    return _bw(bps)


def table_rows(s: Scenario, results: list[MethodResult]):
    """One row per method (a DataFrame of display strings): GPUs, step time, exposed
    communication, utilisation and time for the token budget at `network.at`, the
    bandwidth for each target utilisation."""
    import pandas as pd

    head = ["method", "GPUs", "step s", "exposed comm s", "utilisation",
            f"time for {s.tokens:.3g} tokens", *(f"bw for {t:.0%}" for t in s.targets)]
    rows = [[r.name, str(r.world), f"{r.at['step_s']:.4g}", f"{r.at['comm_s']:.3g}",
             f"{r.at['utilisation']:.1%}", f"{r.at['total_s'] / 3600:.3g} h",
             *(_bw(r.needed[t]) for t in s.targets)] for r in results]
    return pd.DataFrame(rows, columns=head)


def notes(s: Scenario, results: list[MethodResult]) -> list[str]:
    """The assumptions, then each method's own notes ("method: note"), in words."""
    return [*assumptions(s), *(f"{r.name}: {note}" for r in results for note in r.notes)]


def at_bandwidth(results: list[MethodResult]) -> str:
    """The bandwidth the table's step times are given at, as printed."""
    return _bw(results[0].at["bandwidth_Bps"] if results else 0)


def table(s: Scenario, results: list[MethodResult]) -> str:
    """The printed result and whatif.md: assumptions, then one row per method. Every text
    from the scenario (its name, profile path, method names, run directory) is escaped
    as the report's pages are (bench/study/report/render.py `md_text`, `markdown_table`): a
    scenario file travels, and markdown renderers keep inline HTML."""
    from bench.study.report.render import markdown_table, md_text

    def item(text: str) -> str:
        return "- " + md_text(" ".join(str(text).split()))

    lines = [f"# what-if: {md_text(s.name)} (at {at_bandwidth(results)})", "",
             "Assumptions:"]
    lines += [item(a) for a in notes(s, results)]
    lines += ["", markdown_table(table_rows(s, results))]
    return "\n".join(lines)


def figure(s: Scenario, results: list[MethodResult]):
    """Utilisation against bandwidth (log axis), one line per method."""
    from matplotlib.ticker import PercentFormatter

    from bench.study.report.figures import _figure, colors

    fig = _figure(6.4, 4.2)
    ax = fig.add_subplot()
    palette = colors([r.name for r in results])
    for r in results:
        ax.plot([b * 8 / 1e9 for b, _ in r.curve], [u for _, u in r.curve],
                label=r.name, color=palette[r.name])
    ax.set_xscale("log")
    ax.set_xlabel("bandwidth of the swept link (Gbit/s)")
    ax.set_ylabel("compute utilisation")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(s.name)
    return fig


def write(s: Scenario, results: list[MethodResult], out_dir: str | Path) -> Path:
    """whatif.md (the table), whatif.json (every number) and whatif.png under `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "whatif.md").write_text(table(s, results) + "\n")
    (out / "whatif.json").write_text(json.dumps({
        "assumptions": assumptions(s),
        "methods": [{"name": r.name, "strategy": r.strategy, "world": r.world,
                     "steps": r.steps, "compute_step_s": r.compute_step_s, "at": r.at,
                     "bandwidth_needed_Bps": {str(t): (None if math.isinf(b) else b)
                                              for t, b in r.needed.items()},
                     "curve": r.curve, "notes": r.notes} for r in results]}, indent=1))
    figure(s, results).savefig(out / "whatif.png")
    return out


def run_whatif(run_dir: str | Path) -> dict[str, dict]:
    """A measured run's own what-if (`measured_whatif`) from its run directory."""
    from bench.config import from_dict
    from bench.study.whatif.scenario import run_summary

    config, summary = run_summary(run_dir)
    return measured_whatif(from_dict(config), summary)


def settles(cfg) -> frozenset[int]:
    """Step counts at which the loop settles its clocks (bench/run/train.py: warm-up end,
    metrics and validation rows, periodic checkpoints, the end): the projections close
    their stretches there, so a measured run's what-if does too."""
    from bench.run.checkpoint import interval

    r, every = cfg.run, interval(cfg)
    out = {r.steps, min(r.warmup_steps, r.steps)} - {0}
    for period in (r.log_every, r.val_every, every):
        if period:
            out.update(range(period, r.steps + 1, period))
    return frozenset(out)


def _measured(cfg, summary: dict):
    """A measured run's own what-if, the pieces every use shares: (a function pricing
    profile -> its `Plan`, the collective model's backend). Each rank's median compute per
    step kind (summary.json `compute_per_step`), the strategy's traffic description
    (`strategy_of(cfg).traffic`), every step priced (`exact`), cut where the loop settles
    its clocks (`settles`). A plan depends on the profile only through its symmetry, so
    one made on a profile serves it with its inter tier swapped (`with_tier`)."""
    world = cfg.parallel.world_size
    medians = [{k: v["median_s"][rank] for k, v in summary["compute_per_step"].items()
                if v["median_s"][rank] is not None} for rank in range(world)]
    backend = (summary.get("projection_model") or "gloo").split()[0]
    traffic = strategy_of(cfg).traffic(cfg, traffic_facts(cfg))

    def plan_on(profile) -> Plan:
        return plan(traffic, Compute(measured=medians), world, summary["ranks_per_node"],
                    profile, exact=True, cuts=settles(cfg))
    return plan_on, backend


def measured_whatif(cfg, summary: dict) -> dict[str, dict]:
    """A measured run's own what-if: its config, model, world and profiles, each rank's
    median compute per step kind (summary.json `compute_per_step`), every step priced
    (`exact`). Per profile: the what-if's total seconds beside the run's recorded
    `projected_robust` (the same model on the same inputs: equal within rounding, a
    check that the strategy's traffic description says what its code sends)."""
    from bench.network import get_profile

    plan_on, backend = _measured(cfg, summary)
    out = {}
    for name in cfg.network.profiles:
        profile = get_profile(name)
        r = price(plan_on(profile), profile, backend)
        recorded = (summary.get("projected_robust") or {}).get(name, {}).get("total_s")
        out[name] = {"whatif_s": r.total_s, "recorded_s": recorded,
                     "utilisation": r.utilisation}
    return out


MEASURED_RANGE = ("10Mbit/s", "1Tbit/s")
"""The inter-node bandwidths `measured_bandwidth_for` sweeps (the sweep report's column):
wide, since a CPU run's compute per step is far from a GPU's."""


def measured_range(bandwidths: tuple = MEASURED_RANGE) -> tuple[float, float]:
    """`bandwidths` (low, high) in bytes/s."""
    return tuple(parse_bandwidth(b, f"bandwidths[{i}]") for i, b in enumerate(bandwidths))


@dataclass
class MeasuredBandwidth:
    """The bandwidth a measured run needs for a target utilisation (`measured_bandwidth_for`)."""

    bandwidth_Bps: float
    """Bytes/s of the swept tier: math.inf when even `high_Bps` falls short; `low_Bps`
    when `low_Bps` already reaches the target (`bandwidth_for`)."""
    target: float
    profile: str
    """The run's first network profile, whose inter-node tier is swept."""
    low_Bps: float
    high_Bps: float
    utilisation_at_high: float
    """The utilisation at `high_Bps`: below the target, what no bandwidth in the range
    buys (latency, or traffic that cannot overlap, bounds it)."""

    def text(self) -> str:
        return format_bandwidth(self.bandwidth_Bps, self.low_Bps, self.high_Bps)


def measured_bandwidth_for(cfg, summary: dict, target: float = 0.9,
                           bandwidths: tuple = MEASURED_RANGE) -> MeasuredBandwidth:
    """The smallest bandwidth of the inter-node tier of the run's first network profile
    (`with_tier`, swept over `bandwidths`) at which the run's own what-if (as
    `measured_whatif` prices it: its measured compute per step kind, world, ranks per
    node and traffic description) reaches `target` utilisation (`bandwidth_for`).
    Compute is what the run measured on its machine: for a CPU run, the bandwidth at which
    *that* compute stays `target` busy. ValueError when the run names no profile or all
    its ranks share one node (no traffic crosses the swept tier)."""
    from bench.network import get_profile

    if not cfg.network.profiles:
        raise ValueError("the run names no network profile (network.profiles) to sweep")
    world, per_node = cfg.parallel.world_size, summary["ranks_per_node"]
    if world <= per_node:
        raise ValueError(f"its {world} ranks share one node (ranks_per_node {per_node}): no "
                         "traffic crosses the swept inter-node tier")
    low, high = measured_range(bandwidths)
    name = cfg.network.profiles[0]
    profile = get_profile(name)
    plan_on, backend = _measured(cfg, summary)
    p = plan_on(profile)
    seen: dict[float, float] = {}

    def utilisation(bandwidth: float) -> float:
        if bandwidth not in seen:
            tier = replace(profile.inter, bandwidth_Bps=bandwidth)
            seen[bandwidth] = price(p, with_tier(profile, profile.inter, tier),
                                    backend).utilisation
        return seen[bandwidth]
    needed = bandwidth_for(target, utilisation, low, high)
    return MeasuredBandwidth(needed, target, name, low, high, utilisation(high))
