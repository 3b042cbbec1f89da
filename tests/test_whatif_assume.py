"""The what-if's stated assumptions and heterogeneous worlds, against hand computation.

    pytest tests/test_whatif_assume.py

Same network and model as tests/test_whatif.py: naive alpha-beta formulas, latency A,
bandwidth B, blocks of BLOCK parameters (4 x BLOCK bytes in fp32), C seconds of compute
per step, one GPU per node; all_reduce over n ranks of S bytes: 2(n-1)(A + S/(n B)).
"""

import pytest

from bench.study.whatif.engine import price
from bench.study.whatif.report import assumptions, method_plan
from bench.study.whatif.scenario import base_profile, method_config, profile_at
from tests.test_whatif import BLOCK, A, B, C, net, priced, scenario

DDP = {"ddp": {"strategy": {"name": "ddp", "bucket_cap_mb": 25}}}
TWO_BUCKETS = {"ddp": {"strategy": {"name": "ddp", "bucket_cap_mb": 2}}}


def test_bf16_exchange_halves_every_fp32_payload_once():
    """assume.exchange_dtype=bf16: DDP's bucket and DiLoCo's outer all-reduce send 2 bytes
    a parameter; an outer all-reduce already in bf16 (outer_grad_dtype) is not halved
    again."""
    methods = {**DDP, "diloco": {"strategy": {"name": "diloco", "inner_steps": 5}},
               "diloco-bf16": {"strategy": {"name": "diloco", "inner_steps": 5,
                                            "outer_grad_dtype": "bf16"}}}
    s = scenario(methods, "assume.exchange_dtype=bf16")
    half = 2 * A + 2 * BLOCK / B
    assert priced(s, "ddp", net()).step_s == pytest.approx(C + half, rel=1e-12)
    for name in ("diloco", "diloco-bf16"):
        assert priced(s, name, net()).total_s == pytest.approx(10 * C + 2 * half, rel=1e-12)
    harness = scenario(methods)
    assert priced(harness, "diloco-bf16", net()).total_s == pytest.approx(
        10 * C + 2 * half, rel=1e-12)
    assert priced(harness, "diloco", net()).total_s == pytest.approx(
        10 * C + 2 * (2 * A + 4 * BLOCK / B), rel=1e-12)
    text = " ".join(assumptions(s))
    assert "sent in bf16" in text and "assume.dp_overlap=buckets" in text


def test_dp_overlap_backward_hides_the_whole_reduction_under_the_whole_backward():
    """Two buckets of t each. buckets: the first runs under the second half of backward
    (test_whatif); backward: both may start when backward does, exposed = max(0, 2t - b)
    with b = 2/3 C; none: 2t exposed."""
    backward = 2 / 3 * C
    for bandwidth, name in ((B, "fast"), (B / 100, "slow")):
        tier_net = net() if name == "fast" else _slow()
        t = 2 * A + 4 * BLOCK / bandwidth
        s = scenario(TWO_BUCKETS, "assume.dp_overlap=backward", blocks=2)
        assert priced(s, "ddp", tier_net).step_s == pytest.approx(
            C + max(0.0, 2 * t - backward), rel=1e-12)
        s = scenario(TWO_BUCKETS, "assume.dp_overlap=none", blocks=2)
        assert priced(s, "ddp", tier_net).step_s == pytest.approx(C + 2 * t, rel=1e-12)
    assert priced(scenario(TWO_BUCKETS, "assume.dp_overlap=backward", blocks=2), "ddp",
                  net()).step_s == pytest.approx(C, rel=1e-12)  # 2t = 12 ms < 333 ms


def _slow():
    from bench.network.profiles import Profile, Tier

    tier = Tier(A, B / 100, 1, None)
    return Profile("slow", tier, tier)


def test_tokens_per_step_sets_every_methods_batch():
    """assume.tokens_per_step: 2 GPUs x 4 sequences x 128 tokens; compute per step from
    FLOPs grows with it; a figure that is no whole number of sequences is refused."""
    s = scenario(DDP, "assume.tokens_per_step=1024", "hardware.compute_s_per_step=null",
                 "hardware.peak_flops=1e12", "hardware.mfu=0.5",
                 "model_size.flops_per_token=1e6")
    cfg = method_config(s, "ddp")
    assert cfg.data.batch_size == 4
    _, p, compute_s, _ = method_plan(s, "ddp", net())
    assert compute_s == pytest.approx(1e6 * 4 * 128 / 0.5e12, rel=1e-12)
    assert p.steps == 10 * 2 * 2 * 128 // 1024
    assert any("tokens per step 1024" in line for line in assumptions(s))
    with pytest.raises(ValueError, match="tokens_per_step=1000 .* multiple of 256"):
        method_config(scenario(DDP, "assume.tokens_per_step=1000"), "ddp")


