"""The combination matrix: every option value works with every other, or config validation
refuses the combination with a reason. No combination may fail after launch.

    pytest tests/test_matrix.py                 # pairwise: every accepted pair of values runs
    tox -e matrix                               # every accepted combination runs (hours)

Each dimension below is one option of the schema with the values a user can pick. The
whole product is validated (`bench.config.from_dict`, the check `commbench run` makes
before launch); a refused combination must name a config key in its message. From the
accepted combinations a greedy all-pairs cover is chosen (every pair of values that occurs
in some accepted combination occurs in a chosen one), and each chosen combination trains
3 steps on a tiny model on real gloo ranks through the loop's own `Trainer`: the run ends
`ok`, its loss and validation loss are finite, its records are written, the what-if's
traffic description of its config (`StrategyConfig.traffic`) is its ledger's training
records step by step (or the strategy has none, refused naming a key), and where it
checkpoints, a resume from step 2 ends bit-identical to the uninterrupted run.

The product is too large to validate in the default run (0.5 ms a combination), so the
pairwise rows are generated greedily, validating only what is built: a pair counts as
refused when ATTEMPTS completions of it are all refused. The full product under tox -e
matrix validates everything and checks that no pair was refused wrongly.

Counts: `test_the_matrix_counts` prints them; docs/architecture.md records the latest.

Adding an option: add a dimension (or values) here. If some combination cannot work, refuse
it in config validation (the strategy's `check`, or `bench.config.validate`) with a reason.
"""

from __future__ import annotations

import copy
import functools
import gc
import itertools
import math
import os
import random
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bench.config import from_dict
from bench.records import RunDir
from tests.distributed import run_distributed

COMPILE = torch.compile

BASE = {
    "run": {"name": "matrix", "steps": 3, "log_every": 3, "val_every": 0, "val_sequences": 4},
    "model": {"preset": "tiny", "n_layer": 4, "n_embd": 32, "n_head": 2, "seq_len": 16},
    "data": {"corpus": "embedded", "tokenizer": "byte", "batch_size": 4},
    "optim": {"lr": 1e-3, "warmup_steps": 1},
    "network": {"ranks_per_node": 1, "profiles": ["eth-10g"]},
    "parallel": {"device": "cpu"},  # the rows train on CPU (and validate as they run)
    "checkpoint": {"every": 0, "final": True},
}

STRATEGIES = {
    "ddp": {"strategy.name": "ddp"},
    "ddp-zero0": {"strategy.name": "ddp", "strategy.backend": "deepspeed",
                  "strategy.zero_stage": 0},
    "ddp-zero1": {"strategy.name": "ddp", "strategy.backend": "deepspeed",
                  "strategy.zero_stage": 1},
    "ddp-zero2": {"strategy.name": "ddp", "strategy.backend": "deepspeed",
                  "strategy.zero_stage": 2},
    "diloco": {"strategy.name": "diloco", "strategy.inner_steps": 2},
    "pier": {"strategy.name": "pier", "strategy.inner_steps": 2,
             "strategy.warmup_fraction": 0.34},
    "gasloc": {"strategy.name": "gasloc", "strategy.inner_steps": 2},
    "gossip": {"strategy.name": "gossip", "strategy.inner_steps": 2},
    "1f1b": {"strategy.name": "pipeline", "strategy.schedule": "1f1b"},
    "gpipe": {"strategy.name": "pipeline", "strategy.schedule": "gpipe"},
    "interleaved": {"strategy.name": "pipeline", "strategy.schedule": "interleaved-1f1b",
                    "strategy.stages_per_rank": 2},
    "deepspeed-pp": {"strategy.name": "pipeline", "strategy.backend": "deepspeed"},
    "2bw": {"strategy.name": "pipedream-2bw", "strategy.delay": 1},
    "2bw-sync": {"strategy.name": "pipedream-2bw", "strategy.delay": 0},
}
OUTER = {
    "plain": {},
    "fragments": {"strategy.fragments": 2, "strategy.fragment_pattern": "sequential"},
    "overlap": {"strategy.inner_steps": 3, "strategy.overlap_steps": 1,
                "strategy.mix_alpha": 0.5},  # launched at step 2: in flight at the checkpoint
    "int8": {"strategy.outer_compression": "int8", "strategy.compression_row": 16},
    "fp4-fragments": {"strategy.fragments": 2, "strategy.outer_compression": "fp4"},
    "topk-overlap": {"strategy.inner_steps": 3, "strategy.overlap_steps": 1,
                     "strategy.outer_compression": "topk", "strategy.topk_fraction": 0.1},
}
"""Streaming DiLoCo and compressed outer communication (issue 24): options of DiLoCo and
Pier only (another strategy refuses them as keys it does not have)."""
PIPELINES = {"1f1b", "gpipe", "interleaved", "deepspeed-pp", "2bw", "2bw-sync"}
LOCAL_UPDATES = {"diloco", "pier"}


