"""`commbench whatif` (bench/study/whatif/): hand-computed projections, the bandwidth inverse,
method-neutral compute, and each strategy's traffic description against a real run.

The hand-computed cases use the naive alpha-beta formulas (docs/network-model.md) on a
two-node network without TCP slow start: all_reduce over n ranks of S bytes costs
2(n-1)(a + S/(n b)), so with n = 2: 2a + S/b.
"""

import math
from pathlib import Path

import pytest
import torch

from algorithms.base import strategy_of
from bench.network.profiles import Profile, Tier
from bench.study.whatif.engine import Compute, plan, price
from bench.study.whatif.report import evaluate, measured_whatif, method_plan
from bench.study.whatif.scenario import load_scenario
from tests import strategies
from tests.distributed import run_distributed

A, B = 1e-3, 1e9
"""The test network's latency (s) and bandwidth (bytes/s), both tiers."""
BLOCK = 1 << 19
"""Parameters of each block of the size-only model: 2 MiB of fp32 gradients."""
C = 0.5
"""Compute seconds per step."""


def net(nodes: int = 2, slow: int | None = None, slow_b: float = B / 10) -> Profile:
    """`nodes` nodes joined by Tier(A, B) (node `slow`'s links at `slow_b`), as a
    per-node-pair matrix when `slow` is set (the what-if's asymmetric path)."""
    tier = Tier(A, B, 1, None)
    if slow is None:
        return Profile("test", tier, tier)
    slow_tier = Tier(A, slow_b, 1, None)
    links = tuple(tuple(slow_tier if slow in (a, b) else tier for b in range(nodes))
                  for a in range(nodes))
    return Profile("test-uneven", tier, tier, links=links)


def scenario(methods: dict, *settings: str, replicas: int = 2, blocks: int = 1):
    """A size-only model of `blocks` x BLOCK parameters, one GPU per node and replica,
    C seconds per step, 10 steps of DDP's batch."""
    tokens = replicas * 2 * 128 * 10
    return load_scenario(None, [
        f"methods={methods}", "base={model: {preset: tiny, seq_len: 128}, "
        "data: {corpus: embedded, tokenizer: byte, batch_size: 2}, optim: {grad_clip: 0}}",
        f"model_size.num_params={blocks * BLOCK}", f"model_size.n_layer={blocks}",
        f"hardware.compute_s_per_step={C}", f"world.replicas={replicas}",
        "world.gpus_per_replica=1", "world.gpus_per_node=1", f"tokens={tokens}",
        *settings])


def priced(s, name: str, profile: Profile):
    _, p, _, _ = method_plan(s, name, profile)
    return price(p, profile, "naive")


def test_ddp_one_bucket_is_fully_exposed():
    """One bucket launches when backward ends: nothing overlaps."""
    s = scenario({"ddp": {"strategy": {"name": "ddp", "bucket_cap_mb": 25}}})
    r = priced(s, "ddp", net())
    exposed = 2 * A + 4 * BLOCK / B
    assert r.steps == 10
    assert r.step_s == pytest.approx(C + exposed, rel=1e-12)
    assert r.utilisation == pytest.approx(C / (C + exposed), rel=1e-12)
    assert r.no_overlap_s == pytest.approx(r.total_s, rel=1e-12)


def test_ddp_two_buckets_overlap_the_second_half_of_backward():
    """Two equal buckets: the first is full halfway through backward (2/3 of compute),
    so it runs under the second half; the second starts when backward ends and the
    first is done."""
    s = scenario({"ddp": {"strategy": {"name": "ddp", "bucket_cap_mb": 2}}}, blocks=2)
    r = priced(s, "ddp", net())
    bucket = 2 * A + 4 * BLOCK / B
    lead = 0.5 * (2 / 3) * C
    exposed = max(0.0, bucket - lead) + bucket
    assert r.step_s == pytest.approx(C + exposed, rel=1e-12)
    assert r.no_overlap_s / r.steps == pytest.approx(C + 2 * bucket, rel=1e-12)
    # a slow link: the first bucket outlasts the second half of backward
    slow = Profile("slow", Tier(A, B / 100, 1, None), Tier(A, B / 100, 1, None))
    bucket = 2 * A + 4 * BLOCK / (B / 100)
    assert priced(s, "ddp", slow).step_s == pytest.approx(C + 2 * bucket - lead, rel=1e-12)


