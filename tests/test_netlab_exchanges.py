"""The netlab's per-exchange reading of GASLoC's traces (tests/netlab/experiment.py
`exchange_per_op`), on hand-written traces: no namespaces, no root.

    pytest tests/test_netlab_exchanges.py
"""

from __future__ import annotations

import json

import pytest

from bench.network import get_profile
from bench.network.costs import TCP_MIN_RTO_S, slow_start_extra_s
from tests.netlab.experiment import Case, exchange_per_op
from tests.netlab.traced import trace_path

S = 498688  # GASLoC's tiny model, bytes each way


def _exchange(step, peer, end, seconds, peers=None):
    return dict(step=step, phase="gossip", op="exchange", group_size=2,
                peers=peers or [peer], nbytes=S, seconds=seconds, end=end)


def _consensus(step, end, peers=None):
    return dict(step=step, phase="metrics", op="all_reduce", group_size=2, peers=peers,
                nbytes=S, seconds=0.05, end=end)


@pytest.fixture
def lab_profile(tmp_path):
    """1 Gbit/s + 10 ms: one halving of the 499 kB window leaves half of it, a round trip
    of ramp, so every idle below shows in the price."""
    path = tmp_path / "p.yaml"
    path.write_text(Case("gasloc", (1000, 1000), (10, 10)).profile_yaml())
    return get_profile(str(path))


def _write(run_dir, traces):
    for rank, records in enumerate(traces):
        trace_path(run_dir, rank).write_text("".join(json.dumps(r) + "\n" for r in records))


def test_each_exchange_is_read_on_the_rank_that_arrived_last(tmp_path, lab_profile):
    """The later rank changes from round to round: each exchange is timed on the one that
    arrived last, and priced with the idle ITS connection had since its last op on it
    (the consensus all-reduce of a world of 2 counts: gloo carries it on that
    connection)."""
    tier = lab_profile.link(0, 1, 1)
    rto = TCP_MIN_RTO_S + 2 * tier.latency_s
    # rank 1 last at the first (cold) exchange, rank 0 at the second, rank 1 at the third
    rank0 = [_exchange(9, 1, 1.00, 0.150), _consensus(9, 1.25),
             _exchange(19, 1, 1.40, 0.040), _consensus(19, 1.50),
             _exchange(29, 1, 1.90, 0.120)]
    rank1 = [_exchange(9, 0, 1.00, 0.125), _consensus(9, 1.25),
             _exchange(19, 0, 1.40, 0.070), _consensus(19, 1.50),
             _exchange(29, 0, 1.90, 0.068)]
    _write(tmp_path, [rank0, rank1])
    ex = exchange_per_op(tmp_path, 2, lab_profile)

    warm = 2 * tier.latency_s + S / tier.bandwidth_Bps  # the gloo exchange, one peer
    # the second: rank 0's consensus ended 0.11 s before (from its exchange: 0.36 s,
    # which would cost a ramp); the third: rank 1's consensus 0.332 s before, a ramp
    assert (1.40 - 0.040) - 1.25 < rto < (1.40 - 0.040) - 1.00
    ramp = slow_start_extra_s(S, tier, (1.90 - 0.068) - 1.50)
    assert ramp > 0.01 and slow_start_extra_s(S, tier, (1.40 - 0.040) - 1.00) > 0.01
    assert ex.count == 2
    assert ex.steady[0] == pytest.approx((0.040 + 0.068) / 2)
    assert ex.steady[1] == pytest.approx(warm + ramp / 2)
    assert ex.cold[0] == pytest.approx(0.125)
    assert ex.cold[1] == pytest.approx(warm + slow_start_extra_s(S, tier))
    assert ex.cold[1] > ex.steady[1] > warm


def test_an_idle_under_the_rto_is_priced_warm(tmp_path, lab_profile):
    tier = lab_profile.link(0, 1, 1)
    rank0 = [_exchange(9, 1, 1.0, 0.13), _exchange(19, 1, 1.2, 0.065)]
    rank1 = [_exchange(9, 0, 1.0, 0.12), _exchange(19, 0, 1.2, 0.07)]
    _write(tmp_path, [rank0, rank1])
    ex = exchange_per_op(tmp_path, 2, lab_profile)
    assert ex.steady == pytest.approx((0.065, 2 * tier.latency_s + S / tier.bandwidth_Bps))


def test_a_subgroups_collective_is_another_connection(tmp_path, lab_profile):
    """A subgroup of the same two ranks is another process group: its own TCP connection,
    so its traffic does not warm the world's."""
    rank0 = [_exchange(9, 1, 1.0, 0.12), _consensus(9, 1.3, peers=[0, 1]),
             _exchange(19, 1, 1.4, 0.06)]
    rank1 = [_exchange(9, 0, 1.0, 0.13), _consensus(9, 1.3, peers=[0, 1]),
             _exchange(19, 0, 1.4, 0.07)]
    _write(tmp_path, [rank0, rank1])
    tier = lab_profile.link(0, 1, 1)
    idle = (1.4 - 0.06) - 1.0  # from the first exchange, not the subgroup's all-reduce
    assert slow_start_extra_s(S, tier, idle) > 0 == slow_start_extra_s(S, tier, 1.34 - 1.3)
    warm = 2 * tier.latency_s + S / tier.bandwidth_Bps
    assert exchange_per_op(tmp_path, 2, lab_profile).steady[1] == pytest.approx(
        warm + slow_start_extra_s(S, tier, idle))


@pytest.mark.parametrize("rank1, match", [
    ([], "traced on \\[0\\] only"),
    ([_exchange(9, 0, 1.0, 0.1, peers=[0, 2])], "one peer per exchange"),
])
def test_traces_it_cannot_read_are_refused(tmp_path, lab_profile, rank1, match):
    _write(tmp_path, [[_exchange(9, 1, 1.0, 0.1)], rank1])
    with pytest.raises(ValueError, match=match):
        exchange_per_op(tmp_path, 2, lab_profile)


def test_only_the_given_steps_are_read(tmp_path, lab_profile):
    """An A/B run's exchanges are read at its compared shaped steps only; the idle still
    runs from the last op before, at any step."""
    tier = lab_profile.link(0, 1, 1)
    rank0 = [_exchange(9, 1, 1.0, 0.13), _exchange(19, 1, 1.1, 0.065),
             _exchange(29, 1, 1.2, 0.05)]
    rank1 = [_exchange(9, 0, 1.0, 0.12), _exchange(19, 0, 1.1, 0.07),
             _exchange(29, 0, 1.2, 0.06)]
    _write(tmp_path, [rank0, rank1])
    ex = exchange_per_op(tmp_path, 2, lab_profile, steps=range(10, 20))
    assert ex.count == 1 and ex.cold is None
    assert ex.steady == pytest.approx((0.065, 2 * tier.latency_s + S / tier.bandwidth_Bps))
    assert exchange_per_op(tmp_path, 2, lab_profile).count == 2
    with pytest.raises(ValueError, match="at steps 30-39"):
        exchange_per_op(tmp_path, 2, lab_profile, steps=range(30, 40))
