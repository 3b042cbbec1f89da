"""The tests' registry of strategies: one entry per registered name
(algorithms/base.py `STRATEGIES`), with its tiny config, the overrides that make a run of a
few steps exercise it, its capabilities and its cases in each per-strategy table of the
tests. The tables are derived from it (`cases(table)`):

    table           the test that reads it
    matrix          tests/test_matrix.py          STRATEGIES (the strategy dimension)
    golden          tests/test_golden.py          CASES (fixtures tests/golden/<id>.json)
    resume          tests/test_resume.py          RESUMES (2 ranks, 4, 4 over 44 steps)
    stop            tests/test_resume.py          STOPS (a stop signal, per family)
    fsdp            tests/test_shard.py           PAIRS (sharded == unsharded)
    fsdp_resume     tests/test_shard.py           RESUME
    whatif          tests/test_whatif.py          CASES (traffic description == ledger)
    projection      tests/test_projection_consistency.py  FAMILIES
    checkpointing   tests/test_activation_checkpointing.py  CASES
    memory          tests/test_memory.py          LAYOUTS (plan vs measured peaks)

    pytest tests/test_strategies.py    # every registered name has an entry, and back

Adding a strategy: an `Entry` below. Every field is required, so each table is a decision
(an empty dict: not in that table); tests/test_strategies.py fails while a registered
name has no entry.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

TABLES = ("golden", "resume", "stop", "fsdp", "fsdp_resume", "whatif", "projection",
          "checkpointing", "memory")
"""The per-strategy tables of cases (`Entry` fields of `Case`s; the matrix's rows are
`Entry.matrix`)."""


@dataclass(frozen=True)
class Case:
    """One case of a strategy in one table: a tiny config (the entry's own unless `config`)
    with `overrides` (`--set KEY=VALUE`) on top of the table's common ones."""

    overrides: tuple[str, ...] = ()
    config: str | None = None
    """Another tiny config of the same registered strategy (a schedule, Streaming DiLoCo)."""
    checkpoint_step: int | None = None
    """Resume cases: the step of the checkpoint the resumed run starts from."""
    ranks: int = 2
    """Resume cases: the world size."""
    slow: bool = False
    """Runs under `tox -e slow` only (`pytest -m slow`)."""
    deepspeed: bool = False
    """Needs DeepSpeed installed (left out or skipped without it)."""


@dataclass(frozen=True)
class Entry:
    """One registered strategy: its tiny config, its capabilities and its cases in each
    table (every field required: a new entry decides each table)."""

    name: str
    """The registered name (algorithms/base.py `STRATEGIES`)."""
    config: str
    """Its tiny config (configs/*-tiny.yaml): a ready run of the strategy alone."""
    short: tuple[str, ...]
    """Overrides with which a run of a few steps exercises it: outer rounds of 2 steps,
    2 microbatches (the matrix's and the projection's choice; the cases spell theirs in
    full, some pinned: a golden fixture, a checkpoint mid-round)."""
    layout: Literal["data-parallel", "pipeline"]
    """Data-parallel (a `DataParallelStrategy`: every rank a replica or a worker) or a
    pipeline (`parallel.num_stages` stages per replica)."""
    groups: bool
    """Replicas of several ranks (`parallel.group_size`: DDP inside, an outer step across)
    and the outer options (fragments, overlap, compression): DiLoCo's family."""
    shards: bool
    """`parallel.shard: fsdp` accepted (refused, with a reason, otherwise)."""
    matrix: dict[str, dict]
    """The combination matrix's rows of this strategy: row id -> strategy options (typed
    values; `strategy.name` is added)."""
    golden: dict[str, Case]
    """Golden trajectories: fixture name -> case (overrides pinned by the fixture)."""
    resume: dict[str, Case]
    """Resume bit-exact from a checkpoint: test id -> case (`ranks`, `checkpoint_step`)."""
    stop: dict[str, Case]
    """A stop signal on one rank: family -> case (~30 s each: the default suite runs those
    not `slow`)."""
    fsdp: dict[str, Case]
    """Sharded equals unsharded: pair id -> case."""
    fsdp_resume: dict[str, Case]
    """Sharded runs resume bit-exact: id -> case (`checkpoint_step`)."""
    whatif: dict[str, Case]
    """The what-if's traffic description equals the run's ledger: id -> case."""
    projection: dict[str, Case]
    """Every projected figure prices one timeline: family id -> case."""
    checkpointing: dict[str, Case]
    """Activation checkpointing gives the same parameters: id -> case."""
    memory: dict[str, Case]
    """The memory plan against measured peaks: layout id -> case (a launch each, ~30 s:
    the default suite runs those not `slow`)."""


LONG = ("run.steps=44", "checkpoint.every=23", "run.log_every=10", "run.val_every=20")
"""A 4-rank resume over 44 steps, checkpointing off the logging grid (at 23)."""


def long_resume(*overrides: str) -> Case:
    return Case((*LONG, *overrides), checkpoint_step=23, ranks=4, slow=True)


ZERO1 = ("strategy.backend=deepspeed", "strategy.zero_stage=1")
ROUNDS = ("strategy.inner_steps=2",)
MICROBATCHES = ("parallel.num_microbatches=2",)
GROUPS = ("parallel.group_size=2",)
LLAMA = ("model.arch=llama",)

ENTRIES = (
    Entry(
        name="ddp", config="configs/ddp-tiny.yaml", short=(), layout="data-parallel",
        groups=False, shards=True,
        matrix={"ddp": {},
                "ddp-zero0": {"strategy.backend": "deepspeed", "strategy.zero_stage": 0},
                "ddp-zero1": {"strategy.backend": "deepspeed", "strategy.zero_stage": 1},
                "ddp-zero2": {"strategy.backend": "deepspeed", "strategy.zero_stage": 2},
                # issue 47: the pipeline delay profile (refused unless optim.delay=1 and no
                # correction: the matrix's pairs with delay 0, ef and predict are refusals)
                "ddp-delay-pipeline": {"optim.delay_profile": "pipeline",
                                       "optim.delay_stages": 2}},
        golden={"ddp": Case(), "ddp-zero1": Case(ZERO1, deepspeed=True)},
        resume={"2-ddp": Case(("run.steps=6", "checkpoint.every=3"), checkpoint_step=3),
                "4-ddp": Case(("run.steps=12", "checkpoint.every=7", "run.log_every=5"),
                              checkpoint_step=7, ranks=4),
                "4-ddp-44-steps": long_resume(),
                "4-ddp-delayed-predict-44-steps": long_resume(
                    "optim.name=muon", "optim.delay=1", "optim.delay_correction=predict"),
                "4-zero2-44-steps": long_resume("strategy.backend=deepspeed",
                                                "strategy.zero_stage=2")},
        stop={"data-parallel": Case(("run.steps=10", "run.log_every=4")),
              "delayed-optimizer": Case(("run.steps=10", "run.log_every=4", "optim.delay=1",
                                         "optim.delay_correction=ef"), slow=True)},
        fsdp={"ddp": Case(LLAMA)},
        fsdp_resume={"ddp": Case(("run.steps=6", "checkpoint.every=3"), checkpoint_step=3)},
        whatif={"ddp": Case(),
                "ddp-zero1": Case(ZERO1, deepspeed=True),
                "ddp-zero2-microbatches": Case(("strategy.backend=deepspeed",
                                                "strategy.zero_stage=2", *MICROBATCHES),
                                               deepspeed=True)},
        projection={"ddp": Case()},
        checkpointing={"ddp": Case(LLAMA), "zero1": Case(ZERO1, deepspeed=True)},
        memory={"ddp": Case(slow=True),
                "ddp-checkpointing": Case(("model.activation_checkpointing=blocks",),
                                          slow=True),
                "ddp-fsdp": Case(("parallel.shard=fsdp",), slow=True)},
    ),
    Entry(
        name="diloco", config="configs/diloco-tiny.yaml", short=ROUNDS, layout="data-parallel",
        groups=True, shards=True,
        matrix={"diloco": {"strategy.inner_steps": 2},
                "diloco-delay-pipeline": {"strategy.inner_steps": 2,
                                          "optim.delay_profile": "pipeline",
                                          "optim.delay_stages": 3}},
        golden={"diloco": Case(("strategy.inner_steps=3",))},
        resume={"2-diloco": Case(  # H = 4, checkpoint at 6: mid-round
                    ("run.steps=8", "strategy.inner_steps=4", "checkpoint.every=6",
                     "strategy.offload_outer=true"), checkpoint_step=6),
                "4-diloco-groups-44-steps": long_resume(*GROUPS, "strategy.inner_steps=5")},
        # ranks free-run a round: the other rank may be at its end (8) when it hears the
        # stop; rows every 5, so that any stop step (6, 7 or 8) is off the rows' grid
        stop={"outer-step": Case(("run.steps=10", "strategy.inner_steps=4",
                                  "run.log_every=5"), slow=True)},
        fsdp={"diloco": Case((*GROUPS, *ROUNDS))},
        fsdp_resume={"diloco": Case(("run.steps=8", "strategy.inner_steps=4",
                                     "checkpoint.every=6", *GROUPS), checkpoint_step=6)},
        whatif={"diloco-hier": Case(("strategy.inner_steps=3", *GROUPS,
                                     "network.ranks_per_node=2")),
                "fsdp-diloco": Case(("strategy.inner_steps=3", *GROUPS,
                                     "parallel.shard=fsdp")),
                "streaming-fp4": Case(("strategy.inner_steps=4", "strategy.overlap_steps=0"),
                                      config="configs/streaming-diloco-tiny.yaml"),
                "streaming-topk-hier": Case(
                    ("strategy.inner_steps=4", "strategy.overlap_steps=0",
                     "strategy.outer_compression=topk", *GROUPS),
                    config="configs/streaming-diloco-tiny.yaml"),
                # H = 5 over P = 2: syncs 2 and 3 steps apart, the second overlapped
                "streaming-uneven": Case(("strategy.inner_steps=5",),
                                         config="configs/streaming-diloco-tiny.yaml")},
        projection={"diloco": Case(ROUNDS),
                    "streaming": Case(("strategy.inner_steps=4", "strategy.compression_row=32"),
                                      config="configs/streaming-diloco-tiny.yaml")},
        checkpointing={"diloco": Case(ROUNDS)},
        memory={"diloco-llama": Case((*ROUNDS, *LLAMA), slow=True),
                "diloco-fsdp-llama": Case((*ROUNDS, "parallel.shard=fsdp", *GROUPS, *LLAMA))},
    ),
    Entry(
        name="pier", config="configs/pier-tiny.yaml",
        short=(*ROUNDS, "strategy.warmup_fraction=0.34"), layout="data-parallel",
        groups=True, shards=True,
        matrix={"pier": {"strategy.inner_steps": 2, "strategy.warmup_fraction": 0.34}},
        golden={"pier": Case(("strategy.inner_steps=3", "strategy.warmup_fraction=0.25"))},
        resume={"2-pier": Case(  # lazy start 2 steps (one fill), outer steps at 4, 6, 8
                    ("run.steps=8", "strategy.inner_steps=2", "strategy.warmup_fraction=0.25",
                     "checkpoint.every=5"), checkpoint_step=5),
                "4-pier-groups-44-steps": long_resume(*GROUPS, "strategy.inner_steps=5")},
        stop={},
        fsdp={"pier": Case((*GROUPS, *ROUNDS, "strategy.warmup_fraction=0.25"))},
        fsdp_resume={},
        whatif={"pier": Case((*ROUNDS, "strategy.warmup_fraction=0.5"))},
        projection={"pier": Case((*ROUNDS, "strategy.warmup_fraction=0.34"))},
        checkpointing={},
        memory={},
    ),
    Entry(
        name="sparseloco", config="configs/sparseloco-tiny.yaml", short=ROUNDS,
        layout="data-parallel", groups=True, shards=False,
        matrix={"sparseloco": {"strategy.inner_steps": 2}},
        golden={"sparseloco": Case(("strategy.inner_steps=3",))},
        resume={"2-sparseloco": Case(  # H = 4, checkpoint at 6: mid-round, e_i non-zero
                    ("run.steps=8", "strategy.inner_steps=4", "checkpoint.every=6"),
                    checkpoint_step=6)},
        stop={},
        fsdp={},
        fsdp_resume={},
        whatif={"sparseloco-hier": Case(("strategy.inner_steps=3", *GROUPS,
                                         "network.ranks_per_node=2"))},
        projection={},
        checkpointing={},
        memory={},
    ),
    Entry(
        name="noloco", config="configs/noloco-tiny.yaml", short=ROUNDS, layout="data-parallel",
        groups=True, shards=False,
        matrix={"noloco": {"strategy.inner_steps": 2}},
        golden={"noloco": Case(("strategy.inner_steps=3",))},
        resume={"4-noloco": Case(  # 2 pairs a round; checkpoint mid-round
                    ("run.steps=8", "strategy.inner_steps=2", "checkpoint.every=5"),
                    checkpoint_step=5, ranks=4)},
        stop={},
        fsdp={},
        fsdp_resume={},
        whatif={"noloco": Case(ROUNDS)},
        projection={},
        checkpointing={},
        memory={},
    ),
    Entry(
        name="demo", config="configs/demo-tiny.yaml", short=ROUNDS, layout="data-parallel",
        groups=False, shards=False,  # replica groups run (demo-hier); fragments are refused
        matrix={"demo": {"strategy.inner_steps": 2}},
        golden={},
        resume={"2-demo": Case(  # H = 4, checkpoint at 6: mid-round, m_i non-zero
                    ("run.steps=8", "strategy.inner_steps=4", "checkpoint.every=6"),
                    checkpoint_step=6)},
        stop={},
        fsdp={},
        fsdp_resume={},
        whatif={"demo": Case(()),  # an exchange every step, the tiny GPT's real blocks
                "demo-hier": Case(("strategy.inner_steps=3", *GROUPS,
                                   "network.ranks_per_node=2"))},
        projection={},
        checkpointing={},
        memory={},
    ),
    Entry(
        name="gasloc", config="configs/gasloc-tiny.yaml", short=ROUNDS, layout="data-parallel",
        groups=False, shards=False,
        matrix={"gasloc": {"strategy.inner_steps": 2}},
        golden={"gasloc": Case(("strategy.inner_steps=3",))},
        resume={"2-gasloc": Case(  # rounds of 2, worker 1 idles; checkpoint mid-round
                    ("run.steps=8", "strategy.inner_steps=[2, 1]", "checkpoint.every=5"),
                    checkpoint_step=5),
                "4-gasloc-44-steps": long_resume("strategy.inner_steps=5")},
        stop={"gossip": Case(("run.steps=10", "strategy.inner_steps=3", "run.log_every=4"),
                             slow=True)},
        fsdp={},
        fsdp_resume={},
        whatif={"gasloc": Case(ROUNDS)},
        projection={"gasloc": Case(("strategy.inner_steps=[2, 1]",))},
        checkpointing={"gasloc": Case((*ROUNDS, *LLAMA))},
        memory={"gasloc": Case(ROUNDS, slow=True)},
    ),
    Entry(
        name="gossip", config="configs/gossip-tiny.yaml", short=ROUNDS, layout="data-parallel",
        groups=False, shards=False,
        matrix={"gossip": {"strategy.inner_steps": 2}},
        golden={"gossip": Case(("strategy.inner_steps=3",))},
        resume={},
        stop={},
        fsdp={},
        fsdp_resume={},
        whatif={},
        projection={},
        checkpointing={},
        memory={},
    ),
    Entry(
        name="pipeline", config="configs/pipeline-1f1b-tiny.yaml", short=MICROBATCHES,
        layout="pipeline", groups=False, shards=False,
        matrix={"1f1b": {"strategy.schedule": "1f1b"},
                "gpipe": {"strategy.schedule": "gpipe"},
                "interleaved": {"strategy.schedule": "interleaved-1f1b",
                                "strategy.stages_per_rank": 2},
                "deepspeed-pp": {"strategy.backend": "deepspeed"}},
        golden={},
        resume={},
        stop={},
        fsdp={},
        fsdp_resume={},
        whatif={"pipeline-1f1b": Case(("data.batch_size=4",)),
                "interleaved-1f1b": Case(("data.batch_size=4", "model.n_layer=4",
                                          "strategy.schedule=interleaved-1f1b",
                                          "strategy.stages_per_rank=2")),
                "gpipe": Case(("data.batch_size=4",), config="configs/gpipe-tiny.yaml")},
        projection={"1f1b": Case(MICROBATCHES)},
        checkpointing={"pipeline": Case(MICROBATCHES),
                       "deepspeed-pp": Case((*MICROBATCHES, *LLAMA),
                                            config="configs/deepspeed-pp-tiny.yaml",
                                            deepspeed=True)},
        memory={},
    ),
    Entry(
        name="pipedream-2bw", config="configs/2bw-tiny.yaml", short=MICROBATCHES,
        layout="pipeline", groups=False, shards=False,
        matrix={"2bw": {"strategy.delay": 1}, "2bw-sync": {"strategy.delay": 0}},
        golden={},
        resume={"4-2bw-44-steps": long_resume(*MICROBATCHES)},
        stop={"pipeline": Case(("run.steps=10", *MICROBATCHES, "run.log_every=4"),
                               slow=True)},
        fsdp={},
        fsdp_resume={},
        whatif={"pipedream-2bw": Case(("data.batch_size=4",))},
        projection={"2bw": Case(MICROBATCHES)},
        checkpointing={"2bw": Case((*MICROBATCHES, *LLAMA))},
        memory={"2bw": Case(("parallel.num_microbatches=4",))},
    ),
)

REGISTRY: dict[str, Entry] = {entry.name: entry for entry in ENTRIES}
"""Registered name -> entry, in algorithms/base.py `STRATEGIES`' order."""

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def cases(table: str, *, deepspeed: bool = True) -> dict[str, tuple[Entry, Case]]:
    """Every entry's cases in `table` (one of `TABLES`), in registry order: id -> (entry,
    case); with `deepspeed=False` those needing DeepSpeed left out."""
    out: dict[str, tuple[Entry, Case]] = {}
    for entry in ENTRIES:
        for case_id, case in getattr(entry, table).items():
            if case.deepspeed and not deepspeed:
                continue
            assert case_id not in out, f"{table}: case id {case_id!r} twice"
            out[case_id] = (entry, case)
    return out


def config_of(entry: Entry, case: Case) -> str:
    """The case's tiny config."""
    return case.config or entry.config


def matrix_rows() -> dict[str, dict]:
    """The combination matrix's strategy dimension: row id -> flat options, the strategy's
    name first."""
    rows: dict[str, dict] = {}
    for entry in ENTRIES:
        for row_id, options in entry.matrix.items():
            assert row_id not in rows, f"matrix: row id {row_id!r} twice"
            rows[row_id] = {"strategy.name": entry.name, **options}
    return rows