def test_diloco_pays_one_unoverlapped_all_reduce_per_round():
    """H inner steps, then the outer all-reduce of θ (blocking): util = Hc / (Hc + t);
    with H = 1 it is exactly DDP with one bucket (no method is credited an overlap the
    other is not)."""
    for H in (1, 5):
        s = scenario({"ddp": {"strategy": {"name": "ddp", "bucket_cap_mb": 25}},
                      "diloco": {"strategy": {"name": "diloco", "inner_steps": H}}})
        outer = 2 * A + 4 * BLOCK / B
        d = priced(s, "diloco", net())
        assert d.utilisation == pytest.approx(H * C / (H * C + outer), rel=1e-12)
        assert d.compute_s == pytest.approx(priced(s, "ddp", net()).compute_s, rel=1e-12)
        if H == 1:
            assert d.total_s == pytest.approx(priced(s, "ddp", net()).total_s, rel=1e-12)


def test_an_uneven_link_slows_every_method_at_its_slowest_hop():
    """Node 3's links at B/10: every all-reduce over the world goes at that pace, for DDP
    and DiLoCo alike; a matrix of equal links prices as the symmetric network does (the
    rank classes' shortcut changes nothing)."""
    s = scenario({"ddp": {"strategy": {"name": "ddp", "bucket_cap_mb": 25}},
                  "diloco": {"strategy": {"name": "diloco", "inner_steps": 5}}}, replicas=4)
    S = 4 * BLOCK
    even = 6 * (A + S / (4 * B))
    uneven = 6 * (A + S / (4 * B / 10))
    assert priced(s, "ddp", net(4)).step_s == pytest.approx(C + even, rel=1e-12)
    assert priced(s, "ddp", net(4, slow=3)).step_s == pytest.approx(C + uneven, rel=1e-12)
    d = priced(s, "diloco", net(4, slow=3))
    assert d.total_s == pytest.approx(10 * C + 2 * uneven, rel=1e-12)
    same = net(4, slow=3, slow_b=B)
    for name in ("ddp", "diloco"):
        assert priced(s, name, same).total_s == pytest.approx(priced(s, name, net(4)).total_s,
                                                              rel=1e-12)


def test_compute_is_method_neutral_and_scales_with_the_batch():
    """Every data-parallel method trains the budget in the same compute seconds; doubling
    the per-GPU batch doubles a step's compute, halves the steps and keeps the total."""
    methods = {"ddp": {"strategy": {"name": "ddp"}},
               "diloco": {"strategy": {"name": "diloco", "inner_steps": 4}},
               "pier": {"strategy": {"name": "pier", "inner_steps": 4}}}
    common = ["hardware.compute_s_per_step=null", "hardware.peak_flops=1e12",
              "hardware.mfu=0.5", "model_size.flops_per_token=1e6", "tokens=40960"]
    totals = {}
    for batch in (2, 4):
        s = scenario(methods, *common, f"base.data.batch_size={batch}")
        for name in methods:
            _, p, compute_s, _ = method_plan(s, name, net())
            r = price(p, net(), "naive")
            assert compute_s == pytest.approx(1e6 * batch * 128 / (1e12 * 0.5))
            assert r.steps == 40960 // (2 * batch * 128)
            totals[name, batch] = r
    base = totals["ddp", 2].compute_s
    for r in totals.values():
        assert r.compute_s == pytest.approx(base, rel=1e-12)
    assert totals["ddp", 4].utilisation > totals["ddp", 2].utilisation


def test_bandwidth_for_a_target_matches_a_direct_evaluation():
    """The reported bandwidth reaches its target; 0.2% less does not."""
    s = scenario({"ddp": {"strategy": {"name": "ddp"}},
                  "diloco": {"strategy": {"name": "diloco", "inner_steps": 5}}},
                 "network.profile=eth-10g", "network.model=naive", "network.points=9",
                 "network.bandwidth=[1e4, 1e11]", "targets=[0.5, 0.95]")
    results = evaluate(s)
    from bench.study.whatif.engine import with_tier
    from bench.study.whatif.scenario import base_profile

    profile, swept = base_profile(s)
    for result in results:
        _, p, _, _ = method_plan(s, result.name, profile)

        def util(bandwidth, p=p):
            tier = Tier(swept.latency_s, bandwidth, swept.nics, swept.tcp_initial_window_B)
            return price(p, with_tier(profile, swept, tier), "naive").utilisation
        for target, bandwidth in result.needed.items():
            assert math.isfinite(bandwidth), (result.name, target)
            assert util(bandwidth) >= target
            assert bandwidth > 1e4 and util(bandwidth / 1.002) < target
        # the table's point is the high end of the range
        assert result.at["utilisation"] == pytest.approx(util(1e11), rel=1e-12)


