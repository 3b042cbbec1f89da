"""The commbench config schema: its sections, cross-field validation and run identity.

`commbench config show configs/ddp-tiny.yaml` prints the resolved tree with each
field's documentation. Every field is documented by the string literal under it; that
text is the `--help` of the field. Reading YAML, `--set a.b=value` overrides, types and
did-you-mean are the generic engine in bench/typed.py; this module adds the schema and
the checks that need more than one field. Everything fails here, before any process
starts, naming the key path, the value and what is valid. The resolved config (minus
output paths) hashes to the run's identity.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from algorithms.base import STRATEGIES, StrategyConfig, config_class
from bench.env import StragglerConfig, check_straggler
from bench.optim import OptimConfig
from bench.typed import (  # noqa: F401  (re-exported: the public names of bench.config)
    describe_sections,
    field_docs,
    from_mapping,
    load_yaml_mapping,
    parse_assignment,
    set_override,
    set_value,
    to_dict,
    without_keys,
)
from bench.typed import fail as _fail


@dataclass
class RunConfig:
    name: str = "run"
    """Human-readable run name (letters, digits, '.', '_', '-'); the run directory is
    NAME-HASH under output_dir."""
    seed: int = 0
    """Seed for model init and the data order (same seed => same tokens in the same order)."""
    steps: int = 100
    """Optimizer steps to train."""
    output_dir: str = "results"
    """Directory under which the run directory is created."""
    log_every: int = 10
    """Write a metrics row every this many steps."""
    val_every: int = 50
    """Compute validation loss every this many steps (and always at the end); 0 = end only."""
    val_batches: int = 8
    """Validation batches per evaluation (shared held-out split)."""
    target_loss: float | None = None
    """Validation loss whose first crossing is recorded as time and tokens to target."""
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    """One rank made slower on purpose: {rank: int|null, slowdown: float >= 1}."""


@dataclass
class ModelConfig:
    arch: Literal["gpt2", "llama"] = "gpt2"
    """Architecture: gpt2 (LayerNorm, learned positions, GELU MLP, biases, tied head) or
    llama (RMSNorm, rotary positions, SwiGLU MLP, no biases, grouped-query attention,
    untied head)."""
    preset: str = "tiny"
    """Model size: tiny, small (124M class), medium (350M class), xl (gpt2: 1.5B), 1b
    (llama: Llama 3.2 1B's shape), 7b (LLaMA-7B's shape)."""
    seq_len: int = 128
    """Context length in tokens."""
    dropout: float = 0.0
    """Dropout probability (0 for pretraining benchmarks)."""
    n_layer: int | None = None
    """Override the preset's number of layers."""
    n_head: int | None = None
    """Override the preset's number of attention heads."""
    n_embd: int | None = None
    """Override the preset's hidden size."""
    n_kv_head: int | None = None
    """llama: key/value heads (grouped-query attention; must divide n_head); null = the
    preset's."""
    tie_embeddings: bool | None = None
    """Whether the LM head is the token embedding's weight; null = the architecture's
    convention (gpt2 tied, llama untied)."""
    activation_checkpointing: Literal["none", "blocks"] = "none"
    """none, or blocks: recompute each transformer block's activations in backward instead
    of keeping them (every strategy and pipeline; same values, less memory, about a third
    more compute)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """fp32, or bf16 autocast around forward passes (GPU; works but is slow on CPU)."""
    compile: bool = False
    """Wrap the model in torch.compile (GPU runs)."""


@dataclass
class DataConfig:
    corpus: str = "embedded"
    """embedded (ships with the install), openwebtext, a .txt file, a directory of .txt
    files, or a directory prepared by `commbench data prepare`."""
    tokenizer: Literal["byte", "gpt2"] = "byte"
    """byte (vocab 256) or gpt2 (GPT-2 BPE, offline)."""
    batch_size: int = 8
    """Sequences per data-parallel rank per step; global batch = batch_size x data ranks."""
    val_fraction: float = 0.05
    """Fraction of the corpus held out for validation (the tail)."""
    cache_dir: str = "~/.cache/commbench"
    """Where tokenised corpora are cached."""


@dataclass
class ParallelConfig:
    world_size: int = 1
    """Total ranks (processes)."""
    group_size: int = 1
    """Ranks per data-parallel replica group; world_size / group_size replicas."""
    num_stages: int = 1
    """Pipeline stages (pipeline strategies)."""
    num_microbatches: int = 1
    """Microbatches per step (gradient accumulation, or pipeline microbatches)."""
    partition: Literal["layers", "parameters"] = "layers"
    """How pipelines cut the model into stages: balanced by block or by parameter count."""
    shard: Literal["none", "fsdp"] = "none"
    """none (every rank holds its replica whole), or fsdp: each data-parallel replica (all
    ranks for ddp, a parallel.group_size group for diloco and pier) sharded over its ranks
    with FSDP2; outer steps then run on each rank's shard."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; auto = nccl on CUDA, gloo on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when available, else cpu."""
    timeout_s: float = 120.0
    """Process-group timeout: a dead or hung rank ends the run after this many seconds."""


