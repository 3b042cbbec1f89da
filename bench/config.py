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
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from algorithms.base import STRATEGIES, StrategyConfig, config_class
from algorithms.delay import CORRECTIONS
from bench.tracking import TrackingConfig, check_tracking
from bench.typed import (  # noqa: F401  (re-exported: the public names of bench.config)
    NAME_RE,
    check_name,
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
class StragglerConfig:
    """`run.straggler`: one rank made slower on purpose, to measure how a strategy copes.

        commbench run configs/diloco-tiny.yaml --set run.straggler.rank=1 \
            --set run.straggler.slowdown=2
    """

    rank: int | None = None
    """The slow rank; null = none."""
    slowdown: float = 1.0
    """Its steps take this many times their measured time (>= 1): after each step it
    sleeps (slowdown - 1) x the step's seconds, inside the timed step like a slow GPU."""


def check_straggler(straggler: StragglerConfig, world_size: int) -> None:
    """Fail naming run.straggler.* unless the rank exists and slowdown >= 1."""
    if straggler.rank is not None and not 0 <= straggler.rank < world_size:
        raise ValueError(f"run.straggler.rank must be null or a rank in [0, {world_size}) "
                         f"(parallel.world_size {world_size}), got {straggler.rank!r}")
    if not (math.isfinite(straggler.slowdown) and straggler.slowdown >= 1):
        raise ValueError(f"run.straggler.slowdown must be a finite number >= 1, got "
                         f"{straggler.slowdown!r}")


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
    val_sequences: int = 64
    """Validation windows (model.seq_len + 1 tokens each) spread evenly over the held-out
    split, the same set for every layout, batch size, world size and pipeline depth on the
    same data; scored as the exact mean over all their positions (bench/batches.py
    `validation_set`). 64 x 128 tokens for the tiny configs: a tenth of a second to score
    on CPU; set more for real runs (e.g. 1024 x 1024 tokens)."""
    target_loss: float | None = None
    """Validation loss whose first crossing is recorded as time and tokens to target."""
    warmup_steps: int = 1
    """Steps at the start of each process (a new run, or a resume) measured apart as
    warm-up: compile, communicator creation, autotuning. Trained and on the clock, but left
    out of throughput and MFU (summary warmup_s); 0 = none. Accounting only: not part of
    the run's identity."""
    compute_clock: Literal["auto", "wall"] = "auto"
    """What a rank's compute is measured on (bench/meter.py, Compute clock). auto: its own
    CPU time on a CPU device (ranks sharing cores do not count their waits for a core),
    step seconds minus exposed communication on CUDA. wall: step seconds minus exposed
    communication everywhere (the shaped-link lab, which holds projections against wall
    steps on its own shared cores). Accounting only: not part of the run's identity."""
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
    """torch.compile what each strategy trains, after its DDP wrapping (compile(DDP(model)),
    which keeps DDP's overlap); pipelines compile each stage module. GPU runs; refused with
    strategy.backend=deepspeed (its engine runs the forward)."""


@dataclass
class DataConfig:
    corpus: str = "embedded"
    """embedded (ships with the install), openwebtext, a .txt file, a directory of .txt
    files, or a directory prepared by `commbench data prepare` (a relative path is made
    absolute when the config is read; the run records its text's sha256)."""
    tokenizer: Literal["byte", "gpt2"] = "byte"
    """byte (vocab 256) or gpt2 (GPT-2 BPE, offline)."""
    batch_size: int = 8
    """Sequences per data-parallel rank per step; global batch = batch_size x data ranks."""
    val_fraction: float = 0.05
    """Fraction of the corpus held out for validation (the tail)."""
    cache_dir: str = "~/.cache/commbench"
    """Where tokenised corpora are cached."""


MAX_EF_LAMBDA = 2.0
"""The largest error-feedback weight: beyond it the correction overshoots the update's
own change more than twice (docs/algorithms.md, Error-feedback correction)."""
OPTIMIZERS = ("adamw", "sgd", "muon", "lion", "adan", "soap", "nadamw")


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd", "muon", "lion", "adan", "soap", "nadamw"] = "adamw"
    """Optimizer: adamw; sgd (optional momentum); muon (torch.optim.Muon on the hidden
    matrices, AdamW on the rest); lion, adan, soap (from the pytorch-optimizer package);
    nadamw (torch.optim.NAdam, Nesterov momentum, decoupled weight decay: with betas
    [0.99, 0.999] the asynchronous-pipeline recipe of Ajanthan et al. 2025)."""
    lr: float = 1e-3
    """Peak learning rate (under muon: of the AdamW part)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine schedule)."""
    warmup_steps: int = 10
    """Linear warmup steps from 0 to the peak learning rate."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """Learning-rate shape after warmup."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas (also muon's AdamW part, lion's, soap's and nadamw's betas; adan keeps
    the package's three defaults)."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on biases and norms); under muon, on the
    AdamW part's matrices (embeddings and head)."""
    momentum: float = 0.0
    """SGD momentum."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables."""
    muon_lr: float = 0.02
    """muon: peak learning rate of the hidden matrices (same warmup and decay as lr)."""
    muon_momentum: float = 0.95
    """muon: momentum of the hidden matrices."""
    muon_nesterov: bool = True
    """muon: Nesterov momentum on the hidden matrices."""
    muon_weight_decay: float = 0.0
    """muon: decoupled weight decay of the hidden matrices (our default; the paper's is
    not known)."""
    nadam_momentum_decay: float = 0.004
    """nadamw: torch NAdam's momentum_decay ψ (μ_t = β1 (1 - 0.5 · 0.96^(tψ)))."""
    delay: int = 0
    """0 = synchronous; 1 = one-step gradient delay (PipeDream-2BW's rule W(t+1) = W(t) -
    opt(grad f(W(t-1)))) emulated on any single-replica or data-parallel run."""
    delay_correction: Literal["none", "ef", "predict"] = "none"
    """Correction of a delayed update (optim.delay 1, or pipedream-2bw's strategy.delay 1):
    none; ef = error feedback on the optimizer's update, u + ef_lambda (u - u_prev); predict
    = the gradient taken at the extrapolated weights W + u_prev (SpecTrain/PipeMare). Both
    are RECONSTRUCTIONS (docs/algorithms.md)."""
    ef_lambda: float = 1.0
    """Weight λ of the error-feedback correction (reconstruction; 0 = plain delay)."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optim.name must be one of {list(OPTIMIZERS)}, got {self.name!r}")
        if self.delay not in (0, 1) or isinstance(self.delay, bool):
            raise ValueError(f"optim.delay must be 0 (synchronous) or 1 (one-step delay), "
                             f"got {self.delay!r}")
        if self.delay_correction not in CORRECTIONS:
            raise ValueError(f"optim.delay_correction must be one of {list(CORRECTIONS)}, "
                             f"got {self.delay_correction!r}")
        if self.muon_lr <= 0:
            raise ValueError(f"optim.muon_lr must be > 0, got {self.muon_lr!r}")
        if not 0 <= self.muon_momentum < 1:
            raise ValueError(f"optim.muon_momentum must be in [0, 1), got "
                             f"{self.muon_momentum!r}")
        for key in ("muon_weight_decay", "nadam_momentum_decay"):
            if getattr(self, key) < 0:
                raise ValueError(f"optim.{key} must be >= 0, got {getattr(self, key)!r}")
        if not 0 <= self.ef_lambda <= MAX_EF_LAMBDA:
            raise ValueError(f"optim.ef_lambda must be in [0, {MAX_EF_LAMBDA:g}] (0 = plain "
                             f"delay, 1 = the update extrapolated by its last change), got "
                             f"{self.ef_lambda!r}")


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
    """Checkpoint every this many steps (for --resume); null = run.steps // 4; a stop
    signal saves one more where it stops (bench/stop.py); 0 = never, not even then."""
    final: bool = True
    """Save the evaluation model at the end (needed by `commbench eval`)."""
    timeout_s: float = 1800.0
    """Seconds the ranks wait for each other around checkpoint writes and loads (their own
    group: a multi-GB state can take longer than parallel.timeout_s, which is meant to
    catch a hung training collective quickly)."""


@dataclass
class LaunchConfig:
    nnodes: int = 1
    """Nodes for multi-node torchrun (each runs world_size / nnodes ranks)."""
    rdzv_endpoint: str | None = None
    """host:port of the c10d rendezvous for multi-node runs."""
    rdzv_timeout_s: float = 600.0
    """Seconds to wait for the rendezvous (every node joined; one node: torchrun's ranks
    started) before the run fails saying so (bench/torchrun.py)."""
    torchrun_args: list[str] = field(default_factory=list)
    """Extra arguments passed through to torchrun (not those commbench sets from the
    config: --nproc-per-node, --nnodes, --standalone, --rdzv-*, --node-rank)."""
    cuda_visible_devices: str | None = None
    """GPUs this run's ranks use on each node (CUDA_VISIBLE_DEVICES, e.g. "2,3"); null =
    the environment's. A local sweep running several runs at once gives each its own."""


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
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


# Not the run's identity: where things go, the checkpoint cadence (resume is bit-exact),
# and the tracking sinks (views of the records, written by the launcher: bench/tracking/).
NON_IDENTITY_KEYS = ("run.output_dir", "run.warmup_steps", "run.compute_clock",
                     "data.cache_dir", "launch",
                     "checkpoint", "tracking")


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
    _check_retired_keys(data)
    config = from_mapping(Config, data, "")
    validate(config)
    return config


def _check_retired_keys(data: dict) -> None:
    """Keys that were replaced: fail saying by what, and the value that means the same."""
    run = data.get("run")
    if isinstance(run, dict) and "val_batches" in run:
        batches = run["val_batches"]
        batch_size = (data.get("data") or {}).get("batch_size", DataConfig.batch_size)
        same = (f"run.val_sequences: {batches * batch_size} (val_batches {batches} x "
                f"data.batch_size {batch_size})"
                if isinstance(batches, int) and isinstance(batch_size, int) else
                "run.val_sequences: val_batches x data.batch_size")
        raise ValueError(
            f"run.val_batches ({batches!r}) was replaced by run.val_sequences, a number of "
            "validation windows that is the same for every batch size and layout, so that "
            f"validation losses compare; as many windows as before: {same} (spread over "
            "the whole validation split, where val_batches took its first windows)")


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


MAX_SEED = 2**63 - 1
"""The largest run.seed: torch.manual_seed takes a 64-bit integer, numpy's generator a
non-negative one."""


def check_rendezvous(launch: LaunchConfig, required: bool = False) -> None:
    """launch.rdzv_endpoint: host:port when given (refused here, not by torchrun on every
    node after the launch); `required` (a run started by hand, `preflight`): given when
    launch.nnodes > 1 (a Slurm job fills a null one with its first node: bench/jobentry.py)."""
    endpoint = launch.rdzv_endpoint
    if endpoint is None:
        if required and launch.nnodes > 1:
            raise ValueError(f"launch.rdzv_endpoint must be host:port (rank 0's node, e.g. "
                             f"node1:29500) when launch.nnodes > 1, got None (launch.nnodes "
                             f"{launch.nnodes})")
        return
    host, _, port = str(endpoint).rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # [::1]:29500
    if not host or any(c.isspace() or c in "/@?#" for c in host) or not port.isdigit() \
            or not 1 <= int(port) <= 65535:
        raise _fail("launch.rdzv_endpoint", endpoint,
                    "host:port with a port from 1 to 65535 (e.g. node1:29500, 10.0.0.1:29500, "
                    "[::1]:29500)")


def validate(cfg: Config) -> None:
    """Checks that need more than one field's type: ranges, tables, cross-section rules."""
    from bench.data import expand_path, resolve_corpus
    from bench.model import config_of
    from bench.network import PROFILES, get_profile, is_profile_path
    from bench.torchrun import check_extra_args

    check_name("run.name", cfg.run.name, "the run directory")
    for key in ("run.steps", "run.log_every", "run.val_sequences", "model.seq_len",
                "data.batch_size", "parallel.world_size", "parallel.group_size",
                "parallel.num_stages", "parallel.num_microbatches", "parallel.timeout_s",
                "checkpoint.timeout_s", "launch.rdzv_timeout_s",
                "launch.nnodes", "eval.batch_size", "eval.limit"):  # None passes
        section, name = key.split(".")
        _at_least(key, getattr(getattr(cfg, section), name))
    for key in ("run.val_every", "run.warmup_steps", "optim.warmup_steps", "optim.grad_clip",
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
    fragments = getattr(cfg.strategy, "fragments", 1)  # Streaming DiLoCo's, over the blocks
    if fragments > blocks:
        raise ValueError(f"strategy.fragments ({fragments}) must be <= the model's number of "
                         f"blocks ({blocks}): a fragment is a set of blocks")
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
    check_rendezvous(cfg.launch)
    if not 0 <= cfg.run.seed <= MAX_SEED:  # torch.manual_seed and numpy's generator take it
        raise _fail("run.seed", cfg.run.seed, f"an integer from 0 to {MAX_SEED} (2**63 - 1)")
    if cfg.data.batch_size % cfg.parallel.num_microbatches:
        raise ValueError(
            f"parallel.num_microbatches ({cfg.parallel.num_microbatches}) must divide "
            f"data.batch_size ({cfg.data.batch_size})"
        )
    if cfg.parallel.backend == "nccl" and cfg.parallel.device == "cpu":
        raise ValueError("parallel.backend 'nccl' needs parallel.device cuda (or auto on a "
                         "GPU machine); with parallel.device cpu use backend gloo or auto")
    if cfg.parallel.backend == "gloo" and cfg.parallel.device == "cuda":
        raise ValueError(_GLOO_ON_CUDA.format(device="cuda"))
    if cfg.eval.suite is not None and cfg.eval.suite not in ("smoke", "paper"):
        raise _fail("eval.suite", cfg.eval.suite, "null, 'smoke' or 'paper'")
    if cfg.eval.tasks and cfg.eval.suite is None:
        raise ValueError(f"eval.tasks {cfg.eval.tasks} needs eval.suite (smoke or paper)")
    if cfg.parallel.shard == "fsdp":
        _check_sharded(cfg)
    cfg.data.corpus = resolve_corpus(cfg.data.corpus)  # relative: from here, at config time
    expand_path(cfg.data.cache_dir, "data.cache_dir")
    check_tracking(cfg.tracking)
    check_extra_args(cfg.launch.torchrun_args)
    check_straggler(cfg.run.straggler, cfg.parallel.world_size)
    cfg.strategy.check(cfg)  # the strategy's own cross-section rules (stages, world size, ...)
    if cfg.optim.delay_correction != "none" and cfg.strategy.update_delay(cfg) == 0:
        raise ValueError(f"optim.delay_correction={cfg.optim.delay_correction!r} corrects a "
                         f"delayed update, but strategy {cfg.strategy.name!r} with "
                         f"optim.delay=0 delays nothing: set optim.delay=1 (the emulation), "
                         "or use pipedream-2bw with strategy.delay=1")


_GLOO_ON_CUDA = (
    "parallel.backend 'gloo' with parallel.device {device} (CUDA tensors): gloo cannot send "
    "or receive CUDA tensors (pipelines, gossip) and stages CUDA collectives through host "
    "memory, so its times describe neither a GPU cluster's NCCL nor gloo on CPUs; use "
    "parallel.backend nccl (or auto) on GPUs, or parallel.device cpu with gloo "
    "(network.emulate models slower links)")


def runs_on_cuda(cfg: Config) -> bool:
    """Whether the config's ranks use CUDA on this machine (device cuda, or auto with one)."""
    import torch

    return cfg.parallel.device == "cuda" or (cfg.parallel.device == "auto"
                                             and torch.cuda.is_available())


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
    """Fail unless this machine has the device and backend the config asks for, and a GPU
    for each of the ranks a node starts."""
    import torch

    has_cuda = torch.cuda.is_available()
    if cfg.parallel.device == "cuda" and not has_cuda:
        raise _fail("parallel.device", "cuda", "auto or cpu on this machine (it has no CUDA "
                    "device)")
    on_cuda = runs_on_cuda(cfg)
    if cfg.parallel.backend == "nccl" and not on_cuda:
        raise _fail("parallel.backend", "nccl", "auto or gloo on this machine (nccl needs a "
                    "CUDA device)")
    if cfg.parallel.backend == "gloo" and on_cuda:
        raise ValueError(_GLOO_ON_CUDA.format(device=f"{cfg.parallel.device} (CUDA here)"))
    check_gpus(cfg)


def check_gpus(cfg: Config) -> None:
    """On CUDA, each rank of a node takes its own GPU (LOCAL_RANK): fail unless this node
    has as many GPUs (visible ones: launch.cuda_visible_devices, else the environment's)
    as parallel.world_size / launch.nnodes. Called where torchrun starts (each node)."""
    import torch

    if not runs_on_cuda(cfg):
        return
    per_node = cfg.parallel.world_size // cfg.launch.nnodes
    visible = cfg.launch.cuda_visible_devices
    count = len(visible.split(",")) if visible else torch.cuda.device_count()
    where = f"launch.cuda_visible_devices {visible!r}" if visible else "this node"
    if per_node > count:
        raise ValueError(
            f"parallel.world_size {cfg.parallel.world_size} / launch.nnodes "
            f"{cfg.launch.nnodes} = {per_node} ranks per node, one GPU each, but {where} has "
            f"{count} GPU{'s' if count != 1 else ''}: lower parallel.world_size, raise "
            "launch.nnodes, or give the ranks more GPUs (several ranks on one GPU would "
            "share it, and their times would not be a cluster's)")


def preflight(cfg: Config) -> None:
    """Checks against the machine that will train the run, before anything is launched:
    the device and backend exist here, each rank's memory plan fits the device
    (bench/memory.py), and the corpus has enough tokens for a window of training data and
    for run.val_sequences windows of validation data (tokenising it into the cache if
    needed)."""
    from bench.data import check_corpus_size
    from bench.memory import check_fits

    check_rendezvous(cfg.launch, required=True)
    check_device(cfg)
    check_packages(cfg)
    check_fits(cfg)
    check_corpus_size(cfg.data.corpus, cfg.data.tokenizer, cfg.data.cache_dir,
                      cfg.data.val_fraction, cfg.model.seq_len, cfg.run.val_sequences)


def check_packages(cfg: Config) -> None:
    """The packages the run's engine imports lazily (inside its ranks) are installed here:
    without them every rank would fail after launch."""
    import importlib.util

    if (getattr(cfg.strategy, "backend", None) == "deepspeed"
            and importlib.util.find_spec("deepspeed") is None):
        raise _fail("strategy.backend", "deepspeed",
                    "an installed engine: DeepSpeed is not installed here (pip install "
                    "deepspeed, or commbench's '.[deepspeed]' extra), or strategy.backend=torch")


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