def test_a_set_latency_moves_the_profiles_measured_round_trip():
    """netprobe's TCP round trip moves with a latency the scenario sets (twice the change:
    both ways); where that would leave nothing, slow start runs on twice the latency."""
    from bench.study.whatif.scenario import base_profile

    path = str(Path(__file__).parent / "profiles" / "netprobe-tcp.yaml")
    methods = {"ddp": {"strategy": {"name": "ddp"}}}
    _, kept = base_profile(scenario(methods, f"network.profile={path}"))
    assert (kept.latency_s, kept.tcp_rtt_s, kept.tcp_queue_s) == (0.00138, 0.0025, 0.004)
    _, same = base_profile(scenario(methods, f"network.profile={path}", "network.latency=1.38ms"))
    assert same.tcp_rtt_s == pytest.approx(0.0025)
    _, far = base_profile(scenario(methods, f"network.profile={path}", "network.latency=10ms"))
    assert far.latency_s == 0.01 and far.tcp_rtt_s == pytest.approx(0.0025 + 2 * 0.00862)
    _, near = base_profile(scenario(methods, f"network.profile={path}", "network.latency=1us"))
    assert near.tcp_rtt_s is None and near.round_trip_s == pytest.approx(2e-6)
    assert far.tcp_queue_s == near.tcp_queue_s == 0.004  # kept as netprobe measured it


def test_plans_price_one_period_of_a_long_phase():
    """Steady state: a 360-round DiLoCo is priced from two periods, yet equals the
    every-step price (no slow start on this network). A phase that is no whole number
    of rounds counts its last round as the fraction it is (engine docstring)."""
    s = scenario({"diloco": {"strategy": {"name": "diloco", "inner_steps": 7}}},
                 f"tokens={2520 * 2 * 2 * 128}")
    cfg, p, _, _ = method_plan(s, "diloco", net())
    exact = plan(strategy_of(cfg).traffic(cfg, p_facts(s)), Compute(step_s=C), 2, 1, net(),
                 exact=True)
    assert price(p, net(), "naive").total_s == pytest.approx(
        price(exact, net(), "naive").total_s, rel=1e-9)


def p_facts(s):
    from bench.study.whatif.engine import synthetic_facts

    return synthetic_facts(int(s.model_size.num_params), s.model_size.n_layer)


# ---------------------------------------------------------------------- real runs

STEPS = 6
CASES = {  # (config, overrides): tests/strategies.py `whatif`
    name: (strategies.config_of(entry, case), list(case.overrides))
    for name, (entry, case) in strategies.cases("whatif").items()}


def settings(case: str) -> tuple[str, list[str]]:
    path, extra = CASES[case]
    return path, run_settings(extra)


def run_settings(extra: list[str]) -> list[str]:
    """A real run's overrides: STEPS steps of batch 2, the two profiles, then `extra`."""
    return [f"run.steps={STEPS}", "run.log_every=3", "run.val_every=6",
            "run.val_sequences=4", "checkpoint.final=false", "data.batch_size=2",
            "network.profiles=[nvlink, ib-400g]", *extra]


def train(rank, world_size, run_dir, path, overrides, peers=False):
    from bench.config import load_config
    from bench.run.train import TRAIN_PHASES, Trainer

    cfg = load_config(path, overrides)
    trainer = Trainer(cfg, Path(run_dir), torch.device("cpu"), "gloo", keep_records=True)
    summary = trainer.run()
    records = sorted((r.step, r.phase, r.op, r.nbytes, r.group_size)
                     + ((r.peers or (),) if peers else ())
                     for r in trainer.ledger.records if r.phase in TRAIN_PHASES)
    return summary, records


def check_run(case, tmp_path):
    check_config(*settings(case), tmp_path)


def check_config(path: str, overrides: list[str], tmp_path, world: int = 4,
                 peers: bool = False) -> list:
    """Train `path` with `overrides` on `world` gloo ranks; each rank's ledger (training
    phases) equals its traffic description record for record (with `peers`, each
    record's peers or subgroup too, not only its size), and the what-if of the run's own
    model, world, profiles and median compute is its recorded projection. Returns each
    rank's (summary, records)."""
    from bench.config import load_config
    from bench.study.whatif.engine import as_records, traffic_facts

    results = run_distributed(train, world, str(tmp_path), path, overrides, peers,
                              timeout=240)
    cfg = load_config(path, overrides)
    traffic = strategy_of(cfg).traffic(cfg, traffic_facts(cfg))
    steps = cfg.run.steps
    for rank, (_, recorded) in enumerate(results):
        described = sorted(  # a step's order is not priced (FSDP2 interleaves its ops)
            (r.step, r.phase, r.op, r.nbytes, r.group_size)
            + ((r.peers or (),) if peers else ())
            for step in range(steps) for t in traffic.transfers(rank, step)
            for r in as_records(t, rank, step, world, cfg.network.ranks_per_node or 1))
        assert described == recorded, f"rank {rank}"
    summary = results[0][0]
    for name, row in measured_whatif(cfg, summary).items():
        assert row["whatif_s"] == pytest.approx(row["recorded_s"], rel=1e-6), name
    return results