@dataclass
class NetworkConfig:
    profiles: list[str] = field(
        default_factory=lambda: ["nvlink", "ib-400g", "eth-100g", "eth-10g", "wan-1g"]
    )
    """Network profiles to project every run's step time onto."""
    emulate: str | None = None
    """Profile to emulate: each communication op takes at least its modelled time."""
    ranks_per_node: int = 0
    """Ranks per (real or emulated) node for tiering links; 0 = the launcher's local size."""
    model: Literal["auto", "gloo", "nccl", "nccl-ring", "nccl-tree", "naive"] = "auto"
    """Collective algorithm the projection and emulation price (docs/network-model.md):
    auto = the run's backend (gloo on CPU, nccl on GPU); naive = textbook ring formulas."""
    links: str | None = None
    """What the run's own links are, for the report (e.g. "shaped: tbf 100 Mbit/s + 10 ms");
    null = "this machine's own links" (or the emulated profile with `emulate`)."""


@dataclass
class EvalConfig:
    suite: str | None = None
    """Evaluate the final model with this lm-eval suite (smoke, paper); null = no eval."""
    tasks: list[str] = field(default_factory=list)
    """Restrict the suite to these tasks."""
    limit: int | None = None
    """Examples per task (for quick checks)."""
    batch_size: int = 16
    """Sequences per lm-eval forward batch."""


@dataclass
class CheckpointConfig:
    every: int | None = None
    """Checkpoint every this many steps (for --resume); 0 = never, null = run.steps // 4."""
    final: bool = True
    """Save the evaluation model at the end (needed by `commbench eval`)."""


@dataclass
class LaunchConfig:
    nnodes: int = 1
    """Nodes for multi-node torchrun (each runs world_size / nnodes ranks)."""
    rdzv_endpoint: str | None = None
    """host:port of the c10d rendezvous for multi-node runs."""
    torchrun_args: list[str] = field(default_factory=list)
    """Extra arguments passed through to torchrun."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    strategy: StrategyConfig = field(default_factory=lambda: config_class("ddp")(),
                                     metadata={"parse": lambda v, p: _strategy_from_dict(v, p)})
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)


# Not the run's identity: where things go, and the checkpoint cadence (resume is bit-exact).
NON_IDENTITY_KEYS = ("run.output_dir", "data.cache_dir", "launch", "checkpoint")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
"""Names that become directory names: no path separators, no leading dot."""


# ---------------------------------------------------------------------------- parsing


def _strategy_from_dict(data: Any, path: str) -> StrategyConfig:
    """The strategy section: its `name` picks the config class of the other keys."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise _fail(path, data, f"a mapping with a name, e.g. {{name: ddp}} (names: "
                                f"{sorted(STRATEGIES)})")
    name = data.get("name", "ddp")
    if not isinstance(name, str) or name not in STRATEGIES:
        raise _fail(f"{path}.name", name, f"one of {sorted(STRATEGIES)}")
    return from_mapping(config_class(name), data, path)


def load_raw(path: str | os.PathLike) -> dict:
    """The raw mapping of a YAML config file (errors name the file and the line)."""
    return load_yaml_mapping(path, "config file")


