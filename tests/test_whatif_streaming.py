"""Streaming DiLoCo and compressed outer exchanges in the what-if, against hand computation.

    pytest tests/test_whatif_streaming.py

Same network and model as tests/test_whatif.py (naive formulas, latency A, bandwidth B,
blocks of BLOCK parameters, C seconds of compute a step, one GPU per node), two
replicas: an all-reduce of S bytes costs 2A + S/B; a quantized all-reduce of S coded
bytes (all-to-all A + S/(2B), then the all-gather of S/2: A + S/(2B)) costs the same.
Priced through algorithms/outer_traffic.py `streaming_traffic` (with one fragment, no
overlap and no codec: DiLoCo's plain round, which `fp32` below checks against).
Steady state (bench/study/whatif/engine.py): per H steps, each of the P fragments
exchanges once; 16 steps, priced as 4 periods of H (the last step's final syncs of every
fragment are not in the priced period). The descriptions were held record for record
against the ledgers of 4-rank runs (fp4 with overlap 1; top-k in replicas of 2).
"""

import pytest

from algorithms.outer import WIRE_BYTES
from algorithms.outer_traffic import streaming_traffic
from bench.network.profiles import Profile, Tier
from bench.study.whatif.assume import restate
from bench.study.whatif.engine import Compute, plan, price, synthetic_facts
from bench.study.whatif.scenario import method_config
from tests.test_whatif import BLOCK, A, B, C, net, scenario
from tests.test_whatif import priced as described


def priced(s, name: str, profile: Profile):
    """`name`'s steady-state price through `streaming_traffic` (what DiLoCo.traffic
    is to call for fragments, overlap and codecs), restated by the scenario's `assume`."""
    cfg = method_config(s, name)
    c = cfg.strategy
    facts = synthetic_facts(int(s.model_size.num_params), s.model_size.n_layer)
    traffic = restate(streaming_traffic(c, cfg, facts, WIRE_BYTES[c.outer_grad_dtype]),
                      s.assume.exchange_dtype, s.assume.dp_overlap)
    p = plan(traffic, Compute(step_s=C), cfg.parallel.world_size, 1, profile)
    return price(p, profile, "naive")

H, P = 4, 2


def slow(factor: float = 1000) -> Profile:
    tier = Tier(A, B / factor, 1, None)
    return Profile("slow", tier, tier)


def streaming(**strategy) -> dict:
    return {"s": {"strategy": {"name": "diloco", "inner_steps": H, "fragments": P,
                               **strategy}}}


def test_a_streaming_fragment_exchange_without_overlap_blocks():
    """Two blocks, two fragments of one block each (4 BLOCK bytes): every H/P = 2 steps
    one fragment's all-reduce t blocks: utilisation = H C / (H C + P t)."""
    s = scenario(streaming(), "tokens=8192", blocks=2)
    for network, bandwidth in ((net(), B), (slow(), B / 1000)):
        t = 2 * A + 4 * BLOCK / bandwidth
        r = priced(s, "s", network)
        assert r.steps == 16
        assert r.total_s == pytest.approx(4 * (H * C + P * t), rel=1e-12)
        assert r.utilisation == pytest.approx(H * C / (H * C + P * t), rel=1e-12)


def test_a_streaming_fragment_exchange_overlapped_by_tau_steps():
    """overlap_steps = 1: each fragment's exchange runs under one step's compute, exposed
    max(0, t - C): hidden on the fast link, t - C per fragment on the slow one."""
    s = scenario(streaming(overlap_steps=1, mix_alpha=0.5), "tokens=8192", blocks=2)
    assert priced(s, "s", net()).utilisation == pytest.approx(1.0, rel=1e-12)
    t = 2 * A + 4 * BLOCK / (B / 1000)
    r = priced(s, "s", slow())
    assert r.total_s == pytest.approx(4 * (H * C + P * (t - C)), rel=1e-12)
    assert r.utilisation == pytest.approx(H * C / (H * C + P * (t - C)), rel=1e-12)


def test_an_fp4_exchange_sends_its_codes_and_scales():
    """DiLoCo (one fragment) with fp4: BLOCK = 2^19 elements in rows of 128 (whole rows
    per replica: 2 x 128 divides it), each row 64 bytes of codes and a 4-byte scale:
    S = 4096 x 68 bytes, against 4 x 2^19 in fp32; every H steps."""
    methods = {"fp32": {"strategy": {"name": "diloco", "inner_steps": H}},
               "fp4": {"strategy": {"name": "diloco", "inner_steps": H,
                                    "outer_compression": "fp4"}}}
    s = scenario(methods, "tokens=8192")
    coded = BLOCK // 128 * (64 + 4)
    for network, bandwidth in ((net(), B), (slow(), B / 1000)):
        t4, t32 = 2 * A + coded / bandwidth, 2 * A + 4 * BLOCK / bandwidth
        r = priced(s, "fp4", network)
        assert r.total_s == pytest.approx(4 * (H * C + t4), rel=1e-12)
        assert r.utilisation == pytest.approx(H * C / (H * C + t4), rel=1e-12)
        assert priced(s, "fp32", network).total_s == pytest.approx(4 * (H * C + t32),
                                                                   rel=1e-12)
    # one fragment, no codec: the plain round DiLoCo.traffic describes
    assert priced(s, "fp32", slow()).total_s == pytest.approx(
        described(s, "fp32", slow()).total_s, rel=1e-12)
    # a stated exchange dtype leaves the codec's bytes alone
    s16 = scenario(methods, "assume.exchange_dtype=bf16", "tokens=8192")
    assert priced(s16, "fp4", net()).total_s == pytest.approx(
        priced(s, "fp4", net()).total_s, rel=1e-12)


@pytest.mark.parametrize("name", ["diloco", "pier"])
def test_a_phase_of_exactly_two_periods_counts_the_final_syncs_once(name):
    """8 steps of H = 4 with P = 2 fragments (Pier: no lazy start): syncs after steps 2,
    4, 6 and 8, and at the last step the fragment not synced there too: 5 exchanges. The
    phase is exactly two periods long, so the steady-state period (steps 4-8) would hold
    the last step and count its final syncs twice (3 exchanges x 8/4 = 6); it is priced
    step by step instead."""
    strategy = {"name": name, "inner_steps": H, "fragments": P}
    if name == "pier":
        strategy |= {"warmup_fraction": 0.0, "schedule": "constant"}
    s = scenario({name: {"strategy": strategy}}, "tokens=4096", blocks=2)
    for network, bandwidth in ((net(), B), (slow(), B / 1000)):
        t = 2 * A + 4 * BLOCK / bandwidth
        r = described(s, name, network)
        assert r.steps == 8
        assert r.total_s == pytest.approx(8 * C + 5 * t, rel=1e-12)
