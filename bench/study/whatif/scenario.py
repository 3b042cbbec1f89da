"""What-if scenarios: the model, hardware, world, network and methods a user plans.

    commbench whatif configs/whatif/llama1b-8x8.yaml
    commbench whatif configs/whatif/llama1b-8x8.yaml --set world.replicas=16
    commbench whatif --run results/quickstart/ddp-...        # a measured run's own what-if

A scenario is a YAML file (or `--set` flags on the defaults) read by bench/config/typed.py; every
field is documented by the string under it. Each method is a run config (bench/config/__init__.py)
built from `base`, the method's own sections and the world, and validated as a run would
be, so a method the harness would refuse is refused here with the same message.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from algorithms.clocks import CONTENTION_FREE
from bench.config.typed import check_name, fail, from_mapping, load_yaml_mapping, set_override
from bench.network.profiles import Profile, Tier, get_profile, parse_bandwidth, parse_latency
from bench.network.profiles import sites_profile as make_sites_profile


@dataclass
class ModelSize:
    num_params: float | None = None
    """A model known by its size only: its parameter count (instead of `base.model`'s
    architecture); null = `base.model`, measured on the meta device."""
    flops_per_token: float | None = None
    """Training FLOPs per token of the size-only model; null = 6 x num_params."""
    n_layer: int = 24
    """Blocks of the size-only model (FSDP units, pipeline stages): equal blocks."""


@dataclass
class Hardware:
    gpu: str | None = None
    """A GPU whose dense peak bench/env.py knows (H100 SXM, H100 PCIe, H100 NVL, H200 SXM,
    H200 NVL, GH200), at `base.model.precision`; or give peak_flops."""
    peak_flops: float | None = None
    """Dense peak FLOP/s of one GPU at the run's precision."""
    mfu: float = 0.4
    """Model FLOPs utilisation the peak is run at: compute per step = FLOPs / (peak x mfu)."""
    compute_s_per_step: float | None = None
    """Or: one GPU's compute seconds per data-parallel step, given directly."""
    run: str | None = None
    """Or: a measured run directory: its achieved FLOP/s per GPU (median step compute,
    summary.json `compute_per_step`), scaled to the scenario's FLOPs per step."""
    backward_share: float = 2 / 3
    """Share of a step's compute in backward: how long DDP's buckets can overlap it."""
    replica_speed: list[float] = field(default_factory=list)
    """Per replica (in order), its compute speed relative to the above: 0.5 = a straggler
    whose steps take twice as long; replicas past the list's end run at 1. Empty: every
    GPU alike."""


@dataclass
class World:
    replicas: int = 1
    """Model replicas (DiLoCo/Pier replicas; DDP averages over all GPUs anyway)."""
    gpus_per_replica: int = 8
    """GPUs per replica (parallel.group_size; pipelines: stages x their replicas)."""
    gpus_per_node: int = 8
    """GPUs per node: ranks on one node talk over the profile's intra tier."""
    nodes_per_site: int | None = None
    """Nodes per site: sites talk over the swept tier, nodes of a site over the profile's
    inter tier; null = one site (the swept tier joins the nodes)."""
    slow_nodes: list[int] = field(default_factory=list)
    """Nodes whose links across nodes run at `slow_share` x the swept bandwidth (a bad
    NIC, a far rack): every link touching one of them. Empty: none."""
    slow_share: float = 0.1
    """The slow nodes' share of the swept bandwidth, in (0, 1]."""


