"""The alpha-beta cost model against hand-computed values; profiles; heterogeneous links."""

import pytest

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
    broadcast_s,
    delay_policy,
    get_profile,
    p2p_s,
    project,
    record_seconds,
    sites_profile,
)

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
    # exchange with two peers, 2 MB sent in total: concurrent, 1 MB each -> one message
    assert record_seconds(rec("exchange", 2 * MB, 3, peers=(1, 2)), wan, 0, 1) == pytest.approx(
        10e-3 + 1e6 / 125e6
    )


def test_required_profiles_exist():
    assert {"nvlink", "ib-400g", "eth-100g", "eth-10g", "wan-1g", "two-sites"} <= set(PROFILES)
    assert get_profile("nvlink").inter == NVLINK
    assert get_profile("eth-10g").inter == ETH_10G


def test_unknown_profile():
    with pytest.raises(ValueError, match=r"network profile must be one of \[.*'wan-1g'.*\], "
                                         r"got 'dialup'"):
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
    wan = get_profile("wan-1g")
    records = [rec("all_reduce", MB, 2), rec("send", MB, 2, peers=(1,)), rec("recv", MB, 2, (1,))]
    expected = all_reduce_s(2, MB, WAN_1G) + 2 * p2p_s(MB, WAN_1G)
    assert project(records, wan, 0, 1) == pytest.approx(expected)
    delay = delay_policy(wan, 0, 1)
    assert sum(delay(r) for r in records) == pytest.approx(expected)
    assert project(records, wan, 0, 2) == pytest.approx(
        all_reduce_s(2, MB, NVLINK) + 2 * p2p_s(MB, NVLINK)
    )