def from_dict(data: dict) -> Config:
    config = from_mapping(Config, data, "")
    validate(config)
    return config


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """Apply `--set KEY=VALUE` overrides to a raw config in place.

    Switching `strategy.name` drops the strategy knobs of the file: they belong to
    another algorithm (as in sweeps); knobs given with --set are kept."""
    pairs = [parse_assignment(a) for a in overrides]
    new_name = dict(pairs).get("strategy.name")
    strategy = data.get("strategy")
    if isinstance(strategy, dict) and new_name is not None and \
            new_name != strategy.get("name", "ddp"):
        data["strategy"] = {}
    for key, value in pairs:
        set_value(data, key, value)
    return data


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Read YAML (or start from defaults), apply `--set` overrides, parse and validate."""
    data = load_raw(path) if path else {}
    return from_dict(apply_overrides(data, overrides))


# ------------------------------------------------------------------------- validation


def _at_least(path: str, value: float | None, minimum: float = 1) -> None:
    if value is not None and value < minimum:
        raise ValueError(f"{path} must be >= {minimum}, got {value!r}")


def _in_range(path: str, value: float, low: float, high: float, closed: str = "[)") -> None:
    ok_low = value >= low if closed[0] == "[" else value > low
    ok_high = value <= high if closed[1] == "]" else value < high
    if not (ok_low and ok_high):
        raise _fail(path, value, f"in {closed[0]}{low}, {high}{closed[1]}")


def validate(cfg: Config) -> None:
    """Checks that need more than one field's type: ranges, tables, cross-section rules."""
    from bench.data import check_corpus_path
    from bench.model import config_of
    from bench.network import PROFILES, get_profile, is_profile_path

    if not NAME_RE.match(cfg.run.name):
        raise _fail("run.name", cfg.run.name, "letters, digits, '.', '_' or '-', not starting "
                    "with '.' (it names the run directory)")
    for key in ("run.steps", "run.log_every", "run.val_batches", "model.seq_len",
                "data.batch_size", "parallel.world_size", "parallel.group_size",
                "parallel.num_stages", "parallel.num_microbatches", "parallel.timeout_s",
                "launch.nnodes", "eval.batch_size", "eval.limit"):  # None passes
        section, name = key.split(".")
        _at_least(key, getattr(getattr(cfg, section), name))
    for key in ("run.val_every", "optim.warmup_steps", "optim.grad_clip",
                "optim.weight_decay", "checkpoint.every", "network.ranks_per_node"):
        section, name = key.split(".")
        _at_least(key, getattr(getattr(cfg, section), name), 0)
    if cfg.optim.lr <= 0:
        raise _fail("optim.lr", cfg.optim.lr, "> 0")
    _in_range("optim.min_lr_ratio", cfg.optim.min_lr_ratio, 0, 1, "[]")
    for i, beta in enumerate(cfg.optim.betas):
        _in_range(f"optim.betas[{i}]", beta, 0, 1)
    _in_range("optim.momentum", cfg.optim.momentum, 0, 1)
    _in_range("data.val_fraction", cfg.data.val_fraction, 0, 1, "()")
    # the preset and shape checks (heads divide the width, dropout) live with the model
    blocks = config_of(cfg.model, 256).n_layer
    if cfg.parallel.num_stages > blocks:
        raise ValueError(f"parallel.num_stages ({cfg.parallel.num_stages}) must be <= the "
                         f"model's number of blocks ({blocks})")
    for i, name in enumerate(cfg.network.profiles):
        if name not in PROFILES and not is_profile_path(name):
            raise _fail(f"network.profiles[{i}]", name,
                        f"one of {sorted(PROFILES)} or a profile YAML path")
        get_profile(name)  # a user's file: its own errors name the bad field
    emulate = cfg.network.emulate
    if emulate is not None and emulate not in PROFILES and not is_profile_path(emulate):
        raise _fail("network.emulate", emulate,
                    f"null or one of {sorted(PROFILES)} or a profile YAML path")
    if emulate is not None:
        get_profile(emulate)
    world, group = cfg.parallel.world_size, cfg.parallel.group_size
    if world % group:
        raise ValueError(
            f"parallel.world_size ({world}) must be divisible by parallel.group_size ({group})"
        )
    if world % cfg.launch.nnodes:
        raise ValueError(
            f"parallel.world_size ({world}) must be divisible by launch.nnodes "
            f"({cfg.launch.nnodes})"
        )
    if cfg.data.batch_size % cfg.parallel.num_microbatches:
        raise ValueError(
            f"parallel.num_microbatches ({cfg.parallel.num_microbatches}) must divide "
            f"data.batch_size ({cfg.data.batch_size})"
        )
    if cfg.parallel.backend == "nccl" and cfg.parallel.device == "cpu":
        raise ValueError("parallel.backend 'nccl' needs parallel.device cuda (or auto on a "
                         "GPU machine); with parallel.device cpu use backend gloo or auto")
    if cfg.eval.suite is not None and cfg.eval.suite not in ("smoke", "paper"):
        raise _fail("eval.suite", cfg.eval.suite, "null, 'smoke' or 'paper'")
    if cfg.eval.tasks and cfg.eval.suite is None:
        raise ValueError(f"eval.tasks {cfg.eval.tasks} needs eval.suite (smoke or paper)")
    if cfg.parallel.shard == "fsdp":
        _check_sharded(cfg)
    check_corpus_path(cfg.data.corpus)
    check_straggler(cfg.run.straggler, cfg.parallel.world_size)
    cfg.strategy.check(cfg)  # the strategy's own cross-section rules (stages, world size, ...)