@dataclass
class Network:
    profile: str = "ib-400g"
    """The base network: a built-in profile name or a profile YAML (docs/network-model.md);
    its intra tier joins the GPUs of a node."""
    model: Literal["naive", "gloo", "nccl", "nccl-ring", "nccl-tree"] = "nccl"
    """Collective algorithm the costs price (GPU clusters: nccl)."""
    bandwidth: list[str | float] = field(default_factory=lambda: ["1Gbit/s", "400Gbit/s"])
    """[low, high] of the swept tier's bandwidth (the profile's inter tier; across sites
    with world.nodes_per_site), e.g. 1Gbit/s, 12.5GB/s, or bytes/s."""
    at: str | float | None = None
    """The bandwidth the table's step times are given at; null = the high end."""
    latency: str | float | None = None
    """The swept tier's latency (e.g. 10ms); null = the profile's inter tier's."""
    nics: int | None = None
    """Links of the swept tier per node (concurrent flows share ceil(flows / nics));
    null = the profile's inter tier's. 1: the bandwidth is the node's."""
    points: int = 41
    """Bandwidths of the curves, log-spaced over the range."""


@dataclass
class Assume:
    """What a planner assumes where the harness may do otherwise (bench/study/whatif/
    assume.py); the defaults are what the harness runs. Printed with every result."""

    exchange_dtype: Literal["harness", "fp32", "bf16", "fp16"] = "harness"
    """Dtype of the gradients and θ the data-parallel reductions, outer all-reduces and
    gossip send: harness = fp32, as the runs send them; bf16 halves those bytes. An outer
    exchange a method narrows itself (outer_grad_dtype, compression) keeps its own."""
    dp_overlap: Literal["buckets", "backward", "every", "none"] = "buckets"
    """How a step's data-parallel reduction overlaps backward: buckets = torch DDP's
    bucket timeline, as the harness runs it; backward = all of it may run under the
    whole backward (exposed = max(0, reduction - backward)), the published simulators'
    assumption; every = backward, and outer all-reduces and gossip too may run under the
    backward of the step that issues them (the Streaming DiLoCo authors' calculator);
    none = exposed in full."""
    tokens_per_step: float | None = None
    """Tokens all GPUs consume in one step; null = base.data.batch_size x seq_len x the
    data-parallel GPUs. Set: every method's data.batch_size is derived from it (it must
    come out a whole number of sequences per GPU)."""


@dataclass
class Scenario:
    name: str = "whatif"
    """Names the output folder."""
    base: dict = field(default_factory=lambda: {
        "model": {"arch": "llama", "preset": "1b", "seq_len": 2048, "precision": "bf16"},
        "data": {"tokenizer": "gpt2", "batch_size": 8}})
    """Run-config sections every method shares (bench/config/__init__.py: model, data with
    batch_size = sequences per GPU per step, optim, parallel)."""
    model_size: ModelSize = field(default_factory=ModelSize)
    hardware: Hardware = field(default_factory=Hardware)
    world: World = field(default_factory=World)
    network: Network = field(default_factory=Network)
    assume: Assume = field(default_factory=Assume)
    tokens: float = 2e10
    """Token budget: the time to train on it is reported."""
    methods: dict = field(default_factory=lambda: {"ddp": {"strategy": {"name": "ddp"}}})
    """name -> run-config sections of the method (strategy, and e.g. parallel.shard,
    parallel.group_size, parallel.num_stages), merged over `base`."""
    targets: list[float] = field(default_factory=lambda: [0.5, 0.8, 0.9, 0.95, 0.99])
    """Compute utilisations whose needed bandwidth is reported."""


MAX_GPUS = 1024
"""The largest world a what-if prices (world.replicas x world.gpus_per_replica): the
planner walks every rank's steps and every group's members, so its time grows with the
square of the world (the shipped 3-method scenario: 512 GPUs ~7 s, 1,024 ~15 s on one
core). Beyond, a plan would run for minutes to hours; a larger world is refused, naming
this bound (bench/study/whatif/engine.py `MAX_RANK_STEPS` bounds the steps priced)."""
MAX_POINTS = 1000
"""The most bandwidths a curve is priced at (network.points): each costs one pricing of
every method (~4 ms each for a 1B model on 64 GPUs)."""


