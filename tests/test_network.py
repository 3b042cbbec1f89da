"""The alpha-beta cost model against hand-computed values; YAML profiles; heterogeneous
links; backend formulas; the overlap timeline; the defects issue #17 found."""

import math
from dataclasses import replace

import pytest

from algorithms.base import StepStats
from algorithms.comm import CommRecord
from bench.network import (
    ETH_10G,
    IB_400G,
    NVLINK,
    PROFILES,
    WAN_1G,
    Profile,
    Tier,
    all_gather_s,
    all_reduce_s,
    barrier_s,
    broadcast_s,
    bucket_timeline,
    delay_policy,
    exchange_s,
    get_profile,
    link_keys,
    p2p_s,
    project,
    project_overlap,
    record_seconds,
    reduce_scatter_s,
    sites_profile,
    slow_start_extra_s,
    wire_bytes,
)
from bench.network.model import shared_tier
from bench.network.profiles import parse_tier

MB = 1e6
TIER = Tier(latency_s=10e-6, bandwidth_Bps=10e9)  # alpha = 10 us, beta = 10 GB/s


def rec(op, nbytes, group_size, peers=None, tier="inter"):
    return CommRecord(step=0, phase="train", op=op, group_size=group_size, peers=peers,
                      nbytes=nbytes, seconds=0.0, tier=tier)


def test_formulas_by_hand():
    # ring all-reduce, 4 ranks, 1 MB: 2 (n-1) (alpha + S / (n beta))
    assert all_reduce_s(4, MB, TIER) == pytest.approx(2 * 3 * (1e-5 + 1e6 / (4 * 1e10)))
    # binomial broadcast, 4 ranks: ceil(log2 4) = 2 rounds of alpha + S/beta
    assert broadcast_s(4, MB, TIER) == pytest.approx(2 * (1e-5 + 1e6 / 1e10))
    # 5 ranks need ceil(log2 5) = 3 rounds
    assert broadcast_s(5, MB, TIER) == pytest.approx(3 * (1e-5 + 1e6 / 1e10))
    # ring all-gather of 1 MB per rank: (n-1)(alpha + S/beta)
    assert all_gather_s(4, MB, TIER) == pytest.approx(3 * (1e-5 + 1e6 / 1e10))
    assert p2p_s(MB, TIER) == pytest.approx(1e-5 + 1e6 / 1e10)
    # a group of one rank communicates nothing
    assert all_reduce_s(1, MB, TIER) == broadcast_s(1, MB, TIER) == all_gather_s(1, MB, TIER) == 0


def test_profiles_by_hand():
    # eth-10g across nodes: alpha = 50 us, beta = 1.25 GB/s; 4 ranks, one per node, 100 MB
    eth = get_profile("eth-10g")
    expected = 2 * 3 * (50e-6 + 100e6 / (4 * 1.25e9))
    assert record_seconds(rec("all_reduce", 100 * MB, 4), eth, 0, 1) == pytest.approx(expected)
    # the same 4 ranks on one node ride NVLink: alpha = 5 us, beta = 450 GB/s
    assert record_seconds(rec("all_reduce", 100 * MB, 4), eth, 0, 4) == pytest.approx(
        2 * 3 * (5e-6 + 100e6 / (4 * 450e9))
    )
    # wan-1g: broadcast over 2 nodes, 1 MB: 1 round of 10 ms + 1e6 / 125e6
    wan = get_profile("wan-1g")
    assert record_seconds(rec("broadcast", MB, 2), wan) == pytest.approx(10e-3 + 1e6 / 125e6)
    # wan-1g: send 1 MB to rank 1 on another node
    assert record_seconds(rec("send", MB, 2, peers=(1,)), wan, 0, 1) == pytest.approx(
        10e-3 + 1e6 / 125e6
    )


def test_required_profiles_exist():
    assert {"nvlink", "ib-400g", "eth-100g", "eth-10g", "wan-1g", "two-sites"} <= set(PROFILES)
    assert get_profile("nvlink").inter == NVLINK
    assert get_profile("eth-10g").inter == ETH_10G


def test_unknown_profile():
    with pytest.raises(ValueError, match=r"network profile must be one of \[.*'wan-1g'.*\] or a "
                                         r"path to a YAML profile .*, got 'dialup'"):
        get_profile("dialup")


def test_unknown_op():
    with pytest.raises(ValueError, match="cannot model comm op 'teleport'"):
        record_seconds(rec("teleport", 1, 2), get_profile("nvlink"))


def test_heterogeneous_links():
    two = get_profile("two-sites")  # nodes 0,1 in site 0; nodes 2,3 in site 1
    assert two.link(0, 1, ranks_per_node=1) == IB_400G
    assert two.link(1, 2, ranks_per_node=1) == WAN_1G
    assert two.link(2, 3, ranks_per_node=2) == NVLINK  # same node
    # p2p: the cross-site pair pays the WAN, the in-site pair InfiniBand
    cross = record_seconds(rec("send", MB, 2, peers=(2,)), two, 0, 1)
    within = record_seconds(rec("send", MB, 2, peers=(1,)), two, 0, 1)
    assert cross == pytest.approx(p2p_s(MB, WAN_1G))
    assert within == pytest.approx(p2p_s(MB, IB_400G))
    # an all-reduce over the world spans both sites: it waits for the WAN
    world = record_seconds(rec("all_reduce", MB, 4), two, 0, 1)
    assert world == pytest.approx(all_reduce_s(4, MB, WAN_1G))
    # a subgroup inside one site uses the site's fabric; one spanning sites uses the WAN
    assert record_seconds(rec("all_reduce", MB, 2, peers=(2, 3)), two, 2, 1) == pytest.approx(
        all_reduce_s(2, MB, IB_400G)
    )
    assert record_seconds(rec("all_reduce", MB, 2, peers=(0, 2)), two, 0, 1) == pytest.approx(
        all_reduce_s(2, MB, WAN_1G)
    )
    with pytest.raises(ValueError, match="describes 4 nodes, got node 4"):
        two.link(0, 4, ranks_per_node=1)


