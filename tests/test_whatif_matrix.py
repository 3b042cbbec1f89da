"""Every option the combination matrix accepts is priced by the what-if, or refused by it
with a reason (issue 48).

    pytest -m slow tests/test_whatif_matrix.py     (~100 s: building the pairwise cover)

Over the pairwise cover of tests/test_matrix.py (every accepted pair of option values):
each row's traffic description is built (`Strategy.traffic` on the model measured
on the meta device); the matrix itself (`tox -e matrix`) holds each description against
the row's ledger. REFUSED lists what the what-if still cannot price, and why.
"""

import pytest

REFUSED: dict[str, str] = {}
"""Refusal message -> why it is still refused: nothing since DeepSpeed's pipeline engine
records its collectives' groups (algorithms/pipeline_deepspeed.py)."""
DESCRIBED_STREAMING = {"diloco", "pier", "sparseloco", "noloco"}
"""Strategies whose streaming, overlapped and compressed rounds are priced
(algorithms/outer_traffic.py), as far as each accepts them (SparseLoCo has its own codec,
NoLoCo its blocking fp32 exchange: they refuse the rest before launch)."""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_matrix_row_is_priced_or_refused_with_a_reason():
    from algorithms.base import strategy_of
    from bench.config import from_dict
    from bench.study.whatif.engine import traffic_facts
    from tests.strategies import ENTRIES
    from tests.test_matrix import cover

    priced, refused, streaming, deepspeed_pipes = 0, [], set(), 0
    name_of = {row: entry.name for entry in ENTRIES for row in entry.matrix}
    for combo in cover(2).rows:
        cfg = from_dict(combo.config_dict())
        try:
            traffic = strategy_of(cfg).traffic(cfg, traffic_facts(cfg))
        except ValueError as err:
            reason = next((k for k in REFUSED if k in str(err)), None)
            assert reason is not None, (combo.named, str(err))
            refused.append(combo.named["strategy"])
            continue
        assert traffic.steps == cfg.run.steps
        priced += 1
        if cfg.strategy.name == "pipeline" and cfg.strategy.backend == "deepspeed":
            deepspeed_pipes += 1
            assert any(t.phase == "dp" for t in traffic.transfers(0, 1)), combo.named
        if combo.named["outer"] != "plain":
            streaming.add(name_of[combo.named["strategy"]])
    assert priced > len(refused)
    assert deepspeed_pipes > 0  # priced now (it was the last refusal)
    assert DESCRIBED_STREAMING <= streaming  # each priced with some streaming option
