"""Streaming, overlap and compression on Pier, SparseLoCo and NoLoCo in the what-if (issue
48): each description against its run's ledger, record for record, and by hand.

    pytest tests/test_outer_traffic.py            (the real runs: -m slow, ~30 s each)

The descriptions (algorithms/outer_traffic.py `streaming_traffic` with each strategy's
exchange: Pier's lazy start then DiLoCo's exchange per fragment, SparseLoCo's all-gather of
each fragment's coded payload, NoLoCo's pairwise exchange of each fragment's (Δ, φ)) are
held against tiny gloo runs as tests/test_whatif.py holds DiLoCo's: every rank's records
of the training phases (step, phase, op, bytes, group size), and the what-if of the run's
own model, profiles and compute equal to its recorded projection.
"""

import pytest

from algorithms.streaming import StreamingSchedule
from bench.network.profiles import Profile, Tier
from tests.test_whatif import BLOCK, A, B, C, check_config, net, priced, run_settings, scenario

STREAMING = ["parallel.device=cpu", "strategy.fragments=2", "strategy.fragment_pattern=strided"]
"""Two fragments of the tiny preset's two blocks (the embedding with the first), on the CPU
(overlap is refused on CUDA)."""


def overrides(*extra: str) -> list[str]:
    return run_settings(["parallel.world_size=2", *STREAMING, *extra])


@pytest.mark.slow  # ~30 s on a loaded 2-core machine
@pytest.mark.timeout(300)
def test_pier_streaming_overlapped_fp4_after_its_lazy_start(tmp_path):
    """H = 4 over 2 fragments, τ = 1, fp4, lazy start round(0.34 x 6) = 2 steps: steps 1-2
    are DDP over both ranks (one bucket train a step) and fragment 0's sync at step 2 is a
    local momentum fill (nothing launched at step 1, nothing sent); fragment 1's exchange
    is launched at step 3 and recorded at 4, fragment 0's at 5 and recorded at 6, where
    fragment 1 also syncs, blocking (the final round)."""
    results = check_config("configs/pier-tiny.yaml", overrides(
        "strategy.inner_steps=4", "strategy.overlap_steps=1", "strategy.mix_alpha=0.5",
        "strategy.outer_compression=fp4", "strategy.warmup_fraction=0.34"), tmp_path, 2)
    outer = [(step, op) for step, phase, op, _, _ in results[0][1] if phase == "outer"]
    assert outer == [(3, "quantized_all_reduce"), (5, "quantized_all_reduce"),
                     (5, "quantized_all_reduce")]
    assert {step for step, phase, *_ in results[0][1] if phase == "inner"} == {0, 1}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sparseloco_streaming_gathers_each_fragments_payload_overlapped(tmp_path):
    """H = 4 over 2 fragments, τ = 1: each sync one all-gather of that fragment's own coded
    payload (its chunks: the first fragment, with the embedding, larger); launched
    exchanges recorded at their sync (2, 4, 6), the last step's other fragment blocking."""
    results = check_config("configs/sparseloco-tiny.yaml", overrides(
        "strategy.inner_steps=4", "strategy.overlap_steps=1", "strategy.chunk_size=512",
        "strategy.topk_per_chunk=8"), tmp_path, 2)
    outer = [(step, nbytes) for step, phase, _, nbytes, _ in results[0][1] if phase == "outer"]
    first, second = outer[0][1], outer[1][1]  # fragments 0 and 1 (records sorted by size)
    assert outer == [(1, first), (3, second), (5, second), (5, first)] and first > second


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_noloco_streaming_pairs_each_fragment_by_its_own_round(tmp_path):
    """4 replicas, H = 2 over 2 fragments: fragment 0 syncs at steps 1, 3, 5 and (the
    final round) 6, fragment 1 at 2, 4, 6; the k-th sync of a fragment exchanges (Δ, φ) of
    that fragment with its peer in round k's matching (each fragment's rule counts its own
    rounds), which is not the loop's round: a description pairing by step // H differs."""
    from algorithms.gasloc import round_peers

    matchings = [round_peers("random-matching", 4, 0, k) for k in range(4)]
    assert len({tuple(map(tuple, m)) for m in matchings}) > 1  # the rounds pair differently
    check_config("configs/noloco-tiny.yaml", run_settings([
        "parallel.world_size=4", *STREAMING, "strategy.inner_steps=2"]), tmp_path, 4)


