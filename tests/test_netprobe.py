"""`commbench netprobe`: the fit recovers known alpha/beta; real gloo ranks give a profile."""

import math
from dataclasses import replace

import pytest
import yaml

from bench.network import (
    Tier,
    all_gather_s,
    all_reduce_s,
    broadcast_s,
    exchange_s,
    get_profile,
    p2p_s,
    slow_start_extra_s,
)
from bench.node.netprobe import parse_size
from bench.node.netprobe_fit import (
    coefficients,
    exchange_scale,
    fit_profile,
    format_fit,
    write_profile,
)
from bench.node.netprobe_measure import flow_plan, probe, standing_queue
from tests.distributed import run_distributed


def synthetic_rows(tier_name, tier, n, sizes, extra_s=None, drift_s=None):
    """Rows as `probe` returns them, timed by the model itself on `tier`; with `extra_s`
    the exchange (that much beyond its formula), with `drift_s` the in-step all_reduce
    (latency + drift)."""
    rows = []
    for s in sizes:
        if extra_s is not None:
            rows.append(dict(tier=tier_name, op="exchange", n=2, nbytes=s,
                             seconds=exchange_s([s], tier, "gloo") + extra_s))
        if drift_s is not None:
            rows.append(dict(tier=tier_name, op="all_reduce_in_step", n=n, nbytes=s,
                             seconds=all_reduce_s(n, s, replace(
                                 tier, latency_s=tier.latency_s + drift_s), "gloo")))
        rows += [dict(tier=tier_name, op="p2p", n=2, nbytes=s, seconds=p2p_s(s, tier)),
                 dict(tier=tier_name, op="all_reduce", n=n, nbytes=s,
                      seconds=all_reduce_s(n, s, tier, "gloo")),
                 dict(tier=tier_name, op="all_gather", n=n, nbytes=s,
                      seconds=all_gather_s(n, s, tier, "gloo")),
                 dict(tier=tier_name, op="broadcast", n=n, nbytes=s,
                      seconds=broadcast_s(n, s, tier, "gloo"))]
    return rows


def test_coefficients_match_the_formulas():
    # gloo's ring all-reduce on 4 ranks, its two limits: a tiny message pays 4(n-1) = 12
    # latencies; with no latency the link carries 2 x 6 segments of S/8
    assert coefficients("all_reduce", 4, 1024, "gloo") == pytest.approx((12.0, 1.5))
    # segments are whole float32 elements: 1000 B -> 8 segments of 128 B
    assert coefficients("all_reduce", 4, 1000, "gloo") == pytest.approx((12.0, 1.536))
    assert coefficients("all_gather", 4, 1000, "gloo") == pytest.approx((6.0, 3.0))
    assert coefficients("p2p", 2, 1000, "gloo") == (1.0, 1.0)


