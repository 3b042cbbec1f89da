"""The commbench config schema: one dataclass per section of a run config, and `Config`.

    commbench config show configs/ddp-tiny.yaml

Pure data: fields, defaults and the checks of one field (`__post_init__`). Every field is
documented by the string literal under it; that text is the field's `--help` and the
comment `commbench config show` prints. The `strategy:` section is parsed into the
registered strategy's own config class (`StrategyConfig` subclasses, algorithms/).
Reading, overrides and identity: bench/config/__init__.py; checks across fields:
bench/config/checks.py; checks against the machine: bench/config/preflight.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from algorithms.base import STRATEGIES, config_class
from algorithms.contract import StrategyConfig
from algorithms.delay import CORRECTIONS, DELAY_PROFILES
from bench.config.typed import fail as _fail
from bench.config.typed import from_mapping


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
    same data; scored as the exact mean over all their positions (bench/data/batches.py
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
    """What a rank's compute is measured on (bench/run/meter.py, Compute clock). auto: its own
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
    delay_profile: Literal["uniform", "pipeline"] = "uniform"
    """How the optim.delay emulation delays each parameter: uniform (every parameter by
    optim.delay steps); pipeline (an asynchronous pipeline's staleness: model.as_layers(),
    [embedding, blocks..., head], cut by block count into optim.delay_stages = P virtual
    stages, stage s delayed by optim.delay x (P - 1 - s) steps, the head's stage by none;
    a tied embedding/head weight takes the first stage's delay). pipeline: data-parallel
    strategies with strategy.backend torch, no delay correction (docs/algorithms.md)."""
    delay_stages: int | None = None
    """optim.delay_profile pipeline: the number P of virtual stages, from 2 to the model's
    number of blocks; null with the uniform profile."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optim.name must be one of {list(OPTIMIZERS)}, got {self.name!r}")
        if self.delay not in (0, 1) or isinstance(self.delay, bool):
            raise ValueError(f"optim.delay must be 0 (synchronous) or 1 (one-step delay), "
                             f"got {self.delay!r}")
        if self.delay_correction not in CORRECTIONS:
            raise ValueError(f"optim.delay_correction must be one of {list(CORRECTIONS)}, "
                             f"got {self.delay_correction!r}")
        if self.delay_profile not in DELAY_PROFILES:
            raise ValueError(f"optim.delay_profile must be one of {list(DELAY_PROFILES)}, "
                             f"got {self.delay_profile!r}")
        stages = self.delay_stages
        if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int)
                                   or stages < 2):
            raise ValueError(f"optim.delay_stages must be null or an integer from 2 to the "
                             f"model's number of blocks (the virtual pipeline's stages), "
                             f"got {stages!r}")
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
    signal saves one more where it stops (bench/run/stop.py); 0 = never, not even then."""
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
    started) before the run fails saying so (bench/launch/torchrun.py)."""
    torchrun_args: list[str] = field(default_factory=list)
    """Extra arguments passed through to torchrun (not those commbench sets from the
    config: --nproc-per-node, --nnodes, --standalone, --rdzv-*, --node-rank)."""
    cuda_visible_devices: str | None = None
    """GPUs this run's ranks use on each node (CUDA_VISIBLE_DEVICES, e.g. "2,3"); null =
    the environment's. A local sweep running several runs at once gives each its own."""


# ------------------------------------------------- tracking: (its sinks: bench/study/tracking/)


@dataclass
class TensorBoardConfig:
    dir: str = "tb"
    """Directory of the event files: each run writes DIR/RUN (DIR/SWEEP/RUN in a sweep);
    `tensorboard --logdir DIR` shows them."""


@dataclass
class WandbConfig:
    project: str = "commbench"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); null = the logged-in user's default."""
    mode: Literal["online", "offline"] = "online"
    """online uploads as it goes (if W&B's server cannot be reached within 5 s, the run is
    written offline instead, with a warning); offline writes local files to upload later
    with `wandb sync DIR/wandb/offline-run-*`."""
    group: str | None = None
    """W&B group; null = the sweep's name (no group for a run outside a sweep)."""
    tags: list[str] = field(default_factory=list)
    """Tags added to each run (the strategy's name is always one)."""
    dir: str | None = None
    """Where W&B keeps its local files (DIR/wandb/); null = W&B's default (WANDB_DIR or the
    working directory)."""


@dataclass
class MlflowConfig:
    tracking_uri: str | None = None
    """MLflow tracking URI (http://host:5000, sqlite:///mlflow.db, a directory); null =
    MLFLOW_TRACKING_URI, else the local file store ./mlruns (allowed with
    MLFLOW_ALLOW_FILE_STORE, which commbench sets for a file store)."""
    experiment: str = "commbench"
    """MLflow experiment (created when missing)."""


@dataclass
class TrackingConfig:
    """Where the run is shown besides its records; none by default.

    Not part of the run's identity (bench.config NON_IDENTITY_KEYS): a sink only reads the
    records, from the launcher, after the rows are written; it never enters the training
    processes, so it cannot change what is trained or measured, nor meet a strategy (no
    combination with a strategy, optimizer or network option to refuse or to test). A run
    resumed with other sinks is the same run."""

    tensorboard: TensorBoardConfig | None = None
    """Event files for TensorBoard, e.g. {dir: tb} (needs the tensorboard package)."""
    wandb: WandbConfig | None = None
    """A W&B run per run: {project, entity, mode: online|offline, group, tags, dir}
    (needs wandb)."""
    mlflow: MlflowConfig | None = None
    """An MLflow run per run: {tracking_uri, experiment} (needs mlflow-skinny or mlflow)."""
    poll_s: float = 5.0
    """Seconds between the launcher's reads of new metrics rows (how live the curves are)."""
    timeout_s: float = 60.0
    """Seconds the sinks get to finish after the run (and its evaluation) ended; a sink
    still busy then is left behind with a warning (the records are complete)."""

    def sinks(self) -> dict[str, object]:
        """The configured sinks' configs by sink name."""
        return {name: spec for name in SINK_NAMES
                if (spec := getattr(self, name)) is not None}


SINK_NAMES = ("tensorboard", "wandb", "mlflow")
SINK_CONFIGS = {"tensorboard": TensorBoardConfig, "wandb": WandbConfig, "mlflow": MlflowConfig}


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