def layout(strategy: str, world: int) -> dict:
    """World size and grid: pipelines 2 stages (x 2 replicas on 4 ranks); DiLoCo and Pier
    replicas of 2 ranks on 4 ranks (hierarchical groups); the rest one rank per worker."""
    out = {"parallel.world_size": world}
    if strategy in PIPELINES:
        out.update({"parallel.num_stages": 2, "parallel.num_microbatches": 2})
    elif strategy in LOCAL_UPDATES and world == 4:
        out["parallel.group_size"] = 2
    return out


NETPROBED = str(Path(__file__).parent / "profiles" / "netprobe-tcp.yaml")
"""A profile as netprobe writes it for TCP: slow start after idle, the measured exchange."""

DIMENSIONS: dict[str, list] = {
    "strategy": list(STRATEGIES),
    "outer": list(OUTER),
    "world": [2, 4],
    "optim.name": ["adamw", "sgd", "muon", "lion", "adan", "soap", "nadamw"],
    "optim.delay": [0, 1],
    "optim.delay_correction": ["none", "ef", "predict"],
    "model.precision": ["fp32", "bf16"],
    "network.emulate": [None, "eth-10g", NETPROBED],
    "network.profiles": [("eth-10g",), (), (NETPROBED,)],  # () = onto nothing (a shaped-link run)
    "resume": [False, True],
    "model.arch": ["gpt2", "llama"],
    "parallel.shard": ["none", "fsdp"],
    "model.activation_checkpointing": ["none", "blocks"],
    "model.compile": [False, True],
}


@dataclass(frozen=True)
class Combination:
    values: tuple

    @property
    def named(self) -> dict:
        return dict(zip(DIMENSIONS, self.values, strict=True))

    @property
    def id(self) -> str:
        return ("-".join(str(v) for v in self.values).replace(NETPROBED, "netprobe-tcp")
                .replace(".", ""))

    def config_dict(self) -> dict:
        named = self.named
        data = copy.deepcopy(BASE)
        flat = {**layout(named["strategy"], named["world"]), **STRATEGIES[named["strategy"]],
                **OUTER[named["outer"]]}
        for key, value in named.items():
            if "." in key:
                flat[key] = list(value) if isinstance(value, tuple) else value
        if named["resume"]:
            flat["checkpoint.every"] = 2
        for key, value in flat.items():
            section, name = key.split(".", 1)
            data.setdefault(section, {})[name] = value
        return data


def validate(combo: Combination) -> str | None:
    """None when `commbench run` would launch it, else the refusal's message."""
    try:
        from_dict(combo.config_dict())
    except ValueError as err:
        return str(err)
    return None


def product() -> list[Combination]:
    return [Combination(values) for values in itertools.product(*DIMENSIONS.values())]


def pairs_of(combo: Combination) -> set[tuple]:
    items = list(enumerate(combo.values))
    return {(i, a, j, b) for (i, a), (j, b) in itertools.combinations(items, 2)}


CHEAPER = {"world": (4, 2), "resume": (True, False), "model.compile": (True, False)}
"""Values that make a row dearer (two ranks per core, a second training, dynamo's
tracing), each with its cheaper one: once the cover is built, a row keeps the dearer value
only where it covers a pair no other row covers (`cheapen`)."""

ATTEMPTS = 200
"""Completions tried for a pair before it counts as refused (the first greedy, the rest
random). The full product (tox -e matrix) checks that no pair was refused wrongly."""


@dataclass
class Pairwise:
    rows: list[Combination]
    """Accepted combinations covering every pair of values some accepted one has, as few
    of them on `CHEAPER`'s dearer values as the greedy pass left necessary."""
    refused_pairs: dict[tuple, str]
    """Pairs no tried completion made acceptable, with the last refusal's reason."""
    verdicts: dict[Combination, str | None]
    """Every combination validated on the way: None (accepted) or its refusal."""