SHARD_REFUSED_OPTIMIZERS = {
    "muon": "Muon orthogonalises whole matrices: on FSDP shards DTensor would gather them "
            "behind the ledger's back every step",
    "soap": "SOAP's Kronecker preconditioners are per whole matrix (pytorch-optimizer's "
            "SOAP mixes DTensor shards with plain tensors and fails)",
    "adan": "pytorch-optimizer's Adan calls an operator DTensor has no sharding rule for "
            "(aten._foreach_copy_)",
}


def _check_sharded(cfg: Config) -> None:
    """What parallel.shard=fsdp cannot be combined with (strategies check their own)."""
    reason = SHARD_REFUSED_OPTIMIZERS.get(cfg.optim.name)
    if reason:
        raise ValueError(f"optim.name={cfg.optim.name!r} with parallel.shard=fsdp: {reason}; "
                         f"valid: adamw, sgd, lion, or parallel.shard=none")
    if cfg.model.compile:
        raise ValueError("model.compile=true with parallel.shard=fsdp is not supported (the "
                         "model would be compiled before it is sharded): set model.compile "
                         "to false, or parallel.shard=none")


def check_device(cfg: Config) -> None:
    """Fail unless this machine has the device and backend the config asks for."""
    import torch

    has_cuda = torch.cuda.is_available()
    if cfg.parallel.device == "cuda" and not has_cuda:
        raise _fail("parallel.device", "cuda", "auto or cpu on this machine (it has no CUDA "
                    "device)")
    on_cuda = cfg.parallel.device == "cuda" or (cfg.parallel.device == "auto" and has_cuda)
    if cfg.parallel.backend == "nccl" and not on_cuda:
        raise _fail("parallel.backend", "nccl", "auto or gloo on this machine (nccl needs a "
                    "CUDA device)")


def preflight(cfg: Config) -> None:
    """Checks against the machine that will train the run, before anything is launched:
    the device and backend exist here, each rank's memory plan fits the device
    (bench/memory.py), and the corpus has enough tokens for a window of training and of
    validation data (tokenising it into the cache if needed)."""
    from bench.data import check_corpus_size
    from bench.memory import check_fits

    check_device(cfg)
    check_fits(cfg)
    check_corpus_size(cfg.data.corpus, cfg.data.tokenizer, cfg.data.cache_dir,
                      cfg.data.val_fraction, cfg.model.seq_len)


def check_output_dir(path: str, key: str = "run.output_dir") -> Path:
    """Create the output directory (or fail naming `key` if it is not writable)."""
    out = Path(path).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"{key} {path!r} is not writable: {err.strerror} (give a directory "
                         "path whose parents are directories you can write)") from None
    return out


# ---------------------------------------------------------------------- serialisation


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def identity_dict(cfg: Config) -> dict:
    return without_keys(to_dict(cfg), NON_IDENTITY_KEYS)


def config_hash(cfg: Config) -> str:
    """Stable 12-hex-digit identity of the computation a config describes."""
    blob = json.dumps(identity_dict(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def describe(cfg: Config) -> str:
    """The resolved config as YAML with each field's documentation as a comment."""
    return "\n".join([f"# identity: {config_hash(cfg)}", *describe_sections(cfg)]) + "\n"