def test_fit_recovers_alpha_beta_exchange_drift_and_writes_a_loadable_profile(tmp_path):
    inter = Tier(2e-3, 12.5e6, tcp_initial_window_B=14480)
    intra = Tier(20e-6, 1e9, tcp_initial_window_B=14480)
    # inter: exchanges 40 ms beyond their formula, 0.5 ms of drift per message in a step
    rows = synthetic_rows("inter", inter, 4, [4096, 65536, 2**20, 2**22], 0.04, 5e-4)
    rows += synthetic_rows("intra", intra, 2, [4096, 65536, 2**20, 2**22])
    # gloo: the inter link's round trip and the queue a bulk flow keeps standing
    rows += [dict(tier="inter", op="round_trip", n=2, nbytes=4, seconds=3e-3),
             dict(tier="inter", op="tcp_queue", n=2, nbytes=2**22, seconds=7e-3)]
    doc = fit_profile(rows, "gloo", "lab", "synthetic")
    out = tmp_path / "lab.yaml"
    write_profile(doc, out)
    p = get_profile(str(out))
    # the profile's latency is what a step's op sees: alpha + drift; alpha and the drift
    # are kept under fit:
    assert p.inter.latency_s == pytest.approx(2.5e-3, rel=1e-4)
    assert p.inter.bandwidth_Bps == pytest.approx(12.5e6)
    assert p.intra.latency_s == pytest.approx(20e-6) and p.intra.bandwidth_Bps == pytest.approx(1e9)
    fit = yaml.safe_load(out.read_text())["tiers"]["lab-inter"]["fit"]
    assert fit["link_latency_s"] == pytest.approx(2e-3) and fit["drift_s"] == pytest.approx(
        5e-4, rel=1e-3)
    # the exchange is measured, not fitted: its ratio to the projection's formula (alpha
    # + drift) at each size, which gives back what was measured (40 ms beyond its formula)
    sizes = [4096, 65536, 2**20, 2**22]
    assert [b for b, _ in p.inter.exchange_scale] == sizes
    for s, (_, ratio) in zip(sizes, p.inter.exchange_scale, strict=True):
        assert ratio == pytest.approx((2 * 2e-3 + s / 12.5e6 + 0.04) / (2 * 2.5e-3 + s / 12.5e6),
                                      rel=1e-3)
        assert exchange_s([s], p.inter, "gloo") == pytest.approx(
            exchange_s([s], inter, "gloo") + 0.04, rel=1e-3)
    assert p.intra.exchange_scale == ()  # no exchange measured there
    # the residuals cover the fitted points (the exchange's are its excess, not a misfit)
    assert fit["points"] == 24
    fitted = [r for r in fit["residuals"] if r["op"] != "exchange"]
    assert max(abs(r["rel_residual"]) for r in fitted) == pytest.approx(0, abs=1e-4)
    # gloo runs over TCP: the tiers carry Linux's initial window (slow start after idle)
    assert p.inter.tcp_initial_window_B == p.intra.tcp_initial_window_B == 14480
    # and the ramp runs on the measured round trip and queue, not on alpha + drift
    assert (p.inter.tcp_rtt_s, p.inter.tcp_queue_s) == (3e-3, 7e-3)
    assert p.inter.round_trip_s == 3e-3 and p.intra.round_trip_s == pytest.approx(40e-6)
    assert (p.intra.tcp_rtt_s, p.intra.tcp_queue_s) == (None, 0.0)  # not measured there
    assert "TCP round trip 3.00 ms, standing queue 7.00 ms" in format_fit(doc)
    nccl = fit_profile(rows, "nccl", "ib", "synthetic")
    assert all("tcp_initial_window" not in t and "tcp_rtt" not in t and "tcp_queue" not in t
               for t in nccl["tiers"].values())


def test_exchange_scale_leaves_out_the_probes_own_slow_start():
    # a probe idle longer than TCP's RTO paid slow start on each exchange; the ratio is of
    # the warm part, so the projection (ratio x warm + its own ramp) gives back the
    # measurement at the same idle, and a warm exchange without that ramp
    tier = Tier(10e-3, 1e6, tcp_initial_window_B=1000)
    rows = [dict(tier="inter", op="exchange", n=2, nbytes=s, idle_s=1.0,
                 seconds=1.3 * exchange_s([s], tier, "gloo") + slow_start_extra_s(s, tier, 1.0))
            for s in (10_000, 100_000)]
    assert slow_start_extra_s(10_000, tier, 1.0) > 0
    scale = exchange_scale(rows, tier, "gloo")
    assert [b for b, _ in scale] == [10_000, 100_000]
    assert [r for _, r in scale] == pytest.approx([1.3, 1.3])
    scaled = replace(tier, exchange_scale=scale)
    for r in rows:
        assert exchange_s([r["nbytes"]], scaled, "gloo", idle_s=1.0) == pytest.approx(r["seconds"])
    assert exchange_s([10_000], scaled, "gloo") == pytest.approx(1.3 * 0.03)