def test_sites_profile_and_validation():
    p = sites_profile("3-sites", (0, 1, 2), NVLINK, IB_400G, ETH_10G)
    assert p.link(0, 2) == ETH_10G and p.link(1, 1) == NVLINK
    with pytest.raises(ValueError, match="square"):
        Profile("bad", NVLINK, NVLINK, links=((NVLINK,), (NVLINK, NVLINK)))
    with pytest.raises(ValueError, match="bandwidth_Bps must be > 0"):
        Tier(1e-6, 0)


def test_project_and_delay_policy_agree():
    # on warm connections (wan-1g's TCP slow start: test_emulation_pays_slow_start_...)
    wan = get_profile("wan-1g")
    wan = Profile("warm-wan", wan.intra, replace(wan.inter, tcp_initial_window_B=None))
    records = [rec("all_reduce", MB, 2), rec("send", MB, 2, peers=(1,)), rec("recv", MB, 2, (1,))]
    expected = all_reduce_s(2, MB, WAN_1G) + 2 * p2p_s(MB, WAN_1G)
    assert project(records, wan, 0, 1) == pytest.approx(expected)
    # emulation of ops run one after the other (the caller sleeps until each op's end)
    now = [0.0]
    delay = delay_policy(wan, 0, 1, clock=lambda: now[0])
    total = 0.0
    for r in records:
        took = delay(r)
        now[0] += took
        total += took
    assert total == pytest.approx(expected)
    assert project(records, wan, 0, 2) == pytest.approx(
        all_reduce_s(2, MB, NVLINK) + 2 * p2p_s(MB, NVLINK)
    )


# ---------------------------------------------------------------- known defects (issue #17)
# Each of these failed on the model before the fix (old bench/network.py).


def test_exchange_peers_share_the_rank_link():
    # gossip: 2 peers on other nodes, 1 MB to each (nbytes = 2 MB sent in total). The two
    # messages leave over this rank's one link one after the other: alpha + 2 * 1 MB / beta,
    # not alpha + 1 MB / beta as if each peer had its own link.
    wan = get_profile("wan-1g")
    got = record_seconds(rec("exchange", 2 * MB, 3, peers=(1, 2)), wan, 0, 1)
    assert got == pytest.approx(10e-3 + 2 * MB / 125e6)
    # one peer in the node (NVLink), one outside (WAN): separate links, run concurrently
    mixed = record_seconds(rec("exchange", 2 * MB, 3, peers=(1, 2)), wan, 0, 2)
    assert mixed == pytest.approx(max(p2p_s(MB, WAN_1G), p2p_s(MB, NVLINK)))


def test_gloo_exchange_waits_for_the_peers_ready_to_receive():
    # gloo sends only after the receiver's ready-to-receive notification; in an exchange
    # both peers post isend and irecv at once, so the notification's one-way latency comes
    # first: 2 alpha + sum S_p / beta on the shared link (shaped links: GASLoC's exchange
    # ran ~2x the one-alpha model at 10 ms).
    wan = get_profile("wan-1g")
    got = record_seconds(rec("exchange", 2 * MB, 3, peers=(1, 2)), wan, 0, 1, backend="gloo")
    assert got == pytest.approx(2 * 10e-3 + 2 * MB / 125e6)
    nccl = record_seconds(rec("exchange", 2 * MB, 3, peers=(1, 2)), wan, 0, 1, backend="nccl")
    assert nccl == pytest.approx(10e-3 + 2 * MB / 125e6)


def test_hierarchical_outer_all_reduces_share_the_node_link():
    # 2 nodes x 4 ranks, DiLoCo with a replica per node: the cross groups are (0,4), (1,5),
    # (2,6), (3,7); all four all-reduce |theta| out of each node at once over one 10 GbE NIC,
    # so each gets a quarter of its bandwidth.
    eth = get_profile("eth-10g")
    got = record_seconds(rec("all_reduce", 100 * MB, 2, peers=(0, 4)), eth, 0, 4)
    assert got == pytest.approx(2 * 1 * (50e-6 + 100 * MB / (2 * 1.25e9 / 4)))
    # the whole world's all-reduce crosses each node link once: no sharing
    world = record_seconds(rec("all_reduce", 100 * MB, 8), eth, 0, 4)
    assert world == pytest.approx(all_reduce_s(8, 100 * MB, ETH_10G))


def test_emulation_queues_overlapping_ops_on_the_link():
    # Two DDP buckets launched together whose completion callbacks run in parallel (gloo):
    # the second must wait for the first on the modelled link, i.e. take 2x from launch.
    slow = Profile("slow", Tier(1.0, 1e6), Tier(1.0, 1e6))
    delay = delay_policy(slow, 0, 1)
    bucket = rec("all_reduce", 0, 2)  # seconds=0: launched just now
    first = delay(bucket)
    second = delay(bucket)
    cost = all_reduce_s(2, 0, Tier(1.0, 1e6))
    assert first == pytest.approx(cost, rel=1e-3)
    assert second == pytest.approx(2 * cost, rel=1e-3)


