"""The typed config tree: YAML files plus `--set a.b=value` overrides, validated up front.

`commbench config show configs/ddp-tiny.yaml` prints the resolved tree with each
field's documentation. Every field is documented by the string literal under it; that
text is the `--help` of the field. Unknown keys, wrong types and bad cross-field values
fail here, before any process starts, naming the key path, the value and what is valid.
The resolved config (minus output paths) hashes to the run's identity.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import inspect
import json
import os
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from algorithms.base import STRATEGIES, StrategyConfig, config_class


@dataclass
class RunConfig:
    name: str = "run"
    """Human-readable run name; the run directory is NAME-HASH under output_dir."""
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


@dataclass
class ModelConfig:
    preset: str = "tiny"
    """Model size: tiny, small (GPT-2 124M), medium (350M), xl (1.5B), 7b."""
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
class OptimConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    """Inner optimizer: adamw, or sgd (with optional momentum)."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine schedule)."""
    warmup_steps: int = 10
    """Linear warmup steps from 0 to the peak learning rate."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """Learning-rate shape after warmup."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on biases and norms)."""
    momentum: float = 0.0
    """SGD momentum."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables."""


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
    every: int = 0
    """Save a resumable checkpoint every this many steps; 0 = never."""
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
    strategy: StrategyConfig = field(default_factory=lambda: config_class("ddp")())
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)


# Keys that say where things go, not what is computed: left out of the run's identity.
NON_IDENTITY_KEYS = ("run.output_dir", "data.cache_dir", "launch")


# ---------------------------------------------------------------------------- parsing