def test_the_queue_measurements_flow_is_bounded_whatever_the_rate():
    # 100 MB/s, 2 ms: half a second of data (5e7 B), pinged through its first 0.25 s
    assert flow_plan(1e8, 2e-3) == (50_000_000, pytest.approx(0.25))
    # a 50 ms round trip: 24 of them (1.2 s), slow start needs ~9 at 1 Gbit/s
    assert flow_plan(1e8, 0.05) == (120_000_000, pytest.approx(0.6))
    # a rate measured far too low (40 B/s: --sizes of a few bytes): the 4 MiB floor would
    # take 14 hours at that rate; the pings stop at the flow's planned 0.5 s
    assert flow_plan(40.0, 0.1) == (4 * 2**20, pytest.approx(2.4))
    assert flow_plan(40.0, 2e-3) == (4 * 2**20, pytest.approx(0.5))
    # a fast link: 256 MiB at most, pinged for half of what it takes at that rate
    assert flow_plan(1e11, 1e-5) == (256 * 2**20, pytest.approx(256 * 2**20 / 1e11 / 2))
    # a minute-long round trip plans at most 10 s
    assert flow_plan(1e6, 60.0) == (10_000_000, pytest.approx(5.0))


def test_standing_queue_by_hand():
    # the round trip is the smallest idle ping-pong; the queue the median loaded one past it
    assert standing_queue([2.4e-3, 2.2e-3, 2.6e-3], [6e-3, 9e-3, 7e-3]) == pytest.approx(
        (2.2e-3, 4.8e-3))
    # loaded pings no slower than idle ones (a fair-queueing qdisc, a flow done early): 0
    assert standing_queue([2.2e-3, 2.3e-3], [2.1e-3, 2.2e-3, 2.4e-3]) == (2.2e-3, 0.0)


def test_parse_size_names_the_bad_entry():
    assert parse_size("64KiB") == 65536 and parse_size("1MB") == 10**6
    with pytest.raises(ValueError, match=r"--sizes entries must be .* got '12 furlongs'"):
        parse_size("12 furlongs")


def _probe_and_fit(rank, world_size, out):
    rows = probe(rank, world_size, 2, [4096, 2**20], iters=1, tcp=True)
    if rank == 0:
        write_profile(fit_profile(rows, "gloo", "local", "test"), __import__("pathlib").Path(out))
    return len(rows)


@pytest.mark.slow  # 4 spawned interpreters: ~45 s on the shared 2-core machine
def test_netprobe_on_local_gloo_ranks(tmp_path):
    # 4 ranks, 2 per node: both tiers measured (6 ops x 2 sizes each, and the TCP link's
    # round trip and standing queue) on loopback
    out = tmp_path / "local.yaml"
    counts = run_distributed(_probe_and_fit, 4, str(out), timeout=120)
    assert counts == [28, 0, 0, 0]
    get_profile(str(out))  # loads
    tiers = yaml.safe_load(out.read_text())["tiers"]
    for name in ("local-intra", "local-inter"):
        assert tiers[name]["fit"]["points"] == 12
        assert math.isfinite(tiers[name]["fit"]["rms_rel_residual"])
        assert 0 < tiers[name]["tcp_rtt"] < 1 and 0 <= tiers[name]["tcp_queue"] < 1


def test_commbench_netprobe_cli(tmp_path):
    # the user's path: torchrun with 2 local gloo ranks, the profile lands at --out
    from bench.cli import main

    out = tmp_path / "mine.yaml"
    assert main(["netprobe", "--world-size", "2", "--out", str(out), "--sizes", "4KiB", "1MiB",
                 "--iters", "2", "--name", "mine", "--timeout", "240",
                 "--step-compute", "0.01", "--exchange-gap", "0.02"]) == 0
    p = get_profile(str(out))
    assert p.name == "mine"
    tiers = yaml.safe_load(out.read_text())["tiers"]
    assert tiers["mine-inter"]["fit"]["points"] == 12  # 6 ops x 2 sizes
    # gloo: TCP's round trip and standing queue measured (loopback: well under a second)
    assert 0 < p.inter.tcp_rtt_s < 1 and 0 <= p.inter.tcp_queue_s < 1
    assert tiers["mine-intra"]["fit"] == "not measured: copy of inter"


def test_caveats_name_loopback_and_cpu_oversubscription():
    from bench.node.netprobe import caveats

    assert caveats(local_ranks=1, cores=8, nodes=4) == []  # one rank per node: links
    one_host = caveats(local_ranks=4, cores=2, nodes=1)
    assert len(one_host) == 2
    assert "loopback" in one_host[0] and "4 ranks share 2 CPU cores" in one_host[1]
    assert caveats(local_ranks=8, cores=64, nodes=2) == []