def test_a_fragments_round_counts_its_own_syncs():
    """`syncs_before` against the schedule walked step by step (H = 5 over P = 2, T = 13:
    fragment 0 at 2, 7, 12 and 13; fragment 1 at 5, 10 and 13)."""
    s = StreamingSchedule(2, 5, 1, 13)
    seen = [0, 0]
    for step in range(1, 14):
        for fragment in s.syncs(step):
            assert s.syncs_before(fragment, step) == seen[fragment], (fragment, step)
            seen[fragment] += 1
    assert seen == [4, 3]


H, P = 4, 2


def slow(factor: float) -> Profile:
    tier = Tier(A, B / factor, 1, None)
    return Profile("slow", tier, tier)


def test_sparseloco_streaming_by_hand():
    """Two blocks of BLOCK = 2^19 elements, two fragments: each fragment's payload is 128
    chunks of 4096 with 64 entries each, 2-bit codes (2048 B), int16 offsets (16384 B)
    and a scale a chunk (512 B): S = 18944 B, all-gathered over 2 replicas in
    A + S / bandwidth; one fragment every H/P steps. Blocking: utilisation
    H C / (H C + P t). Overlapped by τ = 1 step: hidden on a fast link, t - C exposed per
    sync where the link is slow enough that t > C."""
    S = 2048 + 16384 + 512
    base = {"name": "sparseloco", "inner_steps": H, "fragments": P}
    s = scenario({"blocking": {"strategy": base},
                  "overlapped": {"strategy": {**base, "overlap_steps": 1}}},
                 "tokens=8192", blocks=2)
    for network, bandwidth in ((net(), B), (slow(1000), B / 1000)):
        t = A + S / bandwidth
        r = priced(s, "blocking", network)
        assert r.steps == 16
        assert r.total_s == pytest.approx(4 * (H * C + P * t), rel=1e-12)
        assert r.utilisation == pytest.approx(H * C / (H * C + P * t), rel=1e-12)
        assert priced(s, "overlapped", network).utilisation == pytest.approx(1.0, rel=1e-12)
    t = A + S / (B / 1e5)
    assert t > C
    r = priced(s, "overlapped", slow(1e5))
    assert r.total_s == pytest.approx(4 * (H * C + P * (t - C)), rel=1e-12)
    assert r.utilisation == pytest.approx(H * C / (H * C + P * (t - C)), rel=1e-12)
    # a planner's exchange dtype narrows fp32 payloads, not the codes SparseLoCo sends
    for name in ("blocking", "overlapped"):
        s16 = scenario({name: {"strategy": base if name == "blocking"
                               else {**base, "overlap_steps": 1}}},
                       "tokens=8192", "assume.exchange_dtype=bf16", blocks=2)
        assert priced(s16, name, slow(1e5)).total_s == pytest.approx(
            priced(s, name, slow(1e5)).total_s, rel=1e-12)


def test_noloco_streaming_by_hand():
    """Two replicas (each other's peer every round), two fragments of one block each:
    each sync exchanges the fragment's Δ and φ in fp32, 8 x BLOCK bytes, in A + S / B
    (naive), blocking; one fragment every H/P steps."""
    s = scenario({"noloco": {"strategy": {"name": "noloco", "inner_steps": H,
                                          "fragments": P}}}, "tokens=8192", blocks=2)
    for network, bandwidth in ((net(), B), (slow(1000), B / 1000)):
        t = A + 8 * BLOCK / bandwidth
        r = priced(s, "noloco", network)
        assert r.total_s == pytest.approx(4 * (H * C + P * t), rel=1e-12)
        assert r.utilisation == pytest.approx(H * C / (H * C + P * t), rel=1e-12)


def test_pier_streaming_by_hand():
    """16 steps, lazy start round(0.25 x 16) = 4: those steps are DDP over both ranks, one
    bucket of both blocks (8 x BLOCK bytes) exposed in full each, their syncs sending
    nothing; then one fragment's all-reduce (4 x BLOCK bytes) every H/P steps, priced as
    3 rounds of H (the phase's 12 steps; the last step's final syncs are not in the
    priced period, as for DiLoCo)."""
    s = scenario({"pier": {"strategy": {"name": "pier", "inner_steps": H, "fragments": P,
                                        "warmup_fraction": 0.25, "schedule": "constant"}}},
                 "tokens=8192", blocks=2)
    for network, bandwidth in ((net(), B), (slow(1000), B / 1000)):
        ddp, fragment = 2 * A + 8 * BLOCK / bandwidth, 2 * A + 4 * BLOCK / bandwidth
        total = 4 * (C + ddp) + 3 * (H * C + P * fragment)
        r = priced(s, "pier", network)
        assert r.steps == 16
        assert r.total_s == pytest.approx(total, rel=1e-12)
        assert r.utilisation == pytest.approx(16 * C / total, rel=1e-12)