def all_pairs(seed: int = 0) -> Pairwise:
    """Greedy all-pairs generation validating only what it builds: for the first uncovered
    pair, fill the other options with the values covering most uncovered pairs, validate;
    when refused, try random completions; a pair no completion makes acceptable is
    refused. Deterministic (seeded)."""
    rng = random.Random(seed)
    values = list(DIMENSIONS.values())
    uncovered = {(i, a, j, b) for i, j in itertools.combinations(range(len(values)), 2)
                 for a in values[i] for b in values[j]}
    verdicts: dict[Combination, str | None] = {}
    rows, refused = [], {}

    def verdict(combo: Combination) -> str | None:
        if combo not in verdicts:
            verdicts[combo] = validate(combo)
        return verdicts[combo]

    def fill(i, a, j, b, greedy: bool) -> Combination:
        chosen = {i: a, j: b}
        for k in range(len(values)):
            if k in chosen:
                continue
            if not greedy:
                chosen[k] = rng.choice(values[k])
                continue
            gain = {v: sum(((min(k, m), v if k < m else w, max(k, m), w if k < m else v)
                            in uncovered) for m, w in chosen.items()) for v in values[k]}
            chosen[k] = max(values[k], key=lambda v: gain[v])
        return Combination(tuple(chosen[k] for k in range(len(values))))

    while uncovered:
        pair = min(uncovered, key=repr)
        reason = None
        for attempt in range(ATTEMPTS):
            combo = fill(*pair, greedy=attempt == 0)
            reason = verdict(combo)
            if reason is None:
                rows.append(combo)
                uncovered -= pairs_of(combo)
                break
        else:
            refused[pair] = reason
            uncovered.discard(pair)
    return Pairwise(cheapen(rows, verdict), refused, verdicts)


def cheapen(rows: list[Combination], verdict) -> list[Combination]:
    """`rows` with each `CHEAPER` dearer value swapped for its cheaper one wherever every
    pair it forms is covered by another row too and the swapped row is accepted (and not
    already a row): the same pairs stay covered (the swapped row's new pairs only add),
    with fewer dear rows (the greedy cover takes the dearer value whenever it covers more
    new pairs: 64 of 132 rows on 4 ranks)."""
    names = list(DIMENSIONS)
    count = Counter(p for c in rows for p in pairs_of(c))
    out, seen = list(rows), set(rows)
    for name, (dear, cheap) in CHEAPER.items():
        k = names.index(name)
        for i in reversed(range(len(out))):
            combo = out[i]
            if combo.values[k] != dear:
                continue
            if any(count[p] < 2 for p in pairs_of(combo)
                   if (p[0], p[1]) == (k, dear) or (p[2], p[3]) == (k, dear)):
                continue
            swapped = Combination(combo.values[:k] + (cheap,) + combo.values[k + 1:])
            if swapped in seen or verdict(swapped) is not None:
                continue
            count.subtract(pairs_of(combo))
            count.update(pairs_of(swapped))
            out[i] = swapped
            seen.discard(combo)
            seen.add(swapped)
    return out


def classify() -> tuple[list[Combination], dict[Combination, str]]:
    """The whole product, validated (tox -e matrix)."""
    accepted, refused = [], {}
    for combo in product():
        reason = validate(combo)
        if reason is None:
            accepted.append(combo)
        else:
            refused[combo] = reason
    return accepted, refused


# ---------------------------------------------------------------------- the runs


def _train(cfg, run_dir: Path):
    """(summary, this rank's eval weights, the steps it trained). `model.compile` runs with
    dynamo's eager backend: the tracing of each strategy's module in its wrapping order
    (compile(DDP(model)), stage modules, hooks) without inductor's CPU code generation,
    which would take minutes per combination."""
    from bench.train import Trainer

    if cfg.model.compile:
        torch.compile = functools.partial(COMPILE, backend="eager")

    trainer = Trainer(cfg, run_dir, torch.device("cpu"), "gloo", keep_records=True)
    trained, timed_step = [], trainer.timed_step
    trainer.timed_step = lambda step: (trained.append(step), timed_step(step))[1]
    try:
        summary = trainer.run()
        records = list(trainer.ledger.records)  # export_state below communicates (GASLoC)
        state = {k: v.detach().clone() for k, v in trainer.strategy.export_state().items()}
    finally:
        trainer.strategy.close()
        torch.compile = COMPILE
        torch._dynamo.reset()
    return summary, state, trained, traffic_verdict(cfg, records, trained)