def test_a_straggler_sets_every_step_it_shares():
    """Replica 1 at half speed: DDP's every step waits for its 2C; DiLoCo's ranks meet
    only at the outer all-reduce, after its 5 steps of 2C. Utilisation counts the
    straggler's compute as compute (the ranks' wait for it is not communication)."""
    methods = {**DDP, "diloco": {"strategy": {"name": "diloco", "inner_steps": 5}}}
    s = scenario(methods, "hardware.replica_speed=[1, 0.5]")
    t = 2 * A + 4 * BLOCK / B
    d = priced(s, "ddp", net())
    assert d.step_s == pytest.approx(2 * C + t, rel=1e-12)
    assert d.compute_s == pytest.approx(10 * 2 * C, rel=1e-12)
    lo = priced(s, "diloco", net())
    assert lo.total_s == pytest.approx(2 * (5 * 2 * C + t), rel=1e-12)
    assert lo.utilisation == pytest.approx(10 * C / (10 * C + t), rel=1e-12)
    with pytest.raises(ValueError, match="hardware.replica_speed"):
        scenario(methods, "hardware.replica_speed=[1, 1, 1]")


def _profile_file(tmp_path) -> str:
    path = tmp_path / "lab.yaml"
    path.write_text(f"intra: {{latency: {A}, bandwidth: {B}}}\n"
                    f"inter: {{latency: {A}, bandwidth: {B}}}\n")
    return str(path)


def test_two_sites_joined_by_a_slow_link_by_hand(tmp_path):
    """Two replicas of two GPUs, one replica per site (world.nodes_per_site=2): DiLoCo's
    inner all-reduce runs inside a site at B, its outer all-reduce across the sites at
    the swept link (latency L, bandwidth b); DDP's all-reduce over the four GPUs goes at
    the pace of its slowest hop, the swept one. H = 5, 10 steps, S = 4 x BLOCK bytes."""
    L, b, S = 0.01, 1e8, 4 * BLOCK
    s = scenario({**DDP, "diloco": {"strategy": {"name": "diloco", "inner_steps": 5}}},
                 f"network.profile={_profile_file(tmp_path)}", "network.model=naive",
                 f"network.latency={L}", "world.gpus_per_replica=2",
                 "world.nodes_per_site=2", "tokens=10240")
    profile, swept = base_profile(s)
    at = profile_at(s, profile, swept, b)
    inner = 2 * (A + S / (2 * B))
    outer = 2 * (L + S / (2 * b))
    _, p, _, _ = method_plan(s, "diloco", profile)
    assert price(p, at, "naive").total_s == pytest.approx(
        10 * (C + inner) + 2 * outer, rel=1e-12)
    _, p, _, _ = method_plan(s, "ddp", profile)
    assert price(p, at, "naive").step_s == pytest.approx(C + 6 * (L + S / (4 * b)),
                                                         rel=1e-12)


def test_one_slow_node_slows_every_hop_that_touches_it(tmp_path):
    """Node 3's links at 0.1 x the swept bandwidth (world.slow_nodes): the world's
    all-reduce goes at that pace; node 3 out of the groups (two replicas of two, DiLoCo's
    inner all-reduce of replica 0) leaves them at the swept pace."""
    b, S = 1e8, 4 * BLOCK
    s = scenario({**DDP, "diloco": {"strategy": {"name": "diloco", "inner_steps": 5}}},
                 f"network.profile={_profile_file(tmp_path)}", "network.model=naive",
                 "world.replicas=4", "world.slow_nodes=[3]", "world.slow_share=0.1",
                 "tokens=20480")
    profile, swept = base_profile(s)
    at = profile_at(s, profile, swept, b)
    _, p, _, _ = method_plan(s, "ddp", profile)
    assert price(p, at, "naive").step_s == pytest.approx(
        C + 6 * (A + S / (4 * 0.1 * b)), rel=1e-12)
    assert any("node(s) 3 slow" in line for line in assumptions(s))
    with pytest.raises(ValueError, match="world.slow_nodes"):
        scenario(DDP, "world.slow_nodes=[4]", "world.replicas=4")


def test_dp_overlap_every_lets_the_outer_all_reduce_run_under_backward():
    """assume.dp_overlap=every (the Streaming DiLoCo authors' calculator): DiLoCo's outer
    all-reduce of t seconds runs under the backward (b = 2/3 C) of the round's last step:
    exposed max(0, t - b) per round; the harness's default blocks for all of t."""
    from bench.network.profiles import Profile, Tier

    methods = {"diloco": {"strategy": {"name": "diloco", "inner_steps": 5}}}
    tier = Tier(A, B / 1000, 1, None)
    slow = Profile("slow", tier, tier)
    t, backward = 2 * A + 4 * BLOCK / (B / 1000), 2 / 3 * C
    every = priced(scenario(methods, "assume.dp_overlap=every"), "diloco", slow)
    assert every.total_s == pytest.approx(10 * C + 2 * (t - backward), rel=1e-12)
    assert priced(scenario(methods), "diloco", slow).total_s == pytest.approx(
        10 * C + 2 * t, rel=1e-12)
    assert priced(scenario(methods, "assume.dp_overlap=every"), "diloco",
                  net()).total_s == pytest.approx(10 * C, rel=1e-12)