def test_emulation_pays_slow_start_on_connections_idle_past_the_rto():
    # a fake clock: ops complete instantly (seconds=0) at the times we set
    tcp = Tier(10e-3, 1e6, tcp_initial_window_B=1000)
    now = [0.0]
    delay = delay_policy(Profile("tcp", tcp, tcp), 0, 1, clock=lambda: now[0])
    send = rec("send", 10_000, 2, peers=(1,))
    warm = p2p_s(10_000, tcp)
    assert delay(send) == pytest.approx(warm + 0.053)  # a new connection: full ramp
    now[0] = 0.1  # 0.1 s after launch, i.e. right after the first op ended: warm
    assert delay(send) == pytest.approx(warm)
    now[0] = 2.0  # idle ~1.9 s: many RTOs, back to the initial window
    assert delay(send) == pytest.approx(warm + 0.053)


# ---------------------------------------------------------------- profiles as YAML data


def test_builtin_profiles_come_from_the_shipped_yaml():
    assert get_profile("wan-1g").inter == Tier(10e-3, 125e6, tcp_initial_window_B=14480)
    assert get_profile("ib-400g").inter == Tier(5e-6, 50e9, nics=8)
    two = get_profile("two-sites")
    assert [[two.node_link(a, b) for b in range(4)][a ^ 1] for a in range(4)] == [IB_400G] * 4