@pytest.mark.slow  # ~35 s each on a loaded 2-core machine
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_every_strategys_run_equals_its_whatif(case, tmp_path):
    """Each description is its run's ledger, record for record (diloco-hier: DDP buckets
    inside replicas of 2, the outer all-reduce across them), and the what-if of the run's
    own model, world, profiles and median compute is its recorded projected_robust."""
    check_run(case, tmp_path)


def test_a_measured_runs_flops_rate_scales_to_the_scenario(tmp_path):
    """hardware.run: the run's FLOPs per step (its flops_per_token x batch x seq_len) over
    the median compute of its most frequent batch-reading step kind, applied to the
    scenario's FLOPs per step."""
    import json
    import shutil

    shutil.copy("configs/ddp-tiny.yaml", tmp_path / "config.yaml")  # batch 8 x 128 tokens
    stats = {"steps": [10], "median_s": [0.5], "p10_s": [0.4], "p90_s": [0.9],
             "mean_s": [0.6]}
    (tmp_path / "summary.json").write_text(json.dumps({
        "status": "ok", "flops_per_token": 2e6, "compute_per_step": {
            "train:all_reduce": stats,
            "no batch, no traffic": {**stats, "steps": [90], "median_s": [0.01]}}}))
    s = scenario({"ddp": {"strategy": {"name": "ddp"}}}, "hardware.compute_s_per_step=null",
                 f"hardware.run={tmp_path}", "model_size.flops_per_token=1e6")
    _, _, compute_s, _ = method_plan(s, "ddp", net())
    achieved = 2e6 * 8 * 128 / 0.5
    assert compute_s == pytest.approx(1e6 * 2 * 128 / achieved, rel=1e-12)


@pytest.mark.parametrize("path", sorted(Path("configs/whatif").glob("*.yaml")))
def test_shipped_scenarios_validate(path):
    """Every shipped scenario loads and each of its methods is a valid run config."""
    from bench.study.whatif.scenario import method_config

    s = load_scenario(str(path))
    for name in s.methods:
        assert method_config(s, name).run.steps >= 1


@pytest.mark.slow  # ~50 s each on a loaded 2-core machine
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world,extra", [
    (4, []),  # 2 stages x 2 replicas: "dp" and the clipping norm's average over 2 ranks
    (2, ["optim.grad_clip=0"]),  # one replica: "dp" over a group of one, no clipping
    (3, ["parallel.num_stages=3", "model.n_layer=3"]),  # a middle stage, p2p both ways
], ids=["replicas", "one-replica-no-clip", "three-stages"])
def test_deepspeed_pipeline_run_equals_its_whatif(world, extra, tmp_path):
    """DeepSpeed's pipeline engine (algorithms/pipeline_deepspeed.py): its ledger, every
    collective with its group's ranks and phase (tied, dp, clip, loss) and every p2p
    message its own record with its peer (the step-0 shape metadata too), equals
    `deepspeed_pipe_traffic` record for record, and the what-if of the run is its
    projected_robust."""
    pytest.importorskip("deepspeed")
    results = check_config("configs/deepspeed-pp-tiny.yaml", run_settings(
        ["data.batch_size=4", f"parallel.world_size={world}", *extra]), tmp_path, world,
        peers=True)
    phases = {(phase, op, size) for _, records in results
              for _, phase, op, _, size, _ in records if phase != "train"}
    if world == 4:
        assert phases == {("tied", "all_reduce", 2), ("dp", "all_reduce", 2),
                          ("clip", "all_reduce", 2), ("loss", "all_reduce", 2),
                          ("loss", "broadcast", 2)}
    elif world == 2:
        assert phases == {("tied", "all_reduce", 2), ("dp", "all_reduce", 1),
                          ("loss", "broadcast", 2)}
    else:  # the middle stage talks to both neighbours, the end stages to one
        p2p = [{peers for _, phase, _, _, _, peers in records if phase == "train"}
               for _, records in results]
        assert p2p == [{(1,)}, {(0,), (2,)}, {(1,)}]
        assert ("clip", "all_reduce", 3) in phases