def load_scenario(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> Scenario:
    """A scenario from YAML (or the defaults) with `--set KEY=VALUE` overrides."""
    data = load_yaml_mapping(path, "what-if scenario") if path else {}
    for assignment in overrides:
        set_override(data, assignment)
    scenario = from_mapping(Scenario, data, "")
    check(scenario)
    return scenario


def check(s: Scenario) -> None:
    """Ranges and cross-field rules (ValueError naming the key)."""
    check_name("name", s.name, "the what-if's output folder")
    for key in ("world.replicas", "world.gpus_per_replica", "world.gpus_per_node",
                "network.points", "model_size.n_layer"):
        section, name = key.split(".")
        if getattr(getattr(s, section), name) < 1:
            raise fail(key, getattr(getattr(s, section), name), ">= 1")
    per_replica, per_node = s.world.gpus_per_replica, s.world.gpus_per_node
    if per_replica % per_node and per_node % per_replica:
        raise ValueError(f"world.gpus_per_replica ({per_replica}) and world.gpus_per_node "
                         f"({per_node}): one must divide the other (a replica spans whole "
                         "nodes, or a node holds whole replicas)")
    gpus = s.world.replicas * s.world.gpus_per_replica
    if gpus > MAX_GPUS:
        raise ValueError(
            f"world.replicas x world.gpus_per_replica = {s.world.replicas} x "
            f"{s.world.gpus_per_replica} = {gpus:,} GPUs; the what-if prices at most "
            f"{MAX_GPUS:,} (its planner walks every rank, its time grows with the square "
            "of the world: bench/study/whatif/scenario.py MAX_GPUS). Plan a smaller world, e.g. "
            "one site's, and scale the step time by hand")
    if s.network.points > MAX_POINTS:
        raise fail("network.points", s.network.points,
                   f"from 1 to {MAX_POINTS} (each point prices every method once)")
    if s.model_size.num_params is not None and not s.model_size.num_params >= 1:
        raise fail("model_size.num_params", s.model_size.num_params,
                   "null (base.model's architecture) or a parameter count >= 1")
    if s.model_size.num_params is not None and \
            s.model_size.num_params < s.model_size.n_layer:
        raise fail("model_size.num_params", s.model_size.num_params,
                   f">= model_size.n_layer ({s.model_size.n_layer}): each block holds at "
                   "least one parameter")
    if s.model_size.flops_per_token is not None and \
            not 0 < s.model_size.flops_per_token < math.inf:
        raise fail("model_size.flops_per_token", s.model_size.flops_per_token,
                   "null (6 x num_params) or a finite number > 0")
    if s.world.nodes_per_site is not None and s.world.nodes_per_site < 1:
        raise fail("world.nodes_per_site", s.world.nodes_per_site, "null or >= 1")
    if not 0 < s.hardware.mfu <= 1:
        raise fail("hardware.mfu", s.hardware.mfu, "in (0, 1]")
    if not 0 <= s.hardware.backward_share <= 1:
        raise fail("hardware.backward_share", s.hardware.backward_share, "in [0, 1]")
    if s.tokens <= 0:
        raise fail("tokens", s.tokens, "> 0")
    if not s.methods:
        raise fail("methods", s.methods, "a mapping name -> run-config sections, at least one")
    if not s.targets or not all(0 < t < 1 for t in s.targets):
        raise fail("targets", s.targets, "utilisations in (0, 1)")
    if not all(0 < v < math.inf for v in s.hardware.replica_speed):
        raise fail("hardware.replica_speed", s.hardware.replica_speed,
                   "relative speeds > 0, one per replica (1 = as stated)")
    if len(s.hardware.replica_speed) > s.world.replicas:
        raise fail("hardware.replica_speed", s.hardware.replica_speed,
                   f"at most world.replicas ({s.world.replicas}) speeds")
    if not 0 < s.world.slow_share <= 1:
        raise fail("world.slow_share", s.world.slow_share, "in (0, 1]")
    nodes = -(-gpus // per_node)
    if not all(0 <= n < nodes for n in s.world.slow_nodes):
        raise fail("world.slow_nodes", s.world.slow_nodes,
                   f"node indices from 0 to {nodes - 1} (the world has {nodes} nodes)")
    if s.assume.tokens_per_step is not None and not s.assume.tokens_per_step >= 1:
        raise fail("assume.tokens_per_step", s.assume.tokens_per_step, "null or >= 1")
    low, high = bandwidth_range(s)
    if not 0 < low < high:
        raise fail("network.bandwidth", s.network.bandwidth, "[low, high] with 0 < low < high")


def bandwidth_range(s: Scenario) -> tuple[float, float]:
    if len(s.network.bandwidth) != 2:
        raise fail("network.bandwidth", s.network.bandwidth, "[low, high]")
    return tuple(parse_bandwidth(b, f"network.bandwidth[{i}]")
                 for i, b in enumerate(s.network.bandwidth))


# ---------------------------------------------------------------------- methods as configs


def method_config(s: Scenario, name: str, steps: int | None = None):
    """The run config of method `name` (validated: bench.config.from_dict); `steps`
    defaults to the token budget's (`steps_for`)."""
    from bench.config import from_dict

    data = _merge(copy.deepcopy(s.base), copy.deepcopy(s.methods[name] or {}))
    parallel = data.setdefault("parallel", {})
    parallel.setdefault("world_size", s.world.replicas * s.world.gpus_per_replica)
    parallel.setdefault("group_size", s.world.gpus_per_replica)
    data["network"] = {**(data.get("network") or {}), "profiles": [],
                       "ranks_per_node": s.world.gpus_per_node, "emulate": None}
    run = data.setdefault("run", {})
    run["name"] = re.sub(r"[^A-Za-z0-9._-]", "-", name) or "method"
    run["steps"] = steps or 1
    data.setdefault("checkpoint", {})["final"] = False
    try:
        cfg = from_dict(data)
        if s.assume.tokens_per_step is not None:
            data.setdefault("data", {})["batch_size"] = batch_for(s, cfg)
            cfg = from_dict(data)
        if steps is None:
            run["steps"] = steps_for(s, cfg)
            cfg = from_dict(data)
    except ValueError as err:
        raise ValueError(f"methods.{name}: {err}") from None
    return cfg


def tokens_per_step(cfg) -> int:
    """Tokens all ranks consume in one step (a pipeline's stages share their batch)."""
    p = cfg.parallel
    return p.world_size // p.num_stages * cfg.data.batch_size * cfg.model.seq_len


def batch_for(s: Scenario, cfg) -> int:
    """Sequences per GPU per step that make `assume.tokens_per_step` (ValueError when they
    do not come out whole)."""
    p = cfg.parallel
    sequences = s.assume.tokens_per_step / (p.world_size // p.num_stages * cfg.model.seq_len)
    if sequences < 1 or abs(sequences - round(sequences)) > 1e-9:
        raise ValueError(
            f"assume.tokens_per_step={s.assume.tokens_per_step:g} over "
            f"{p.world_size // p.num_stages} data-parallel GPUs x seq_len "
            f"{cfg.model.seq_len} is {sequences:g} sequences per GPU: give a multiple of "
            f"{p.world_size // p.num_stages * cfg.model.seq_len}")
    return round(sequences)


def steps_for(s: Scenario, cfg) -> int:
    return max(1, round(s.tokens / tokens_per_step(cfg)))


def _merge(base: dict, extra: dict) -> dict:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


# ---------------------------------------------------------------------- the network


def base_profile(s: Scenario) -> tuple[Profile, Tier]:
    """(the scenario's network, the tier the bandwidth sweep replaces in it)."""
    profile = get_profile(s.network.profile)
    inter = profile.inter
    latency = inter.latency_s if s.network.latency is None else parse_latency(
        s.network.latency, "network.latency")
    # a measured round trip moves with the latency (both ways); below zero: 2 x latency
    rtt = inter.tcp_rtt_s
    if rtt is not None:
        rtt += 2 * (latency - inter.latency_s)
    swept = Tier(latency, inter.bandwidth_Bps, s.network.nics or inter.nics,
                 inter.tcp_initial_window_B, tcp_queue_s=inter.tcp_queue_s,
                 tcp_rtt_s=rtt if rtt is not None and rtt > 0 else None)
    nodes = -(-s.world.replicas * s.world.gpus_per_replica // s.world.gpus_per_node)
    per_site = s.world.nodes_per_site
    if per_site is not None and per_site < nodes:
        sites = [n // per_site for n in range(nodes)]
        profile = make_sites_profile(f"{profile.name}+sites", sites, profile.intra, inter,
                                     swept, f"{profile.name} inside a site, "
                                     f"{per_site} nodes per site")
    else:
        profile = Profile(profile.name, profile.intra, swept, profile.links,
                          profile.description, profile.overrides)
    slow = set(s.world.slow_nodes)
    if slow:  # every link touching a slow node: priced at its share (`profile_at`)
        pairs = tuple(((a, b), swept) for a in range(nodes) for b in range(nodes)
                      if a != b and (a in slow or b in slow))
        profile = replace(profile, name=f"{profile.name}+slow", overrides=(
            *pairs, *profile.overrides))
    return profile, swept


def profile_at(s: Scenario, profile: Profile, swept: Tier, bandwidth: float) -> Profile:
    """`base_profile`'s network with the swept tier at `bandwidth` (bytes/s) wherever it
    joins two nodes, and every link touching a slow node (`world.slow_nodes`) at
    `world.slow_share` of it."""
    new = replace(swept, bandwidth_Bps=bandwidth)
    slow = replace(swept, bandwidth_Bps=bandwidth * s.world.slow_share)
    nodes = set(s.world.slow_nodes)

    def sub(t: Tier) -> Tier:
        return new if t is swept else t
    links = None if profile.links is None else tuple(
        tuple(sub(t) for t in row) for row in profile.links)
    overrides = tuple((pair, slow if nodes & set(pair) else sub(t))
                      for pair, t in profile.overrides)
    return replace(profile, inter=sub(profile.inter), links=links, overrides=overrides)


def run_summary(run_dir: str | Path) -> tuple[dict, dict]:
    """(config.yaml, summary.json) of a measured run."""
    from bench.config import load_raw
    from bench.run.records import RunDir

    run = RunDir(run_dir)
    if not Path(run.config).is_file():
        raise ValueError(f"{str(run_dir)!r} is not a run directory (no config.yaml)")
    summary = run.read_summary()
    if not summary or not summary.get("compute_per_step"):
        raise ValueError(f"{str(run_dir)!r} has no measured compute per step "
                         "(summary.json compute_per_step: a run recorded before the what-if "
                         "existed, or one that did not finish)")
    _check_uncontended(run_dir, summary)
    return load_raw(run.config), summary


def _check_uncontended(run_dir: str | Path, summary: dict) -> None:
    """Refuse a run whose compute per step holds waits for a core: measured on the wall
    clock (summary.json `compute_clock` wall, or none recorded) while its ranks shared
    cores (`ranks_per_core` > 1; null on a GPU). Priced as compute, those waits would be
    planned onto every GPU (docs/report.md, Runs whose ranks shared cores)."""
    per_core, clock = summary.get("ranks_per_core"), summary.get("compute_clock")
    shared = (isinstance(per_core, int | float) and not isinstance(per_core, bool)
              and per_core > 1)
    if shared and clock not in CONTENTION_FREE:
        raise ValueError(
            f"{str(run_dir)!r}: its compute was measured on the wall clock while ranks "
            f"shared cores (summary.json ranks_per_core {per_core:g} > 1, compute_clock "
            f"{'not recorded' if clock is None else repr(clock)}): its compute per step "
            "holds the ranks' waits for a core, which the what-if would price as compute. "
            "Re-run it with no more ranks than cores, or on CPU time (run.compute_clock: "
            "auto, the default: compute_clock thread_cpu)")