def _fail(path: str, value: Any, valid: str) -> ValueError:
    return ValueError(f"{path} must be {valid}, got {value!r}")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        alternatives = [a for a in args if a is not type(None)]
        errors = []
        for alternative in alternatives:  # e.g. int | list[int]: the first that fits
            try:
                return _coerce(value, alternative, path)
            except ValueError as err:
                errors.append(str(err))
        if len(errors) == 1:
            raise ValueError(errors[0])
        raise ValueError(" Or: ".join(errors))
    if origin is Literal:
        if value not in args:
            raise _fail(path, value, f"one of {list(args)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise _fail(path, value, "a list")
        return [_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise _fail(path, value, f"a list of {len(args)} values")
        pairs = enumerate(zip(value, args, strict=True))
        return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in pairs)
    if dataclasses.is_dataclass(tp):
        return _from_dict(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise _fail(path, value, "true or false")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise _fail(path, value, "an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 4e-4 as a string
            try:
                return float(value)
            except ValueError:
                pass
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _fail(path, value, "a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _fail(path, value, "a string")
        return value
    raise TypeError(f"{path}: unsupported config type {tp}")  # a bug in a config class


def _from_dict(cls: type, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{path or 'config'} must be a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            hint = difflib.get_close_matches(str(key), names, n=1)
            maybe = f" (did you mean {hint[0]!r}?)" if hint else ""
            where = f"{path}.{key}" if path else str(key)
            raise ValueError(f"unknown config key {where!r}{maybe}; valid keys: {names}")
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        sub = f"{path}.{name}" if path else name
        if cls is Config and name == "strategy":
            kwargs[name] = _strategy_from_dict(data[name], sub)
        else:
            kwargs[name] = _coerce(data[name], hints[name], sub)
    try:
        return cls(**kwargs)
    except ValueError as err:
        if path and not str(err).startswith(path):
            raise ValueError(f"{path}: {err}") from None
        raise


def _strategy_from_dict(data: Any, path: str) -> StrategyConfig:
    data = dict(data or {})
    name = data.get("name", "ddp")
    if name not in STRATEGIES:
        raise _fail(f"{path}.name", name, f"one of {sorted(STRATEGIES)}")
    return _from_dict(config_class(name), data, path)


def set_value(data: dict, key: str, value: Any) -> None:
    """Set the dotted `key` (e.g. strategy.inner_steps) in a raw config dict."""
    parts = key.strip().split(".")
    if not all(parts):
        raise ValueError(f"config key must be a dotted path like run.steps, got {key!r}")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"config key {key!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def set_override(data: dict, assignment: str) -> None:
    """Apply one `a.b.c=value` override to a raw config dict; the value is parsed as YAML."""
    if "=" not in assignment:
        raise ValueError(f"--set expects KEY=VALUE (e.g. run.steps=50), got {assignment!r}")
    key, raw = assignment.split("=", 1)
    set_value(data, key, yaml.safe_load(raw) if raw.strip() else "")


def load_raw(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file not found: {str(path)!r}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping of sections, got {data!r}")
    return data


def from_dict(data: dict) -> Config:
    config = _from_dict(Config, data, "")
    validate(config)
    return config


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Read YAML (or start from defaults), apply `--set` overrides, parse and validate."""
    data = load_raw(path) if path else {}
    for assignment in overrides:
        set_override(data, assignment)
    return from_dict(data)


# ------------------------------------------------------------------------- validation


def _positive(path: str, value: float, minimum: float = 1) -> None:
    if value < minimum:
        raise ValueError(f"{path} must be >= {minimum}, got {value!r}")


def validate(cfg: Config) -> None:
    """Cross-field checks that need more than one section, or the model/network tables."""
    from bench.model import PRESETS
    from bench.network import PROFILES

    _positive("run.steps", cfg.run.steps)
    _positive("run.log_every", cfg.run.log_every)
    _positive("run.val_every", cfg.run.val_every, 0)
    _positive("run.val_batches", cfg.run.val_batches)
    _positive("model.seq_len", cfg.model.seq_len)
    _positive("data.batch_size", cfg.data.batch_size)
    _positive("optim.warmup_steps", cfg.optim.warmup_steps, 0)
    _positive("optim.grad_clip", cfg.optim.grad_clip, 0)
    _positive("parallel.world_size", cfg.parallel.world_size)
    _positive("parallel.group_size", cfg.parallel.group_size)
    _positive("parallel.num_stages", cfg.parallel.num_stages)
    _positive("parallel.num_microbatches", cfg.parallel.num_microbatches)
    _positive("parallel.timeout_s", cfg.parallel.timeout_s, 1)
    _positive("launch.nnodes", cfg.launch.nnodes)
    if cfg.optim.lr <= 0:
        raise _fail("optim.lr", cfg.optim.lr, "> 0")
    if not 0 <= cfg.optim.min_lr_ratio <= 1:
        raise _fail("optim.min_lr_ratio", cfg.optim.min_lr_ratio, "in [0, 1]")
    if not 0 < cfg.data.val_fraction < 1:
        raise _fail("data.val_fraction", cfg.data.val_fraction, "in (0, 1)")
    if cfg.model.preset not in PRESETS:
        raise _fail("model.preset", cfg.model.preset, f"one of {sorted(PRESETS)}")
    for i, name in enumerate(cfg.network.profiles):
        if name not in PROFILES:
            raise _fail(f"network.profiles[{i}]", name, f"one of {sorted(PROFILES)}")
    if cfg.network.emulate is not None and cfg.network.emulate not in PROFILES:
        raise _fail("network.emulate", cfg.network.emulate, f"null or one of {sorted(PROFILES)}")
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
    if cfg.eval.suite is not None and cfg.eval.suite not in ("smoke", "paper"):
        raise _fail("eval.suite", cfg.eval.suite, "null, 'smoke' or 'paper'")
    _check_corpus(cfg.data.corpus)
    cfg.strategy.check(cfg)  # strategy-specific cross-section rules (stages, world size, ...)


NAMED_CORPORA = ("embedded", "shakespeare", "openwebtext")


def _check_corpus(corpus: str) -> None:
    if corpus in NAMED_CORPORA:
        return
    if not Path(corpus).expanduser().exists():
        raise ValueError(
            f"data.corpus: no such file or directory: {corpus!r} (valid: "
            f"{', '.join(NAMED_CORPORA)}, a .txt file, a directory of .txt files, or a "
            "directory prepared by `commbench data prepare`)"
        )


def check_output_dir(path: str) -> Path:
    """Create the output directory (or fail naming run.output_dir if it is not writable)."""
    out = Path(path).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"run.output_dir {path!r} is not writable: {err.strerror}") from None
    return out


# ---------------------------------------------------------------------- serialisation


def to_dict(cfg: Any) -> dict:
    def plain(v):
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(cfg))


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def without_keys(data: dict, keys: tuple[str, ...]) -> dict:
    """Remove dotted `keys` (a key or a whole section) from nested `data` in place; returns it.

    A key whose section is absent is skipped."""
    for key in keys:
        node: Any = data
        *parents, last = key.split(".")
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return data


def identity_dict(cfg: Config) -> dict:
    return without_keys(to_dict(cfg), NON_IDENTITY_KEYS)


def config_hash(cfg: Config) -> str:
    """Stable 12-hex-digit identity of the computation a config describes."""
    blob = json.dumps(identity_dict(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- field docs


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each dataclass field, keyed by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe(cfg: Config) -> str:
    """The resolved config as YAML with each field's documentation as a comment."""
    lines = [f"# identity: {config_hash(cfg)}"]
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        docs = field_docs(type(value))
        lines.append(f"{section.name}:")
        for f in dataclasses.fields(value):
            rendered = yaml.safe_dump(to_dict(value)[f.name], default_flow_style=True).strip()
            rendered = rendered.removesuffix("\n...").removesuffix("...").strip()
            doc = docs.get(f.name, "")
            lines.append(f"  {f.name}: {rendered}" + (f"  # {doc}" if doc else ""))
    return "\n".join(lines) + "\n"
