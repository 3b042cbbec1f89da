"""Config validation: the checks of a run config that need more than one field's type.

    pytest tests/test_config.py tests/test_bad_input.py

`validate(cfg)` runs when a config is read (bench/config/__init__.py `from_dict`), before any
process starts: ranges, tables, cross-section rules, ending with the strategy's own
`cfg.strategy.check(cfg)`. Each failure names the key path, the value and what is valid.
Checks against the machine that will train (device, GPUs, memory, corpus size) are
bench/config/preflight.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from bench.config.schema import Config, LaunchConfig, StragglerConfig, TrackingConfig
from bench.config.typed import check_name
from bench.config.typed import fail as _fail


def check_straggler(straggler: StragglerConfig, world_size: int) -> None:
    """Fail naming run.straggler.* unless the rank exists and slowdown >= 1."""
    if straggler.rank is not None and not 0 <= straggler.rank < world_size:
        raise ValueError(f"run.straggler.rank must be null or a rank in [0, {world_size}) "
                         f"(parallel.world_size {world_size}), got {straggler.rank!r}")
    if not (math.isfinite(straggler.slowdown) and straggler.slowdown >= 1):
        raise ValueError(f"run.straggler.slowdown must be a finite number >= 1, got "
                         f"{straggler.slowdown!r}")


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
    launch.nnodes > 1 (a Slurm job fills a null one with its first node:
    bench/launch/jobentry.py)."""
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


SET_BY_COMMBENCH = {
    "--nproc-per-node": "parallel.world_size / launch.nnodes", "--nnodes": "launch.nnodes",
    "--standalone": "launch.nnodes: 1 without launch.rdzv_endpoint",
    "--rdzv": "launch.rdzv_endpoint, launch.rdzv_timeout_s", "--node-rank": "the rendezvous",
    "--master-addr": "the rendezvous", "--master-port": "the rendezvous",
    "--no-python": "commbench (it runs -m bench.run.train)",
    "--run-path": "commbench (it runs -m bench.run.train)", "-m": "commbench (-m bench.run.train)",
    "--module": "commbench (-m bench.run.train)",
}
"""torchrun options commbench sets itself (bench/launch/torchrun.py `command`), and the config keys
they come from: checked here, when the config is read, so config never imports launch."""


def check_extra_args(args: Sequence[str], key: str = "launch.torchrun_args") -> None:
    """ValueError naming `key`, the argument and the config key behind it when `args`
    holds an option commbench sets (a contradicting --nproc-per-node would start another
    number of ranks than parallel.world_size under the same config hash)."""
    for i, arg in enumerate(args):
        option = arg.split("=", 1)[0].replace("_", "-")
        for reserved, source in SET_BY_COMMBENCH.items():
            if option == reserved or (reserved == "--rdzv" and option.startswith("--rdzv")):
                raise ValueError(
                    f"{key}[{i}] {arg!r}: commbench sets {reserved} itself, from {source}; "
                    "valid: other torchrun options (e.g. --max-restarts=0, --log-dir=DIR)")


def check_tracking(cfg: TrackingConfig, path: str = "tracking") -> None:
    """Ranges and names (ValueError naming the key); whether a package is installed is not
    checked here: a missing one drops its sink with a warning when the run starts."""
    for key in ("poll_s", "timeout_s"):
        if getattr(cfg, key) <= 0:
            raise _fail(f"{path}.{key}", getattr(cfg, key), "> 0 seconds")
    if cfg.tensorboard is not None and not cfg.tensorboard.dir.strip():
        raise _fail(f"{path}.tensorboard.dir", cfg.tensorboard.dir, "a directory path")
    if cfg.wandb is not None and not cfg.wandb.project.strip():
        raise _fail(f"{path}.wandb.project", cfg.wandb.project, "a W&B project name")
    if cfg.mlflow is not None and not cfg.mlflow.experiment.strip():
        raise _fail(f"{path}.mlflow.experiment", cfg.mlflow.experiment,
                    "an MLflow experiment name")