def traffic_verdict(cfg, records, trained: list[int]) -> str | None:
    """The what-if's traffic description (`StrategyConfig.traffic`) against this rank's
    ledger: None when they agree record for record (phase, op, bytes, group size) on
    the steps trained (in any order within a step: its pricing does not depend on it), "refused: ..." when the strategy has no description, else the
    first difference."""
    from bench.train import TRAIN_PHASES
    from bench.whatif.engine import as_records, traffic_facts

    try:
        traffic = cfg.strategy.traffic(cfg, traffic_facts(cfg))
    except ValueError as err:
        return f"refused: {err}"
    rank, world = dist.get_rank(), cfg.parallel.world_size
    rpn = cfg.network.ranks_per_node or 1
    recorded = sorted((r.step, r.phase, r.op, r.nbytes, r.group_size) for r in records
                      if r.phase in TRAIN_PHASES)  # a step's order is not priced
    described = sorted((r.step, r.phase, r.op, r.nbytes, r.group_size) for step in trained
                       for t in traffic.transfers(rank, step)
                       for r in as_records(t, rank, step, world, rpn))
    if described == recorded:
        return None
    pairs = zip(described, recorded, strict=False)
    diff = next((i for i, (a, b) in enumerate(pairs) if a != b),
                min(len(described), len(recorded)))
    return (f"rank {rank}: record {diff} described "
            f"{described[diff] if diff < len(described) else None}, recorded "
            f"{recorded[diff] if diff < len(recorded) else None}")


def _run_rows(rank, world, rows: list[Combination], base_dir: str):
    """Each row on these ranks in turn; per row this rank's findings (or raises, naming it)."""
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()  # the imports' objects: the loop's full collections (memory.reset_peak,
    # before each run) no longer walk them (0.13 s a collection in this process otherwise)
    out = []
    for combo in rows:
        cfg = from_dict(combo.config_dict())
        run_dir = Path(base_dir) / combo.id
        started = time.perf_counter()
        try:
            summary, state, _, traffic = _train(cfg, run_dir)
            row = {"status": summary["status"], "loss_finite": None, "traffic": traffic,
                   "projection_model": summary.get("projection_model", ""),
                   "val": summary.get("final_val_loss"), "steps": summary["steps"],
                   "tokens": summary["total_tokens"]}
            if rank == 0:
                rows_written = RunDir(run_dir).read_metrics()
                row["loss_finite"] = bool(rows_written) and all(
                    math.isfinite(r["loss"]) for r in rows_written if "loss" in r)
                row["final_pt"] = RunDir(run_dir).final_checkpoint.exists()
            if combo.named["resume"]:
                resumed_dir = Path(base_dir) / f"{combo.id}-resumed"
                if rank == 0:
                    shutil.copytree(run_dir, resumed_dir)
                dist.barrier()
                os.environ["COMMBENCH_RESUME"] = "1"
                try:
                    resumed_summary, resumed_state, trained, _ = _train(cfg, resumed_dir)
                finally:
                    del os.environ["COMMBENCH_RESUME"]
                row["resumed_status"] = resumed_summary["status"]
                row["resumed_steps"] = trained  # [2]: it continued from the checkpoint
                row["resume_exact"] = state.keys() == resumed_state.keys() and all(
                    torch.equal(state[k], resumed_state[k]) for k in state)
            row["seconds"] = time.perf_counter() - started  # shown, never asserted on
            out.append(row)
        except Exception as err:  # symmetric failures (every rank raises): record, go on
            out.append({"error": f"rank {rank}: {type(err).__name__}: {err}"})
            dist.barrier()
    return out


def run_rows(rows: list[Combination], tmp_path: Path, timeout: float) -> dict:
    """{combination: rank 0's findings (with every rank's resume verdict)}."""
    results = {}
    for world in sorted({c.named["world"] for c in rows}):
        mine = [c for c in rows if c.named["world"] == world]
        per_rank = run_distributed(_run_rows, world, mine, str(tmp_path), timeout=timeout)
        for i, combo in enumerate(mine):
            found = dict(per_rank[0][i])
            errors = [r[i]["error"] for r in per_rank if "error" in r[i]]
            if errors:
                results[combo] = {"error": errors[0]}
                continue
            if combo.named["resume"]:
                found["resume_exact"] = all(r[i]["resume_exact"] for r in per_rank)
            found["traffic"] = next((r[i]["traffic"] for r in per_rank
                                     if r[i]["traffic"] is not None), None)
            results[combo] = found
    return results