def test_user_yaml_profile_by_path(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text(
        "tiers:\n"
        "  lab: {latency: 10ms, bandwidth: 100Mbit/s}\n"
        "profiles:\n"
        "  lab-sites:\n"
        "    intra: nvlink\n"                      # a built-in tier name
        "    sites: {site_of_node: [0, 0, 1], within: lab, across: wan-1g}\n"
        "    links:\n"
        "      - {nodes: [0, 1], tier: {latency_s: 0.002, bandwidth_Bps: 5.0e6}}\n"
        "  flat:\n"
        "    intra: {latency: 5us, bandwidth: 1GiB/s}\n"
        "    inter: lab\n")
    with pytest.raises(ValueError, match=r"holds \['flat', 'lab-sites'\]: pick one with"):
        get_profile(str(path))
    p = get_profile(f"{path}#lab-sites")
    lab = Tier(10e-3, 100e6 / 8)
    assert p.node_link(0, 1) == p.node_link(1, 0) == Tier(2e-3, 5e6)  # per-link override
    assert p.node_link(1, 2) == WAN_1G and p.node_link(0, 0) == NVLINK
    flat = get_profile(f"{path}#flat")
    assert flat.inter == lab and flat.intra == Tier(5e-6, 2.0**30)
    # a file with a single top-level profile, named after the file
    one = tmp_path / "mine.yaml"
    one.write_text("intra: nvlink\ninter: {latency: 1ms, bandwidth: 1Gbps}\n")
    assert get_profile(str(one)).name == "mine"
    assert get_profile(str(one)).inter == Tier(1e-3, 1e9 / 8)
    assert project([rec("send", MB, 2, peers=(1,))], get_profile(str(one))) == pytest.approx(
        1e-3 + MB / (1e9 / 8))


@pytest.mark.parametrize("text, message", [
    ("intra: nvlink\ninter: {latency: 10 parsecs, bandwidth: 1GB/s}\n",
     r"mine.yaml.inter.latency must be a number of seconds or .*got '10 parsecs'"),
    ("intra: nvlink\ninter: {latency: 1ms, bandwidth: -5}\n",
     r"mine.yaml.inter.bandwidth must be from 125000 to 1e\+14 B/s .*got -5"),
    # issue 29: absurd or NaN links were accepted (an emulated run slept for ever)
    ("intra: nvlink\ninter: {latency: 1000000, bandwidth: 1GB/s}\n",
     r"mine.yaml.inter.latency must be from 0 to 10 s .*got 1000000"),
    ("intra: nvlink\ninter: {latency: .nan, bandwidth: 1GB/s}\n",
     r"mine.yaml.inter.latency must be from 0 to 10 s .*got nan"),
    ("intra: nvlink\ninter: {latency: 1ms, bandwidth: 1B/s}\n",
     r"mine.yaml.inter.bandwidth must be from 125000 .*got '1B/s'"),
    ("intra: nvlink\ninter: {latency: 1ms, bandwidth: .inf}\n",
     r"mine.yaml.inter.bandwidth must be from 125000 .*got inf"),
    ("intra: nvlink\ninter: fibre\n",
     r"mine.yaml.inter must be a tier name \(\[.*'wan-1g'\]\).*got 'fibre'"),
    ("intra: nvlink\ninter: {latency: 1ms, bandwith: 1GB/s}\n",
     r"mine.yaml.inter.bandwith must be absent: a tier's keys are"),
    ("intra: nvlink\n", r"mine.yaml.inter must be a tier \(the link between nodes\) or a `sites`"),
    ("intra: nvlink\ninter: wan-1g\nlinks: [{nodes: [1, 1], tier: wan-1g}]\n",
     r"mine.yaml.links\[0\].nodes must be two different node numbers >= 0, got \[1, 1\]"),
    ("intra: nvlink\ninter: {latency: 1ms, latency_s: 0.001, bandwidth: 1GB/s}\n",
     r"mine.yaml.inter.latency must be given exactly once"),
    ("intra: nvlink\ninter: {latency: 1ms, bandwidth: 1GB/s, tcp_initial_window: 0}\n",
     r"mine.yaml.inter.tcp_initial_window must be a number of bytes > 0 .*got 0"),
    ("intra: nvlink\ninter: {latency: 1ms, bandwidth: 1GB/s, exchange_scale: [[65536, 0]]}\n",
     r"mine.yaml.inter.exchange_scale must be a list of \[bytes per peer, measured / formula\]"
     r" pairs, sizes ascending, every number > 0 .*got \[65536, 0\]"),
    ("intra: nvlink\ninter: {latency: 1ms, bandwidth: 1GB/s, exchange_scale: [[2e6, 1.2], "
     "[65536, 1.1]]}\n", r"mine.yaml.inter.exchange_scale must be .*sizes ascending"),
    ("intra: nvlink\ninter: {latency: 1ms, bandwidth: 1GB/s, exchange_scale: 1.2}\n",
     r"mine.yaml.inter.exchange_scale must be a list .*got 1.2"),
    ("intra: nvlink\ninter: {latency: 1ms, bandwidth: 1GB/s, tcp_queue: -0.02}\n",
     r"mine.yaml.inter.tcp_queue must be from 0 to 10 s \(how long the link's bottleneck "
     r"buffer queues at line rate, e.g. 20ms; absent: a shallow buffer\), got -0.02"),
    ("intra: nvlink\ninter: {latency: 1ms, bandwidth: 1GB/s, tcp_queue: deep}\n",
     r"mine.yaml.inter.tcp_queue must be .*got 'deep'"),
    ("intra: nvlink\ninter: {latency: 1ms, bandwidth: 1GB/s, tcp_rtt: 0}\n",
     r"mine.yaml.inter.tcp_rtt must be > 0 and at most 20 s \(the link's round trip as TCP "
     r"sees it, e.g. 2.1ms; absent: twice the latency\), got 0"),
    ("intra: nvlink\ninter: {latency: 1ms, bandwidth: 1GB/s, tcp_rtt: soon}\n",
     r"mine.yaml.inter.tcp_rtt must be .*got 'soon'"),
])
def test_yaml_validation_names_field_value_and_valid(tmp_path, text, message):
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        get_profile(str(path))


# ---------------------------------------------------------------- backends and wire bytes


def test_gloo_all_reduce_replays_the_ring_by_hand():
    # 4 ranks, 8 segments of 4 B, alpha = 1 s, a segment takes 1 s on the link (beta = 4 B/s).
    # Reduce-scatter, 6 sends: send i leaves at max(post + 1, link free), arrives 1 s after
    # it left the link; iteration i >= 2 first waits for arrival i - 2:
    #   sends leave at 1, 2, 4, 5, 7, 8 and arrive at 3, 4, 6, 7, 9, 10 -> the phase ends at 10;
    # the all-gather phase repeats it 10 s later: 20 s. "2 alpha + S/(n beta) per ring step"
    # would say 24 (the handshake of one segment hides under the other's transfer), the
    # naive ring 18.
    assert all_reduce_s(4, 32, Tier(1.0, 4.0), "gloo") == pytest.approx(20.0)
    # two ranks: 4 segments, nothing to hide, 2 x (2 alpha + S/(2 beta)) = 4 alpha + S/beta
    assert all_reduce_s(2, 16, Tier(1.0, 4.0), "gloo") == pytest.approx(8.0)
    # latency bound, one element per segment (16 segments on 8 ranks): 4(n - 1) alpha;
    # bandwidth bound: 2(n - 1)/n S/beta, the ring's bytes
    assert all_reduce_s(8, 64, Tier(1e-3, 1e12), "gloo") == pytest.approx(28e-3)
    assert all_reduce_s(4, 64 * MB, Tier(0.0, 1e9), "gloo") == pytest.approx(1.5 * 64 * MB / 1e9)
    # segments of at most 1 MiB: 8 MiB on 2 ranks is 8 segments of 1 s, 4 sends per phase,
    # two in flight. With 2 ranks the ready-to-receive shares the pair's one connection
    # with this rank's data and waits behind what is already written to it:
    #   reduce-scatter: sends leave at 1, 2 (arrive 3, 4); at 3 data 1 is off the link, the
    #   notice leaves at 3, send 2 leaves at 4 (arrives 6); at 4 data 2 (written at 4) is
    #   on it until 5, send 3 leaves at 6 (arrives 8) -> the phase ends at 8;
    #   all-gather: leaves 9, 10, 12, 14, arrives 11, 12, 14, 16 -> 16 s.
    # Without the shared connection (n >= 3, notices to the other neighbour) it would be
    # 14; 2 x (2 alpha + 4 s) = 12.
    assert all_reduce_s(2, 8 * 2**20, Tier(1.0, 2.0**20), "gloo") == pytest.approx(16.0)


def test_gloo_all_reduce_of_a_few_elements_skips_the_empty_segments_by_hand():
    # gloo posts nothing for a segment past the buffer's end, so a tiny buffer is not the
    # symmetric ring: every rank is replayed. alpha = 1 s, a 4-byte segment takes 1 s.
    # One element on 2 ranks (4 segments, only segment 0 holds data):
    #   reduce-scatter: rank 1 sends segment 0 at 1 (rank 0's notice), off at 2, rank 0
    #   has it at 3; all-gather: rank 1 posted its receive at 2 (its send done), the
    #   notice is at rank 0 at 3, rank 0 sends at 3, off at 4, rank 1 has it at 5.
    assert all_reduce_s(2, 4, Tier(1.0, 4.0), "gloo") == pytest.approx(5.0)
    # the latency limit: the element crosses the ring twice after one notice, (2n - 1)
    # alpha, where the symmetric replay (and the segment-counted model before) said 4(n - 1)
    for n in (2, 3, 4, 8):
        assert all_reduce_s(n, 4, Tier(1.0, 1e12), "gloo") == pytest.approx(2 * n - 1)
    # 3 elements on 2 ranks: segments 0-2 hold one each, 3 is empty.
    #   reduce-scatter: rank 1 sends 0 and 1 (leave 1 and 2, arrive 3 and 4), rank 0 sends
    #   2 (leaves 1, arrives 3): rank 0 done at 4, rank 1 at 3 (its sends off at 2, 3);
    #   all-gather: rank 0 (from 4) sends 0 and 1 (rank 1's notices in at 4; leave 4, 5,
    #   arrive 6, 7); rank 1 (from 3) sends 2 once rank 0's notice is in at 5 (arrives 7)
    assert all_reduce_s(2, 12, Tier(1.0, 4.0), "gloo") == pytest.approx(7.0)
    # nothing to reduce: gloo returns at once; a barrier keeps the ring's latencies
    assert all_reduce_s(4, 0, Tier(1.0, 4.0), "gloo") == 0.0
    assert barrier_s(4, 0, Tier(1.0, 4.0), "gloo") == pytest.approx(12.0)


def test_backend_formulas_by_hand():
    a, b, n, s = 10e-3, 1e8, 4, 8 * MB
    t = Tier(a, b)
    assert all_reduce_s(n, s, t) == pytest.approx(2 * 3 * (a + s / (4 * b)))  # naive
    assert all_reduce_s(n, s, t, "nccl-ring") == all_reduce_s(n, s, t)
    # gloo: a ready-to-receive handshake before every send (all_reduce: next test)
    assert reduce_scatter_s(n, s, t, "gloo") == pytest.approx(3 * (2 * a + s / (4 * b)))
    assert all_gather_s(n, s, t, "gloo") == pytest.approx(3 * (2 * a + s / b))
    assert broadcast_s(n, s, t, "gloo") == pytest.approx(2 * (2 * a + s / b))
    assert p2p_s(s, t, "gloo") == pytest.approx(a + s / b)
    # NCCL double binary tree: 2 log2(n) alpha + 2 S / beta; nccl = the cheaper one
    tree = 2 * 2 * a + 2 * s / b
    assert all_reduce_s(n, s, t, "nccl-tree") == pytest.approx(tree)
    assert all_reduce_s(n, s, t, "nccl") == pytest.approx(min(tree, 6 * (a + s / (4 * b))))
    assert all_reduce_s(64, 1e3, t, "nccl") == pytest.approx(2 * 6 * a + 2e3 / b)  # tree wins
    assert broadcast_s(n, s, t, "nccl-ring") == pytest.approx(3 * a + s / b)
    # the backend reaches records through project / record_seconds
    assert project([rec("all_reduce", s, n)], Profile("p", t, t), backend="gloo") == \
        pytest.approx(all_reduce_s(n, s, t, "gloo"))
    with pytest.raises(ValueError, match=r"backend must be one of \['naive', 'gloo'.*got 'mpi'"):
        project([rec("all_reduce", s, n)], Profile("p", t, t), backend="mpi")


def test_wire_bytes():
    s = 1200
    assert wire_bytes(rec("all_reduce", s, 4)) == pytest.approx(2 * 3 / 4 * s)
    assert wire_bytes(rec("all_reduce", s, 4), backend="nccl-tree") == 2 * s
    assert wire_bytes(rec("reduce_scatter", s, 4)) == pytest.approx(3 / 4 * s)
    assert wire_bytes(rec("all_gather", s, 4)) == 3 * s
    assert wire_bytes(rec("broadcast", s, 4)) == pytest.approx(3 / 4 * s)
    assert wire_bytes(rec("send", s, 2, peers=(1,))) == s
    assert wire_bytes(rec("recv", s, 2, peers=(1,))) == 0
    assert wire_bytes(rec("exchange", 2 * s, 3, peers=(1, 2))) == 2 * s  # S per peer
    assert wire_bytes(rec("all_reduce", s, 1)) == 0


# ---------------------------------------------------------------- overlap with backward


def bucket(step, nbytes, lead_s):
    return CommRecord(step, "train", "all_reduce", 2, None, nbytes, 0.0, "inter", lead_s=lead_s)


def test_overlap_two_buckets_by_hand():
    # alpha = 0, beta = 1 MB/s, 2 ranks: an all-reduce of S bytes takes S / 1 MB seconds.
    p = Profile("p", Tier(0.0, 1e6), Tier(0.0, 1e6))
    # bucket 1 ready 3 s before the end of backward, takes 2 s -> ends at -1;
    # bucket 2 ready 0.5 s before the end, takes 1 s -> starts -0.5, ends at +0.5: 0.5 exposed
    step0 = [bucket(0, 2 * MB, 3.0), bucket(0, MB, 0.5)]
    assert bucket_timeline([(3.0, 2.0), (0.5, 1.0)]) == pytest.approx(0.5)
    assert project_overlap(step0, p) == pytest.approx(0.5)
    # bucket 1 ready 1 s before the end, takes 2 s -> ends +1; bucket 2 (ready -0.5) waits for
    # it on the link: +1 -> +2. Exposed 2 s, the plain sum says 3 s.
    step1 = [bucket(1, 2 * MB, 1.0), bucket(1, MB, 0.5)]
    assert project_overlap(step1, p) == pytest.approx(2.0)
    assert project(step1, p) == pytest.approx(3.0)
    # everything hidden: 0 exposed; a record without lead_s is added in full
    hidden = [bucket(2, MB, 5.0), bucket(2, MB, None)]
    assert project_overlap(hidden, p) == pytest.approx(1.0)
    assert project(step0 + step1 + hidden, p, overlap=True) == pytest.approx(0.5 + 2.0 + 1.0)
    # records without lead_s (lead_s None) never overlap
    plain = [rec("all_reduce", MB, 2), rec("all_reduce", MB, 2)]
    assert project_overlap(plain, p) == pytest.approx(project(plain, p)) == pytest.approx(2.0)


def test_config_accepts_profile_paths(tmp_path):
    from bench.config import load_config

    path = tmp_path / "mine.yaml"
    path.write_text("intra: nvlink\ninter: {latency: 1ms, bandwidth: 1Gbps}\n")
    cfg = load_config(None, [f"network.profiles=[eth-10g, {path}]", f"network.emulate={path}"])
    assert cfg.network.profiles == ["eth-10g", str(path)] and cfg.network.emulate == str(path)
    path.write_text("intra: nvlink\ninter: {latency: 1ms, bandwidth: fast}\n")
    with pytest.raises(ValueError, match=r"mine.yaml.inter.bandwidth must be .* got 'fast'"):
        load_config(None, [f"network.profiles=[{path}]"])


# ---------------------------------------------------------------- TCP slow start on cold links


def test_slow_start_by_hand():
    # alpha 10 ms (round trip 20 ms), beta 1 MB/s, initial window 1000 B: a 10 kB message
    # goes in rounds of 1000, 2000, 4000 B (each a round trip instead of w / beta), then the
    # remaining 3000 B at line rate: extra = (.02 - .001) + (.02 - .002) + (.02 - .004)
    tcp = Tier(10e-3, 1e6, tcp_initial_window_B=1000)
    assert slow_start_extra_s(10_000, tcp) == pytest.approx(0.053)
    # the window stops growing at the bandwidth-delay product (1e5 B/s x 20 ms = 2000 B)
    slow = Tier(10e-3, 1e5, tcp_initial_window_B=1000)
    assert slow_start_extra_s(10_000, slow) == pytest.approx(0.02 - 0.01)
    # nothing for a message inside the first window, or a tier without TCP slow start
    assert slow_start_extra_s(1000, tcp) == 0.0
    assert slow_start_extra_s(10_000, Tier(10e-3, 1e6)) == 0.0
    # from YAML
    assert parse_tier({"latency": "10ms", "bandwidth": 1e6, "tcp_initial_window": 1000},
                      "t", {}) == tcp


def test_slow_start_after_idle_restarts_the_window():
    # Linux halves the window once per RTO of idle beyond the first (RTO = 200 ms + one
    # round trip = 220 ms here), from what the message needed (10 kB), down to w0
    tcp = Tier(10e-3, 1e6, tcp_initial_window_B=1000)
    assert slow_start_extra_s(10_000, tcp, idle_s=0.1) == 0.0  # shorter than the RTO
    # 0.3 s: one halving, 5000 B: one round of 5000 B, then the window covers the rest
    assert slow_start_extra_s(10_000, tcp, idle_s=0.3) == pytest.approx(0.02 - 0.005)
    # 1 s: four halvings, down to w0: the full ramp, as for a connection never used
    assert slow_start_extra_s(10_000, tcp, idle_s=1.0) == pytest.approx(0.053)


def test_the_buffer_decides_the_ramp_after_an_idle():
    # 125 kB/s x 20 ms = 2500 B in flight. Without a buffer losses cap the window there:
    # one halving (0.3 s idle) leaves 1250 B, a round below the path's 2500 B. Behind a
    # 100 ms queue the window is the 10 kB message itself: 5000 B after the halving
    shallow = Tier(10e-3, 1.25e5, tcp_initial_window_B=1000)
    deep = Tier(10e-3, 1.25e5, tcp_initial_window_B=1000, tcp_queue_s=0.1)
    assert slow_start_extra_s(10_000, shallow, idle_s=0.3) == pytest.approx(0.02 - 0.01)
    assert slow_start_extra_s(10_000, deep, idle_s=0.3) == 0.0
    # a buffer of 10 ms: 125 kB/s x 30 ms = 3750 B, 1875 B after the halving: a round
    mid = Tier(10e-3, 1.25e5, tcp_initial_window_B=1000, tcp_queue_s=0.01)
    assert slow_start_extra_s(10_000, mid, idle_s=0.3) == pytest.approx(0.02 - 0.015)
    # a cold connection ramps from w0 whatever the buffer
    assert slow_start_extra_s(10_000, deep) == slow_start_extra_s(10_000, shallow) > 0
    assert parse_tier({"latency": "10ms", "bandwidth": 1.25e5, "tcp_initial_window": 1000,
                       "tcp_queue": "100ms"}, "t", {}) == deep
    with pytest.raises(ValueError, match="tcp_queue_s must be from 0 to 10 s"):
        Tier(10e-3, 1.25e5, tcp_queue_s=-1.0)


def test_a_measured_round_trip_runs_the_ramp_and_the_rto():
    # latency 10 ms (2 alpha = 20 ms) but TCP's round trip measured at 10 ms: 125 kB/s x
    # 10 ms = 1250 B in flight. Cold, 10 kB: one round of w0 = 1000 B (10 - 8 ms), then the
    # window (2000 B) covers the path. On 2 alpha: rounds of 1000 and 2000 B against 20 ms
    measured = Tier(10e-3, 1.25e5, tcp_initial_window_B=1000, tcp_rtt_s=0.01)
    plain = Tier(10e-3, 1.25e5, tcp_initial_window_B=1000)
    assert measured.round_trip_s == 0.01 and plain.round_trip_s == 0.02
    assert slow_start_extra_s(10_000, measured) == pytest.approx(0.01 - 0.008)
    assert slow_start_extra_s(10_000, plain) == pytest.approx((0.02 - 0.008) + (0.02 - 0.016))
    # the RTO is 200 ms + the round trip: 215 ms of idle restarts the measured link's window
    # (one halving of min(10 kB, 1250 B), held at w0: the cold ramp) and not the other's
    assert slow_start_extra_s(10_000, measured, idle_s=0.215) == pytest.approx(0.002)
    assert slow_start_extra_s(10_000, plain, idle_s=0.215) == 0.0
    assert parse_tier({"latency": "10ms", "bandwidth": 1.25e5, "tcp_initial_window": 1000,
                       "tcp_rtt": "10ms"}, "t", {}) == measured
    with pytest.raises(ValueError, match=r"tcp_rtt_s must be > 0 and at most 20 s, or None"):
        Tier(10e-3, 1.25e5, tcp_rtt_s=0.0)


def test_exchange_formula_by_hand():
    # gloo's exchange: 2 alpha (the ready-to-receive) + S / beta, plus the ramp when cold
    tier = Tier(1e-3, 10e6, tcp_initial_window_B=10_000)
    assert exchange_s([100_000], tier, "gloo") == pytest.approx(0.012)
    # cold: one round of 10 kB before the window fills the path (10 MB/s x 2 ms = 20 kB)
    assert exchange_s([100_000], tier, "gloo", idle_s=math.inf) == pytest.approx(0.013)
    assert exchange_s([100_000], tier, "naive") == pytest.approx(0.011)
    # the projection prices a one-peer gossip record the same way
    assert project([rec("exchange", 100_000, 2, peers=(1,))], Profile("t", tier, tier), 0, 1,
                   backend="gloo", idle=math.inf) == pytest.approx(0.013)


def test_measured_exchange_scale_by_hand():
    # netprobe's measured ratios (bytes per peer, measured / formula): linear in log(size)
    # between the sizes, held beyond them; 1 without any
    tier = Tier(1e-3, 10e6, tcp_initial_window_B=10_000,
                exchange_scale=((1_000.0, 1.0), (100_000.0, 2.0)))
    assert tier.exchange_factor(10_000) == pytest.approx(1.5)
    assert tier.exchange_factor(100) == 1.0 and tier.exchange_factor(10**7) == 2.0
    assert Tier(1e-3, 10e6).exchange_factor(10_000) == 1.0
    # it scales the warm exchange (2 alpha + S / beta = 12 ms at 100 kB), not the ramp
    assert exchange_s([100_000], tier, "gloo") == pytest.approx(0.024)
    assert exchange_s([100_000], tier, "gloo", idle_s=math.inf) == pytest.approx(0.025)
    # the projection: one peer as exchange_s; two peers on this rank's one link, 50 kB
    # each (ratio 1 + log(50)/log(100) = 1.849): 1.849 x (2 ms + 10 ms)
    prof = Profile("t", tier, tier)
    assert project([rec("exchange", 100_000, 2, peers=(1,))], prof, 0, 1, backend="gloo",
                   idle=math.inf) == pytest.approx(0.025)
    two = record_seconds(rec("exchange", 100_000, 3, peers=(1, 2)), prof, 0, 1, backend="gloo")
    assert two == pytest.approx((1 + math.log(50) / math.log(100)) * 0.012)
    # a shared inter-node tier keeps the measurement
    assert shared_tier(tier, 2).exchange_factor(100_000) == 2.0
    with pytest.raises(ValueError, match="exchange_scale must be .* sizes ascending"):
        Tier(1e-3, 10e6, exchange_scale=((2.0, 1.0), (1.0, 1.0)))


def test_cold_links_pay_slow_start_once_per_op():
    tcp = Tier(10e-3, 1e6, tcp_initial_window_B=1000)
    net = Profile("tcp", tcp, tcp)
    # gossip exchange with one peer, 10 kB: gloo's 2 alpha + S/beta, plus the ramp when cold
    ex = rec("exchange", 10_000, 2, peers=(1,))
    warm = project([ex], net, 0, 1, backend="gloo")
    assert warm == pytest.approx(0.02 + 0.01)
    assert project([ex], net, 0, 1, backend="gloo", idle=math.inf) == pytest.approx(warm + 0.053)
    # per connection: only the peer that was idle pays
    idle = {("peer", 1): math.inf, ("peer", 2): 0.0}
    assert project([rec("send", 10_000, 2, peers=(2,))], net, idle=idle.get) == pytest.approx(
        0.01 + 0.01)
    assert project([rec("send", 10_000, 2, peers=(1,))], net, idle=idle.get) == pytest.approx(
        0.01 + 0.01 + 0.053)
    # ring all-reduce on 2 ranks: the first message is a chunk, S/n = 10 kB of 20 kB
    ar = rec("all_reduce", 20_000, 2)
    warm = project([ar], net, 0, 1)
    assert project([ar], net, 0, 1, idle=math.inf) == pytest.approx(warm + 0.053)
    assert link_keys(ar) == [("group", (0, 1))]
    assert link_keys(rec("exchange", 1, 3, peers=(1, 2))) == [("peer", 1), ("peer", 2)]


def test_slow_start_follows_the_algorithm_nccl_picks():
    # 64 ranks, 100 kB on a TCP tier (NCCL over sockets): the tree is the cheaper
    # all-reduce, and its first message is the whole 100 kB (the ring's would be S/64 =
    # 1.6 kB, inside the initial window: no ramp at all)
    tcp = Tier(10e-3, 1e8, tcp_initial_window_B=14480)
    ar = rec("all_reduce", 100_000, 64)
    tree = all_reduce_s(64, 100_000, tcp, "nccl-tree")
    assert all_reduce_s(64, 100_000, tcp, "nccl") == tree
    cold = project([ar], Profile("tcp", tcp, tcp), 0, 1, backend="nccl", idle=math.inf)
    assert cold == pytest.approx(tree + slow_start_extra_s(100_000, tcp))
    # two ramp rounds before the window (57.9 kB) covers what is left of 100 kB
    assert slow_start_extra_s(100_000, tcp) == pytest.approx(
        (0.02 - 14480 / 1e8) + (0.02 - 28960 / 1e8))
    # the ring keeps its chunk: 2 ranks, 1 MB -> the ring wins, first message 500 kB
    ar2 = rec("all_reduce", 1e6, 2)
    ring = all_reduce_s(2, 1e6, tcp, "nccl-ring")
    assert project([ar2], Profile("tcp", tcp, tcp), 0, 1, backend="nccl", idle=math.inf) == \
        pytest.approx(ring + slow_start_extra_s(5e5, tcp))


def test_step_clock_prices_idle_connections():
    """The loop's clock: a connection unused since the previous step is warm; one unused
    for a modelled second (four RTOs) restarts from the initial window."""
    import torch

    from bench.run.meter import StepClock

    tcp = Tier(10e-3, 1e6, tcp_initial_window_B=1000)
    clock = StepClock({"tcp": Profile("tcp", tcp, tcp)}, 0, 1, torch.device("cpu"))
    ar = rec("all_reduce", 20_000, 2)
    stats = StepStats(loss=1.0, tokens=1)
    for records in ([ar], [ar], [], [ar]):
        clock.add(1.0, stats, records)
    overlap_aware = clock.projected[0::2]  # [overlap, no-overlap] per step
    warm = 1.0 + all_reduce_s(2, 20_000, tcp)
    assert overlap_aware == pytest.approx([warm + 0.053, warm, 1.0, warm + 0.053])
    assert clock.coupled == [1.0, 1.0, 0.0, 1.0]
    # two records on one cold connection in one step (two DDP buckets): the first ramps the
    # window up, the second finds it open; a record on another group still pays
    clock = StepClock({"tcp": Profile("tcp", tcp, tcp)}, 0, 1, torch.device("cpu"))
    other = rec("all_reduce", 20_000, 2, peers=(0, 2))
    clock.add(1.0, stats, [ar, ar, other])
    no_overlap = clock.projected[1]
    assert no_overlap == pytest.approx(1.0 + 3 * all_reduce_s(2, 20_000, tcp) + 2 * 0.053)
    overlap_aware = clock.projected[0]  # no bucket overlaps: the same, minus 1 s compute
    assert overlap_aware - 1.0 == pytest.approx(2 * 0.053 + 3 * all_reduce_s(2, 20_000, tcp))


# ------------------------------------------- compressed and launched outer exchanges (#24)


def test_quantized_all_reduce_prices_all_to_all_then_all_gather_by_hand():
    """S coded bytes on 4 ranks: the all-to-all sends 3 S/4 at once (a + 3 S/(4 b)), the
    ring all-gather of each rank's S/4 coded mean 3 (a + S/(4 b)); wire 2 (n-1)/n S."""
    from bench.network.costs import COLLECTIVES

    price = COLLECTIVES["quantized_all_reduce"]
    expected = (1e-5 + 3 * MB / (4 * 1e10)) + 3 * (1e-5 + MB / (4 * 1e10))
    assert price(4, MB, TIER) == pytest.approx(expected)
    assert price(4, MB, TIER, "gloo") == pytest.approx(expected + 1e-5 + 3 * 1e-5)
    assert price(1, MB, TIER) == 0
    assert wire_bytes(rec("quantized_all_reduce", 1200, 4)) == pytest.approx(1800)


def test_launched_op_exposes_only_what_its_window_did_not_hide():
    """An exchange launched at the end of step 3 and waited for in step 5 ran beside step
    4's compute and step 5's up to the wait (all but tail_s)."""
    from bench.network.timeline import span_window_s

    p = Profile("p", Tier(0.0, 1e6), Tier(0.0, 1e6))
    launched = replace(rec("all_reduce", 3 * MB, 2), step=5, launch_step=3, tail_s=0.5)
    window = span_window_s(launched, 2.0, [9.0, 0.75])  # step 4 took 0.75 s of compute
    assert window == pytest.approx(0.75 + 1.5)
    cost = record_seconds(launched, p)
    assert cost == pytest.approx(3.0)
    assert project_overlap([launched], p) == pytest.approx(3.0)  # no window known: exposed
    from bench.network.model import exposed_s

    assert exposed_s([launched], [cost], lambda r: window) == pytest.approx(0.75)
    assert exposed_s([launched], [cost], lambda r: 5.0) == 0.0