def validate(cfg: Config) -> None:
    """Checks that need more than one field's type: ranges, tables, cross-section rules."""
    from bench.data import expand_path, resolve_corpus
    from bench.model import config_of
    from bench.network import PROFILES, get_profile, is_profile_path

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
        raise ValueError(GLOO_ON_CUDA.format(device="cuda"))
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
    check_delay_profile(cfg, blocks)
    cfg.strategy.check(cfg)  # the strategy's own cross-section rules (stages, world size, ...)
    if cfg.optim.delay_correction != "none" and cfg.strategy.update_delay(cfg) == 0:
        raise ValueError(f"optim.delay_correction={cfg.optim.delay_correction!r} corrects a "
                         f"delayed update, but strategy {cfg.strategy.name!r} with "
                         f"optim.delay=0 delays nothing: set optim.delay=1 (the emulation), "
                         "or use pipedream-2bw with strategy.delay=1")


def check_delay_profile(cfg: Config, blocks: int) -> None:
    """optim.delay_profile / optim.delay_stages (issue 47): the pipeline profile needs its
    stages (2 .. the model's `blocks`), the emulation on (optim.delay 1), no correction
    (defined for one step of delay), and an optimizer that sees the whole model
    (`model.as_layers()`): a data-parallel strategy on the torch backend."""
    o = cfg.optim
    if o.delay_profile == "uniform":
        if o.delay_stages is not None:
            raise ValueError(f"optim.delay_stages={o.delay_stages} is read only by "
                             "optim.delay_profile=pipeline, and the profile is 'uniform': "
                             "valid: optim.delay_stages null, or optim.delay_profile=pipeline")
        return
    if o.delay_stages is None:
        raise ValueError(f"optim.delay_profile=pipeline needs optim.delay_stages (the virtual "
                         f"stages P), got None; valid: an integer from 2 to the model's "
                         f"number of blocks ({blocks})")
    if not 2 <= o.delay_stages <= blocks:
        raise _fail("optim.delay_stages", o.delay_stages,
                    f"an integer from 2 to the model's number of blocks ({blocks}): every "
                    "virtual stage holds at least one block")
    if o.delay == 0:
        raise ValueError("optim.delay_profile=pipeline delays stage s by optim.delay x "
                         "(P - 1 - s) steps, but optim.delay is 0 (nothing delayed); valid: "
                         "optim.delay=1, or optim.delay_profile=uniform")
    if o.delay_correction != "none":
        raise ValueError(f"optim.delay_correction={o.delay_correction!r} is defined for one "
                         f"step of delay, but optim.delay_profile=pipeline delays the stages "
                         f"by 0 to {o.delay * (o.delay_stages - 1)} steps; valid: "
                         "optim.delay_correction=none, or optim.delay_profile=uniform")
    from algorithms.base import DataParallelStrategy, strategy_of

    if not issubclass(strategy_of(cfg), DataParallelStrategy):
        raise ValueError(f"optim.delay_profile=pipeline cuts the whole model "
                         f"(model.as_layers()) into virtual stages, but strategy "
                         f"{cfg.strategy.name!r} gives each rank's optimizer one stage of a "
                         "real pipeline; valid: a data-parallel strategy (ddp, diloco, ...), "
                         "or optim.delay_profile=uniform")
    if getattr(cfg.strategy, "backend", "torch") == "deepspeed":
        raise ValueError("optim.delay_profile=pipeline with strategy.backend=deepspeed: the "
                         "engine steps its own optimizer (no delay wrapper sees the model's "
                         "layers); valid: strategy.backend=torch, or optim.delay_profile="
                         "uniform")


GLOO_ON_CUDA = (
    "parallel.backend 'gloo' with parallel.device {device} (CUDA tensors): gloo cannot send "
    "or receive CUDA tensors (pipelines, gossip) and stages CUDA collectives through host "
    "memory, so its times describe neither a GPU cluster's NCCL nor gloo on CPUs; use "
    "parallel.backend nccl (or auto) on GPUs, or parallel.device cpu with gloo "
    "(network.emulate models slower links)")


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


