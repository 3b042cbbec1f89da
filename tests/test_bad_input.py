"""The bad-input matrix: every input a user can get wrong fails cleanly, before any work.

Each row runs the real command line (`bench.cli.main`, as `commbench ...` would) and
asserts the exit code, that the message holds each expected part (the key or path, the
bad value and what is valid) and that nothing on disk changed (the temporary directory
is snapshotted before and after; the tokeniser cache is not a record and is left out).

Adding a case is one row: `Case(id, argv, expect, files=...)`. In `argv` and `files`,
{tmp} is the test's directory and {repo} the repository; `run_argv(...)` builds a
`commbench run` of configs/ddp-tiny.yaml writing under {tmp}/out.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from bench.cli import main
from bench.config import load_config, to_yaml

REPO = Path(__file__).resolve().parent.parent
DDP_TINY = "{repo}/configs/ddp-tiny.yaml"
TWO_BW = "{repo}/configs/2bw-tiny.yaml"
PIPE_1F1B = "{repo}/configs/pipeline-1f1b-tiny.yaml"
OUT = ["--set", "run.output_dir={tmp}/out", "--set", "data.cache_dir={tmp}/cache"]


@dataclass
class Case:
    id: str
    argv: list[str]
    expect: list[str]
    """Parts the error message must hold: the key or path, the value, what is valid."""
    files: dict[str, str | bytes] = field(default_factory=dict)
    """Files to create under {tmp} first (name -> text or bytes)."""
    code: int = 2
    marks: tuple = ()


def run_argv(*sets: str, config: str | None = DDP_TINY) -> list[str]:
    argv = ["run"] + ([config] if config else []) + OUT  # a case's own --set comes later
    for s in sets:
        argv += ["--set", s]
    return argv + ["--quiet"]


def spec(body: str) -> dict[str, str]:
    """A sweep spec file {tmp}/spec.yaml over configs/ddp-tiny.yaml, writing under {tmp}/out."""
    return {"spec.yaml": f"base: {{repo}}/configs/ddp-tiny.yaml\noutput_dir: {{tmp}}/out\n"
                         f"report_dir: {{tmp}}/report\n{body}"}


def claim(name: str = "toy", seeds: int = 3, contrast: str = "{diloco: 1, ddp: -1}",
          file: str = "toy.yaml") -> dict[str, str]:
    """A claim file claims/FILE over configs/ddp-tiny.yaml (the claims' page: {tmp}/page)."""
    return {f"claims/{file}": (
        f"name: {name}\nstatement: diloco beats ddp\n"
        "sweep: {base: {repo}/configs/ddp-tiny.yaml, variants: {ddp: {strategy.name: ddp}, "
        "diloco: {strategy.name: diloco}}}\n"
        f"scales: {{tiny: {{seeds: {seeds}}}}}\n"
        f"rules: [{{metric: final_val_loss, contrast: {contrast}, holds_if: {{below: 0}}}}]\n")}


CLAIMS = ["claims", "--dry-run", "--claims-dir", "{tmp}/claims", "--output-dir", "{tmp}/out",
          "--report-dir", "{tmp}/page"]
SWEEP = ["sweep", "{tmp}/spec.yaml", "--no-report"]
SMALL = ["parallel.world_size=2", "run.steps=4", "run.log_every=2", "run.val_sequences=8"]
"""A run small enough that a row which wrongly trains it (old code) fails fast."""
RECORDED = to_yaml(load_config(REPO / "configs/ddp-tiny.yaml", [
    *SMALL, "run.output_dir='{tmp}/out'", "data.cache_dir='{tmp}/cache'"]))
"""config.yaml of the recorded run in the run-directory rows (`run_argv(*SMALL)`'s config)."""


def recorded_run(status: str = "failed", interrupted: bool = True,
                 checkpoints: dict[int, bytes] | None = None,
                 data: dict | None = None) -> dict[str, str | bytes]:
    """Files of a run directory {tmp}/r: RECORDED's config, a summary (`data`: its corpus
    identity), two metrics rows and state checkpoints (rank -> file content)."""
    summary = {"status": status, "run_name": "ddp-tiny", "steps": 2,
               **({"data": data} if data else {})}
    if interrupted:
        summary.update(error="interrupted by the user", interrupted=True)
    files = {"r/config.yaml": RECORDED, "r/summary.json": json.dumps(summary),
             "r/metrics.jsonl": '{"step": 2, "loss": 5.0}\n{"step": 4, "loss": 4.0}\n'}
    for rank, content in (checkpoints or {}).items():
        files[f"r/checkpoints/state-rank{rank}.pt"] = content
    return files


def state_file(step: int, truncate: int | None = None) -> bytes:
    """A state-rankN.pt holding `step` (cut to `truncate` bytes: a file torn mid-write)."""
    buffer = io.BytesIO()
    torch.save({"step": step, "strategy": {}, "loop": {}}, buffer)
    return buffer.getvalue()[:truncate]


def dcp_checkpoint(step: int = 2, world: int = 2, run: str | None = None,
                   identities: dict[int, int] | None = None,
                   skeleton_step: int | None = None) -> dict[str, bytes]:
    """Files of a DCP checkpoint r/checkpoints/state-step{step}/ (bench/run/dcp_state.py) as
    a finished save leaves it: each rank's skeleton (saved rank `identities[r]`'s, else
    r's: a file swapped between ranks; of `skeleton_step`: copied from another checkpoint)
    and its own state, all in one __0_0.distcp (written here in one process), and
    complete.json (`run`: its run key)."""
    import tempfile
    import warnings

    import torch.distributed.checkpoint as dcp

    from bench.run import dcp_state

    leaves: dict = {}
    for rank in range(world):
        tree = {"strategy": [], "own": dcp_state.flatten(
            {"loop": {"step": step}, "rng": torch.get_rng_state()}, f"rank{rank}/own", leaves),
            "identity": {"rank": (identities or {}).get(rank, rank), "run": run,
                         "step": step if skeleton_step is None else skeleton_step}}
        leaves[f"rank{rank}/skeleton"] = torch.frombuffer(bytearray(json.dumps(tree).encode()),
                                                          dtype=torch.uint8)
    where = f"r/checkpoints/state-step{step}"
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(leaves, storage_writer=dcp.FileSystemWriter(tmp, thread_count=1), no_dist=True)
        files = {f"{where}/{p.name}": p.read_bytes() for p in Path(tmp).iterdir()}
    info = {"step": step, "world_size": world, "replicated": False, "run": run}
    files[f"{where}/complete.json"] = json.dumps(info).encode()
    return files


def cut(files: dict[str, bytes], name: str, keep: int) -> dict[str, bytes]:
    """`files` with the one whose name ends with `name` cut to `keep` bytes (torn)."""
    return {k: v[:keep] if k.endswith(name) else v for k, v in files.items()}


RESUME = ["run", "--resume", "{tmp}/r", "--quiet"]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
LRS = [i / 1e5 for i in range(1, 101)]
SMALL_TEXT = "To be, or not to be: that is the question.\n" * 25  # ~1100 bytes

CASES = [
    # ---- config values and overrides
    Case("unknown-key", run_argv("run.stepz=3"), ["run.stepz", "did you mean 'steps'"]),
    Case("not-an-int", run_argv("run.steps=abc"), ["run.steps", "'abc'", "an integer"]),
    Case("zero-steps", run_argv("run.steps=0"), ["run.steps", ">= 1", "got 0"]),
    Case("bad-preset", run_argv("model.preset=huge"), ["model.preset", "'huge'", "one of"]),
    Case("bad-emulate", run_argv("network.emulate=dialup"),
         ["network.emulate", "'dialup'", "null or one of"]),
    Case("bad-profile", run_argv("network.profiles=[eth-10g, pigeon]"),
         ["network.profiles[1]", "'pigeon'", "one of"]),
    Case("group-size", run_argv("parallel.group_size=3"),
         ["parallel.group_size (3)", "parallel.world_size (4)", "divisible"]),
    Case("tokenizer", run_argv("data.tokenizer=sentencepiece"),
         ["data.tokenizer", "'sentencepiece'", "['byte', 'gpt2']"]),
    Case("strategy-name", run_argv("strategy.name=magic"),
         ["strategy.name", "'magic'", "one of", "'ddp'"]),
    Case("bool", run_argv("model.compile=maybe"), ["model.compile", "'maybe'", "true or false"]),
    Case("betas-length", run_argv("optim.betas=[0.9]"), ["optim.betas", "a list of 2 values"]),
    Case("section-scalar", run_argv("run=5"), ["run", "got 5", "a mapping"]),
    Case("val-fraction", run_argv("data.val_fraction=1.5"),
         ["data.val_fraction", "1.5", "in (0, 1)"]),
    Case("val-batches-replaced", run_argv("run.val_batches=2"),
         ["run.val_batches (2)", "replaced by run.val_sequences",
          "run.val_sequences: 16 (val_batches 2 x data.batch_size 8)"]),
    Case("val-batches-replaced-in-file", run_argv(config="{tmp}/c.yaml"),
         ["run.val_batches (8)", "run.val_sequences: 128 (val_batches 8 x data.batch_size 16)"],
         files={"c.yaml": "run: {val_batches: 8}\ndata: {batch_size: 16}\n"}),
    Case("val-sequences-zero", run_argv("run.val_sequences=0"),
         ["run.val_sequences", ">= 1", "got 0"]),
    # ---- #16.7: checks that used to wait for torchrun
    Case("cuda-without-cuda", run_argv("parallel.device=cuda"),
         ["parallel.device", "'cuda'", "auto or cpu"], marks=(NO_CUDA,)),
    Case("nccl-on-cpu", run_argv("parallel.backend=nccl"),
         ["parallel.backend", "'nccl'", "auto or gloo"], marks=(NO_CUDA,)),
    Case("nccl-with-device-cpu", run_argv("parallel.backend=nccl", "parallel.device=cpu"),
         ["parallel.backend 'nccl'", "parallel.device", "gloo or auto"]),
    Case("timeout-inf", run_argv("parallel.timeout_s=.inf"),
         ["parallel.timeout_s", "inf", "a finite number"]),
    # ---- #16.8: crashes and an escape
    Case("strategy-int", run_argv("strategy=5"), ["strategy", "5", "a mapping with a name"]),
    Case("strategy-name-list", run_argv("strategy.name=[ddp]"),
         ["strategy.name", "['ddp']", "one of"]),
    Case("strategy-string", run_argv("strategy=ddp"), ["strategy", "'ddp'", "{name: ddp}"]),
    Case("strategy-string-file", run_argv(config="{tmp}/c.yaml"),
         ["strategy", "'ddp'", "{name: ddp}"], files={"c.yaml": "strategy: ddp\n"}),
    Case("report-under-file", ["report", "{tmp}/out", "-o", "{tmp}/file/report"],
         ["report -o", "{tmp}/file", "is a file", "a directory"], files={"file": "x"}),
    Case("run-name-escape", run_argv("run.name=../../escape"),
         ["run.name", "'../../escape'", "letters, digits"]),
    Case("switch-keeps-typed-knob", run_argv("strategy.name=diloco", "strategy.backend=torch"),
         ["strategy.backend", "unknown config key", "valid keys"]),
    # ---- #16.9: validation that used to wait for launch, or accepted bad values
    Case("heads-not-dividing", run_argv("model.n_head=5"),
         ["model.n_embd (64)", "model.n_head (5)", "divisible"]),
    Case("dropout", run_argv("model.dropout=1.5"), ["model.dropout", "1.5", "[0, 1)"]),
    Case("lr-nan", run_argv("optim.lr=.nan"), ["optim.lr", "nan", "a finite number"]),
    Case("lr-zero", run_argv("optim.lr=0"), ["optim.lr", "0", "> 0"]),
    Case("checkpoint-every", run_argv("checkpoint.every=-1"),
         ["checkpoint.every", "-1", ">= 0"]),
    Case("weight-decay", run_argv("optim.weight_decay=-0.1"),
         ["optim.weight_decay", "-0.1", ">= 0"]),
    Case("betas-range", run_argv("optim.betas=[1.5, 2]"), ["optim.betas[0]", "1.5", "[0, 1)"]),
    Case("optimizer-name", run_argv("optim.name=adam"), ["optim.name", "'adam'", "muon"]),
    Case("delay-two", run_argv("optim.delay=2"), ["optim.delay", "got 2", "1 (one-step delay)"]),
    Case("ef-without-delay", run_argv("optim.delay_correction=ef"),
         ["optim.delay_correction", "ef", "optim.delay"]),
    # ---- the pipeline delay profile (issue 47)
    Case("delay-profile-name", run_argv("optim.delay=1", "optim.delay_profile=stages"),
         ["optim.delay_profile", "'stages'", "pipeline"]),
    Case("delay-stages-more-than-blocks",
         run_argv("optim.delay=1", "optim.delay_profile=pipeline", "optim.delay_stages=3"),
         ["optim.delay_stages", "got 3", "number of blocks (2)"]),
    Case("delay-stages-one",
         run_argv("optim.delay=1", "optim.delay_profile=pipeline", "optim.delay_stages=1"),
         ["optim.delay_stages", "got 1", "from 2"]),
    Case("delay-profile-without-stages", run_argv("optim.delay=1", "optim.delay_profile=pipeline"),
         ["optim.delay_profile=pipeline", "optim.delay_stages", "got None", "from 2"]),
    Case("delay-stages-with-uniform", run_argv("optim.delay=1", "optim.delay_stages=2"),
         ["optim.delay_stages=2", "'uniform'", "optim.delay_profile=pipeline"]),
    Case("delay-profile-with-ef",
         run_argv("optim.delay=1", "optim.delay_profile=pipeline", "optim.delay_stages=2",
                  "optim.delay_correction=ef"),
         ["optim.delay_correction='ef'", "one step of delay", "optim.delay_correction=none"]),
    Case("delay-profile-on-a-pipeline",
         run_argv("optim.delay=1", "optim.delay_profile=pipeline", "optim.delay_stages=2",
                  config=PIPE_1F1B),
         ["optim.delay_profile=pipeline", "'pipeline'", "a data-parallel strategy"]),
    Case("deepspeed-muon", run_argv("strategy.backend=deepspeed", "optim.name=muon"),
         ["strategy.backend=deepspeed", "'muon'", "strategy.backend=torch"]),
    Case("eval-task", run_argv("eval.suite=smoke", "eval.tasks=[nosuch]"),
         ["eval.tasks", "nosuch", "valid", "smoke_cloze"]),
    Case("eval-tasks-without-suite", run_argv("eval.tasks=[smoke_cloze]"),
         ["eval.tasks", "smoke_cloze", "needs eval.suite"]),
    Case("eval-suite", run_argv("eval.suite=huge"), ["eval.suite", "'huge'", "'smoke'"]),
    # ---- config files
    Case("duplicate-yaml-key", run_argv(config="{tmp}/c.yaml"),
         ["{tmp}/c.yaml", "line 3", "'run'", "given twice", "keep one"],
         files={"c.yaml": "run: {steps: 5}\nmodel: {preset: tiny}\nrun: {steps: 6}\n"}),
    Case("empty-yaml", run_argv(config="{tmp}/c.yaml"), ["{tmp}/c.yaml", "is empty", "mapping"],
         files={"c.yaml": "# nothing\n"}),
    Case("binary-config", run_argv(config="{tmp}/c.yaml"),
         ["{tmp}/c.yaml", "not a text file", "YAML"], files={"c.yaml": b"\xff\xfe\x00\x81" * 8}),
    Case("yaml-syntax", run_argv(config="{tmp}/c.yaml"), ["{tmp}/c.yaml", "not valid YAML"],
         files={"c.yaml": "run: {steps: 5\n"}),
    Case("yaml-list", run_argv(config="{tmp}/c.yaml"),
         ["{tmp}/c.yaml", "top level must be a mapping", "[1, 2]"], files={"c.yaml": "[1, 2]\n"}),
    Case("missing-config", run_argv(config="{tmp}/nope.yaml"),
         ["config file not found", "{tmp}/nope.yaml"]),
    # ---- corpora
    Case("corpus-empty-string", run_argv("data.corpus=''"),
         ["data.corpus must name a corpus", "got ''", "embedded, shakespeare"],
         files={"stray.txt": SMALL_TEXT * 40}),  # it trained on the working directory's
    Case("cache-dir-unknown-user", run_argv("data.cache_dir=~nosuchuser29/cache"),
         ["data.cache_dir", "'~nosuchuser29/cache'", "no such user", "an absolute path"]),
    Case("report-into-run-dir", ["report", "{tmp}/r", "-o", "{tmp}/r/report"],
         ["report -o", "{tmp}/r", "is a run directory", "elsewhere"], files=recorded_run()),
    Case("corpus-missing", run_argv("data.corpus={tmp}/none.txt"),
         ["data.corpus", "{tmp}/none.txt", "no such file", "a .txt file"]),
    Case("corpus-empty", run_argv("data.corpus={tmp}/empty.txt"),
         ["data.corpus", "{tmp}/empty.txt", "is empty", "a .txt file"], files={"empty.txt": ""}),
    Case("corpus-dir-without-text", run_argv("data.corpus={tmp}/corpus"),
         ["data.corpus", "{tmp}/corpus", "not a corpus", "a directory of .txt files"],
         files={"corpus/notes.md": "hello"}),
    Case("corpus-val-too-small", run_argv("data.corpus={tmp}/small.txt"),
         ["data.corpus", "{tmp}/small.txt", "val split", "model.seq_len + 1 = 129",
          "data.val_fraction"], files={"small.txt": SMALL_TEXT}),
    Case("val-sequences-over-split", run_argv("data.corpus={tmp}/mid.txt"),
         ["data.corpus", "{tmp}/mid.txt", "run.val_sequences must be <= 16",
          "validation split", "got 64", "valid: 1 to 16",
          "data.val_fraction"], files={"mid.txt": SMALL_TEXT * 40}),
    # ---- command-line arguments
    Case("set-without-equals", run_argv("run.steps"), ["--set", "KEY=VALUE", "'run.steps'"]),
    Case("output-dir-under-file", run_argv("run.output_dir={tmp}/file/sub"),
         ["run.output_dir", "{tmp}/file/sub", "not writable", "directory"], files={"file": "x"}),
    Case("resume-not-a-run", run_argv() + ["--resume", "{tmp}/nothing"],
         ["--resume", "{tmp}/nothing", "not a run directory"]),
    # ---- run directories and checkpoints (#16.3, #16.4, #16.5)
    Case("run-dir-other-run", run_argv(*SMALL, "run.name=other") + ["--run-dir", "{tmp}/r"],
         ["--run-dir", "{tmp}/r", "another run (ddp-tiny, config", "this config is other",
          "new directory"], files=recorded_run()),
    Case("run-dir-finished", run_argv(*SMALL) + ["--run-dir", "{tmp}/r"],
         ["--run-dir", "{tmp}/r", "already recorded", "status ok", "--resume"],
         files=recorded_run("ok", interrupted=False)),
    Case("resume-changed-lr", RESUME + ["--set", "optim.lr=0.01"],
         ["--resume", "{tmp}/r", "optim.lr 0.003 -> 0.01", "Only run.steps may grow"],
         files=recorded_run()),
    Case("resume-world-size", RESUME + ["--set", "parallel.world_size=4"],
         ["parallel.world_size differ", "ddp on 2 ranks", "ddp on 4 ranks",
          "global batch must stay 16", "data.batch_size to 16 / parallel.world_size"],
         files=recorded_run()),
    Case("resume-other-config-file", ["run", DDP_TINY, "--resume", "{tmp}/r", "--quiet"],
         ["--resume", "{tmp}/r", "parallel.world_size differ", "global batch must stay 16",
          "These keys differ too", "run.val_sequences 8 -> 64"],
         files=recorded_run()),
    Case("resume-fewer-steps", RESUME + ["--set", "run.steps=2"],
         ["--resume", "run.steps can only grow", "recorded 4, got 2"], files=recorded_run()),
    Case("resume-finished", RESUME, ["--resume", "{tmp}/r", "already finished (status ok)",
                                     "run.steps=N with N > 4"],
         files=recorded_run("ok", interrupted=False)),
    Case("resume-diverged", RESUME + ["--set", "run.steps=8"],
         ["--resume", "already finished (status diverged)"],
         files=recorded_run("diverged", interrupted=False)),
    Case("resume-truncated-checkpoint", RESUME,
         ["--resume", "{tmp}/r/checkpoints/state-rank1.pt", "corrupt or truncated"],
         files=recorded_run(checkpoints={0: state_file(2), 1: state_file(2, truncate=200)})),
    Case("resume-checkpoint-steps-differ", RESUME,
         ["different steps", "state-rank0.pt: step 2", "state-rank1.pt: step 3"],
         files=recorded_run(checkpoints={0: state_file(2), 1: state_file(3)})),
    Case("resume-checkpoint-missing", RESUME,
         ["{tmp}/r/checkpoints/state-rank1.pt", "is missing", "parallel.world_size 2"],
         files=recorded_run(checkpoints={0: state_file(2)})),
    # ---- the same attacks on DCP checkpoints (checkpoints/state-stepN/, issue 46)
    Case("resume-dcp-other-run", RESUME,
         ["{tmp}/r/checkpoints/state-step2 belongs to another run", "run key 0123456789ab"],
         files={**recorded_run(), **dcp_checkpoint(run="0123456789ab")}),
    Case("resume-dcp-swapped-rank", RESUME,
         ["{tmp}/r/checkpoints/state-step2/__0_0.distcp holds rank 0's state",
          "not rank 1's", "swapped between ranks"],
         files={**recorded_run(), **dcp_checkpoint(identities={1: 0})}),
    Case("resume-dcp-other-step", RESUME,
         ["state-step4/__0_0.distcp holds rank 0's state of step 2", "not rank 0's of step 4"],
         files={**recorded_run(), **dcp_checkpoint(step=4, skeleton_step=2)}),
    Case("resume-dcp-torn-data", RESUME,
         ["{tmp}/r/checkpoints/state-step2/__0_0.distcp is truncated"],
         files={**recorded_run(), **cut(dcp_checkpoint(), "__0_0.distcp", 300)}),
    Case("resume-dcp-torn-metadata", RESUME,
         ["{tmp}/r/checkpoints/state-step2/.metadata is corrupt or truncated"],
         files={**recorded_run(), **cut(dcp_checkpoint(), ".metadata", 100)}),
    Case("resume-dcp-corrupt-complete", RESUME,
         ["{tmp}/r/checkpoints/state-step2/complete.json is corrupt", "delete that"],
         files={**recorded_run(), **dcp_checkpoint(),
                "r/checkpoints/state-step2/complete.json": b'{"step": "two"}'}),
    Case("resume-dcp-no-metadata", RESUME,
         ["{tmp}/r/checkpoints/state-step2 has a complete.json but no .metadata"],
         files={**recorded_run(), **{k: v for k, v in dcp_checkpoint().items()
                                     if not k.endswith(".metadata")}}),
    Case("resume-other-data", RESUME,
         ["--resume {tmp}/r: its data differ from the run's", "text sha256 0123456789ab",
          "data.corpus 'embedded' now holds", "the same tokens"],
         files=recorded_run(data={"source": "embedded", "sha256": "0123456789abcdef" * 4,
                                  "tokenizer": "byte", "num_train_tokens": 1000,
                                  "num_val_tokens": 50})),
    Case("resume-and-run-dir", RESUME + ["--run-dir", "{tmp}/x"],
         ["--resume", "--run-dir", "give one"], files=recorded_run()),
    Case("straggler-rank", run_argv("run.straggler.rank=7"),
         ["run.straggler.rank", "[0, 4)", "got 7"]),
    Case("straggler-slowdown", run_argv("run.straggler.slowdown=0.5"),
         ["run.straggler.slowdown", ">= 1", "got 0.5"]),
    Case("config-show-bad-key", ["config", "show", DDP_TINY, "--set", "optim.lrr=1"],
         ["optim.lrr", "did you mean 'lr'"]),
    # ---- sweep specs and sweep arguments (#16.9 empty spec, #16.10 --output-dir/--set)
    Case("sweep-empty-spec", SWEEP, ["{tmp}/spec.yaml", "sweep spec is empty"],
         files={"spec.yaml": ""}),
    Case("sweep-unknown-key", SWEEP, ["'gird'", "did you mean 'grid'", "{tmp}/spec.yaml"],
         files=spec("gird: {optim.lr: [1]}\n")),
    Case("sweep-empty-grid", SWEEP, ["grid is empty", "at least one axis"],
         files=spec("grid: {}\n")),
    Case("sweep-zip-lengths", SWEEP, ["zip", "same length", "'optim.warmup_steps': 1"],
         files=spec("zip: {optim.lr: [0.001, 0.002], optim.warmup_steps: [1]}\n")),
    Case("sweep-seeds", SWEEP, ["seeds", "3", "a non-empty list of integers"],
         files=spec("seeds: 3\n")),
    Case("sweep-base-missing", SWEEP, ["base config", "'missing.yaml'", "relative to the spec"],
         files={"spec.yaml": "base: missing.yaml\n"}),
    Case("sweep-variant-strategy", SWEEP, ["variant 'x'", "strategy.name", "'nosuch'", "one of"],
         files=spec("variants: {x: {strategy.name: nosuch}}\n")),
    Case("sweep-executor-name", SWEEP,
         ["executor.name", "'kubernetes'", "['local', 'slurm']"],
         files=spec("executor: {name: kubernetes}\n")),
    Case("sweep-executor-typo", SWEEP, ["executor.partiton", "did you mean 'partition'"],
         files=spec("executor: {name: slurm, partiton: gpu}\n")),
    Case("sweep-max-parallel", SWEEP + ["--max-parallel", "0"],
         ["executor.max_parallel", ">= 1", "got 0"], files=spec("")),
    Case("sweep-set-bad-value", SWEEP + ["--set", "optim.lr=abc"],
         ["optim.lr", "'abc'", "a number"], files=spec("")),
    Case("sweep-set-twice", SWEEP + ["--set", "run.seed=3"],
         ["'run.seed' is set twice", "--set", "seeds"], files=spec("seeds: [0, 1]\n")),
    Case("sweep-set-syntax", SWEEP + ["--set", "optim.lr"], ["--set", "KEY=VALUE"],
         files=spec("")),
    Case("sweep-output-dir-under-file", SWEEP + ["--output-dir", "{tmp}/file/sub"],
         ["output_dir", "{tmp}/file/sub", "not writable"], files={**spec(""), "file": "x"}),
    Case("sweep-cuda-without-cuda", SWEEP + ["--set", "parallel.device=cuda"],
         ["parallel.device", "'cuda'", "auto or cpu"], files=spec(""), marks=(NO_CUDA,)),
    Case("sweep-eval-task", SWEEP + ["--set", "eval.suite=smoke", "--set", "eval.tasks=[nosuch]"],
         ["eval.tasks", "nosuch", "valid"], files=spec("")),
    # ---- issue 29: a sweep too large to build (hung a --dry-run), a NaN target
    Case("sweep-10-6-runs", SWEEP + ["--dry-run"],
         ["the sweep has 1000000 runs", "100 (grid.optim.lr)", "100 (grid.optim.warmup_steps)",
          "at most 10000"],
         files=spec(f"seeds: {list(range(100))}\ngrid: {{optim.lr: {LRS}, "
                    f"optim.warmup_steps: {list(range(100))}}}\n")),
    Case("sweep-target-nan", SWEEP + ["--dry-run"],
         ["target_loss", "nan", "a finite validation loss"], files=spec("target_loss: .nan\n")),
    # ---- issue 29: eval
    Case("eval-device-missing", ["eval", "{tmp}/r", "--device", "cuda:7"],
         ["eval --device 'cuda:7' does not exist here", "valid: cpu"],
         files={**recorded_run(), "r/checkpoints/final.pt": b"unused"}, marks=(NO_CUDA,)),
    Case("eval-device-garbage", ["eval", "{tmp}/r", "--device", "gpu0"],
         ["eval --device must be cpu or cuda[:N]", "'gpu0'"],
         files={**recorded_run(), "r/checkpoints/final.pt": b"unused"}),
    # ---- issue 29: claims
    Case("claim-nan-contrast", CLAIMS, ["{tmp}/claims/toy.yaml", "rules[0].contrast.diloco",
                                        "nan", "a finite non-zero number"],
         files=claim(contrast="{diloco: .nan, ddp: -1}")),
    Case("claim-200000-seeds", CLAIMS, ["scales.tiny.seeds", "200000", "from 3", "to 100"],
         files=claim(seeds=200000)),
    Case("claims-seeds-option", CLAIMS + ["--seeds", "200000"],
         ["--seeds must be from 1 to 100", "got 200000"], files=claim()),
    Case("claims-one-name-two-files", CLAIMS,
         ["claim name 'toy' is given by two files", "{tmp}/claims/a.yaml",
          "{tmp}/claims/b.yaml", "share one sweep directory"],
         files={**claim(file="a.yaml"), **claim(file="b.yaml")}),
    Case("report-target-loss-nan", ["report", "{tmp}/r", "-o", "{tmp}/page", "--target-loss",
                                    "nan"],
         ["--target-loss", "nan", "a finite validation loss"], files=recorded_run()),
    Case("compare-tolerance-inf", ["compare", "{tmp}/r", "{tmp}/r", "-o", "{tmp}/page",
                                   "--tolerance", "inf"],
         ["--tolerance must be a finite number >= 0", "got inf"], files=recorded_run()),
    # ---- issue 29: out-of-range optimizer values were accepted
    Case("muon-momentum", run_argv("optim.name=muon", "optim.muon_momentum=5"),
         ["optim.muon_momentum", "[0, 1)", "got 5.0"]),
    Case("ef-lambda", run_argv("optim.delay=1", "optim.delay_correction=ef",
                               "optim.ef_lambda=-100"),
         ["optim.ef_lambda", "[0, 2]", "got -100.0"]),
    Case("muon-weight-decay", run_argv("optim.name=muon", "optim.muon_weight_decay=-0.1"),
         ["optim.muon_weight_decay", ">= 0", "got -0.1"]),
    Case("nadam-momentum-decay", run_argv("optim.name=nadamw",
                                          "optim.nadam_momentum_decay=-1"),
         ["optim.nadam_momentum_decay", ">= 0", "got -1.0"]),
    # ---- issue 29: numbers read from files, ranges
    Case("emulate-absurd-latency", run_argv("network.emulate={tmp}/slow.yaml"),
         ["slow.yaml.inter.latency", "from 0 to 10 s", "got 100000"],
         files={"slow.yaml": "intra: nvlink\ninter: {latency: 100000, bandwidth: 1GB/s}\n"}),
    Case("profile-nan-bandwidth", run_argv("network.profiles=[{tmp}/nan.yaml]"),
         ["nan.yaml.inter.bandwidth", "got nan"],
         files={"nan.yaml": "intra: nvlink\ninter: {latency: 1ms, bandwidth: .nan}\n"}),
    # ---- issue 29: torchrun and netprobe
    Case("torchrun-args-world-size", run_argv("launch.torchrun_args=[--nproc-per-node=8]"),
         ["launch.torchrun_args[0]", "'--nproc-per-node=8'", "parallel.world_size / "
          "launch.nnodes", "valid: other torchrun options"]),
    Case("torchrun-args-rdzv", run_argv("launch.torchrun_args=[--max-restarts=0, "
                                        "--rdzv_endpoint=x:1]"),
         ["launch.torchrun_args[1]", "--rdzv", "launch.rdzv_endpoint"]),
    Case("rdzv-timeout-zero", run_argv("launch.rdzv_timeout_s=0"),
         ["launch.rdzv_timeout_s", ">= 1", "got 0"]),
    Case("netprobe-world-size-0", ["netprobe", "--world-size", "0", "--out", "{tmp}/p.yaml"],
         ["netprobe --world-size must be >= 2", "got 0", "two ranks"]),
    Case("netprobe-iters-0", ["netprobe", "--iters", "0", "--out", "{tmp}/p.yaml"],
         ["netprobe --iters must be >= 1", "got 0"]),
    Case("netprobe-exchange-gap-past-the-rto", ["netprobe", "--exchange-gap", "0.2", "--out",
                                                 "{tmp}/p.yaml"],
         ["netprobe --exchange-gap must be from 0 to under 0.2 seconds", "minimum RTO",
          "got 0.2"]),
    Case("netprobe-nnodes-0", ["netprobe", "--nnodes", "0", "--out", "{tmp}/p.yaml"],
         ["netprobe --nnodes must be >= 1", "got 0"]),
    Case("netprobe-sizes-inf", ["netprobe", "--sizes", "inf", "--out", "{tmp}/p.yaml"],
         ["netprobe --sizes", "'inf'", "a size like 4096"]),
    Case("netprobe-sizes-below-an-element", ["netprobe", "--sizes", "2", "--out",
                                             "{tmp}/p.yaml"],
         ["netprobe --sizes '2' is 2 bytes", "less than one element", ">= 4 bytes"]),
    Case("netprobe-timeout-nan", ["netprobe", "--timeout", "nan", "--out", "{tmp}/p.yaml"],
         ["netprobe --timeout", "a finite number of seconds > 0", "nan"]),
    # ---- pipelines (2 stages x 2 replicas configs)
    Case("pipe-stages-not-dividing-world",
         run_argv("parallel.num_stages=3", "model.n_layer=3", config=TWO_BW),
         ["parallel.world_size (4)", "divisible by", "parallel.num_stages (3)"]),
    Case("pipe-more-stages-than-blocks",
         run_argv("parallel.num_stages=4", "model.n_layer=2", config=TWO_BW),
         ["parallel.num_stages (4)", "<=", "number of blocks (2)"]),
    Case("pipe-microbatches-not-dividing-batch",
         run_argv("parallel.num_microbatches=3", config=PIPE_1F1B),
         ["parallel.num_microbatches (3)", "must divide", "data.batch_size (16)"]),
    Case("2bw-with-deepspeed", run_argv("strategy.backend=deepspeed", config=TWO_BW),
         ["strategy.backend", "'deepspeed'", "must be 'ours'"]),
    Case("2bw-with-optim-delay", run_argv("optim.delay=1", config=TWO_BW),
         ["optim.delay", "must be 0", "got 1"]),
    Case("pipe-with-group-size", run_argv("parallel.group_size=2", config=PIPE_1F1B),
         ["parallel.group_size", "must be 1", "got 2"]),
]


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under root (but the tokeniser cache) with a hash of its content."""
    seen = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if rel == "cache" or rel.startswith("cache/"):
            continue
        seen[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return seen


def _fill(text: str, tmp: Path) -> str:
    return text.replace("{tmp}", str(tmp)).replace("{repo}", str(REPO))


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_bad_input_fails_cleanly_and_changes_nothing(case, tmp_path, capsys):
    for name, content in case.files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(_fill(content, tmp_path))
    repo_results = _snapshot(REPO / "results") if (REPO / "results").exists() else {}
    before = _snapshot(tmp_path)

    code = main([_fill(a, tmp_path) for a in case.argv])

    err = capsys.readouterr().err
    assert code == case.code, err
    for part in case.expect:
        assert _fill(part, tmp_path) in err, f"{part!r} missing from: {err}"
    assert _snapshot(tmp_path) == before
    if repo_results:
        assert _snapshot(REPO / "results") == repo_results


def test_the_matrix_covers_enough_cases():
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)
