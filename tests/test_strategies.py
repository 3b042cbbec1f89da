"""The tests' strategy registry (tests/strategies.py) against the strategy registry
(algorithms/base.py `STRATEGIES`): every registered name has an entry and every entry a
registered name, so a new strategy cannot silently get less coverage; each entry's configs
run its strategy, and the capabilities it claims are what config validation and the
strategy's class say.

    pytest tests/test_strategies.py -s    # -s: prints which tables hold each strategy
"""

from __future__ import annotations

import pytest
import yaml

from algorithms.base import STRATEGIES, DataParallelStrategy, strategy_class
from bench.config import load_config
from tests import strategies
from tests.strategies import ENTRIES, REGISTRY, TABLES


def test_every_registered_strategy_has_an_entry_and_every_entry_is_registered():
    missing = [name for name in STRATEGIES if name not in REGISTRY]
    unknown = [name for name in REGISTRY if name not in STRATEGIES]
    assert not missing, (f"registered strategies without an entry in tests/strategies.py: "
                         f"{missing}; add an Entry (its tiny config, capabilities, cases)")
    assert not unknown, (f"tests/strategies.py entries naming no registered strategy: "
                         f"{unknown}; registered: {sorted(STRATEGIES)}")
    assert len(ENTRIES) == len(REGISTRY), "an entry twice"


def test_the_check_sees_a_strategy_without_an_entry(monkeypatch):
    monkeypatch.setitem(STRATEGIES, "toy", "tests.test_strategies:Toy")
    with pytest.raises(AssertionError, match=r"without an entry .*\['toy'\]"):
        test_every_registered_strategy_has_an_entry_and_every_entry_is_registered()


def test_every_strategy_is_in_the_combination_matrix_and_ids_are_unique():
    """Every strategy has matrix rows; a table's case ids are unique across strategies
    (the golden fixtures and the test ids are keyed by them)."""
    assert all(entry.matrix for entry in ENTRIES), [e.name for e in ENTRIES if not e.matrix]
    strategies.matrix_rows()
    for table in TABLES:
        strategies.cases(table)
    print("\n" + coverage())


def coverage() -> str:
    """Strategy x table: the number of cases each table holds of each strategy."""
    width = max(len(t) for t in ("matrix", *TABLES))
    head = f"{'':{width}}" + "".join(f" {e.name:>13}" for e in ENTRIES)
    lines = [f"{'matrix':{width}}" + "".join(f" {len(e.matrix):>13}" for e in ENTRIES)]
    lines += [f"{table:{width}}" + "".join(f" {len(getattr(e, table)):>13}" for e in ENTRIES)
              for table in TABLES]
    return "\n".join([head, *lines])


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_each_entrys_configs_are_its_strategys(entry):
    """Its tiny config with `short` validates as this strategy, and every case's config
    names this strategy."""
    assert load_config(entry.config, list(entry.short)).strategy.name == entry.name
    for table in TABLES:
        for case_id, case in getattr(entry, table).items():
            path = strategies.config_of(entry, case)
            with open(path) as f:
                name = yaml.safe_load(f)["strategy"]["name"]
            assert name == entry.name, f"{table} {case_id}: {path} runs {name}"


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_each_entrys_capabilities_are_what_the_code_says(entry):
    """layout: a `DataParallelStrategy` or not; groups: replicas of several ranks with the
    outer options (here `strategy.fragments`) accepted; shards: `parallel.shard=fsdp`
    accepted (on replicas of 2 ranks where replicas have ranks), else refused naming
    parallel.shard; a strategy that shards has its sharded == unsharded pair."""
    is_data_parallel = issubclass(strategy_class(entry.name), DataParallelStrategy)
    assert is_data_parallel == (entry.layout == "data-parallel"), entry.layout
    groups = ["parallel.world_size=4", "parallel.group_size=2"]
    assert accepted(entry, [*groups, "strategy.fragments=2"]) == entry.groups
    fsdp = ["parallel.shard=fsdp", *(groups if entry.groups else [])]
    if entry.shards:
        assert accepted(entry, fsdp)
        assert entry.fsdp, f"{entry.name} shards: give it an fsdp case (tests/test_shard.py)"
    else:
        with pytest.raises(ValueError, match="parallel.shard"):
            load_config(entry.config, [*entry.short, *fsdp])
        assert not entry.fsdp and not entry.fsdp_resume


def accepted(entry, overrides: list[str]) -> bool:
    try:
        load_config(entry.config, [*entry.short, *overrides])
    except ValueError:
        return False
    return True