def check(combo: Combination, found: dict) -> None:
    named = combo.named
    assert "error" not in found, f"failed after launch: {named}: {found['error']}"
    assert found["status"] == "ok", (named, found)
    assert found["steps"] == 3 and found["tokens"] > 0, (named, found)
    assert found["loss_finite"] and math.isfinite(found["val"]), (named, found)
    assert found["final_pt"], named
    traffic = found["traffic"]  # the what-if describes what the run sent, or says why not
    if traffic is not None and traffic.startswith("refused: "):
        assert any(key in traffic for key in (  # what the what-if cannot price yet
            "strategy.backend=deepspeed", "strategy.schedule=interleaved-1f1b",
            "strategy.fragments=", "strategy.overlap_steps=",
            "strategy.outer_compression=")), (named, traffic)
    else:
        assert traffic is None, f"what-if traffic differs from the ledger: {named}: {traffic}"
    # a sharded run's projection says FSDP's collectives are priced with no overlap
    assert ("FSDP" in found["projection_model"]) == (named["parallel.shard"] == "fsdp"), named
    if named["resume"]:
        assert found["resumed_status"] == "ok", (named, found)
        assert found["resumed_steps"] == [2], f"did not resume from step 2: {named} {found}"
        assert found["resume_exact"], f"resume from step 2 is not bit-exact: {named}"


# ---------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def pairwise():
    return all_pairs()


def test_every_refusal_names_a_config_key(pairwise):
    """A refused combination is refused with a reason a user can act on: the message names
    the key path of an option (section.field)."""
    sections = ("run.", "model.", "data.", "strategy", "optim.", "parallel.", "network.",
                "checkpoint.", "launch.", "eval.")
    reasons = {r for r in pairwise.verdicts.values() if r is not None}
    unnamed = {r for r in reasons if not any(s in r for s in sections)}
    assert reasons and not unnamed, sorted(unnamed)[:5]


def test_the_matrix_counts(pairwise):
    """Every value of every option is accepted somewhere (an option no combination can use
    is a schema bug). Prints the counts the module docstring speaks of."""
    for i, (name, values) in enumerate(DIMENSIONS.items()):
        used = {c.values[i] for c in pairwise.rows}
        assert used == set(values), f"{name}: {set(values) - used} never accepted"
    # every pair some validated, accepted combination has is in a row (cheapen kept them)
    accepted = [c for c, reason in pairwise.verdicts.items() if reason is None]
    covered = set().union(*(pairs_of(c) for c in pairwise.rows))
    missing = set().union(*(pairs_of(c) for c in accepted)) - covered
    assert not missing, sorted(missing)[:5]
    assert len(set(pairwise.rows)) == len(pairwise.rows)
    size = math.prod(len(v) for v in DIMENSIONS.values())
    dear = {name: sum(c.named[name] == value for c in pairwise.rows)
            for name, (value, _) in CHEAPER.items()}
    print(f"\nmatrix: {size} combinations; {len(pairwise.verdicts)} validated, "
          f"{len(pairwise.rows)} pairwise rows ({dear} on the dearer values), "
          f"{len(pairwise.refused_pairs)} pairs refused")


@pytest.mark.timeout(1500)
def test_every_accepted_pair_of_values_runs(pairwise, tmp_path):
    rows = pairwise.rows
    results = run_rows(rows, tmp_path, timeout=1400)
    failures = []
    for combo in rows:
        try:
            check(combo, results[combo])
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, f"{len(failures)} of {len(rows)} rows:\n" + "\n".join(failures)
    slowest = sorted(rows, key=lambda c: -results[c]["seconds"])[:5]
    print("\nslowest rows: " + "; ".join(f"{results[c]['seconds']:.1f} s {c.named}"
                                         for c in slowest))


@pytest.mark.matrix
@pytest.mark.timeout(0)
def test_every_accepted_combination_runs(pairwise, tmp_path):
    """The full product (tox -e matrix): every combination validated, every accepted one
    trained; and the pairwise generator refused no pair an accepted combination has."""
    accepted, refused = classify()
    assert all(r for r in refused.values())
    possible = set().union(*(pairs_of(c) for c in accepted))
    wrongly = possible & set(pairwise.refused_pairs)
    assert not wrongly, f"pairs refused by the sampled search but accepted: {sorted(wrongly)}"
    print(f"\nmatrix: {len(accepted) + len(refused)} combinations, {len(accepted)} accepted, "
          f"{len(refused)} refused")
    results = run_rows(accepted, tmp_path, timeout=10**6)
    for combo in accepted:
        check(combo, results[combo])
