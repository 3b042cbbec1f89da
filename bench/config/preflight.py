"""Preflight: the checks of a run config against the machine that will train it.

    commbench run configs/ddp-tiny.yaml   (preflight runs before anything is launched)

`preflight(cfg)` runs on the node that starts the run, after validation
(bench/config/checks.py) and before any process starts: the device and backend exist
here, a GPU per rank of the node (`check_gpus`, again where torchrun starts), the lazily
imported engines are installed, each rank's memory plan fits (bench/memory.py) and the
corpus has enough tokens. `check_output_dir`: the output directory is writable.
"""

from __future__ import annotations

import os
from pathlib import Path

from bench.config.checks import GLOO_ON_CUDA, check_rendezvous
from bench.config.schema import Config
from bench.config.typed import fail as _fail


def runs_on_cuda(cfg: Config) -> bool:
    """Whether the config's ranks use CUDA on this machine (device cuda, or auto with one)."""
    import torch

    return cfg.parallel.device == "cuda" or (cfg.parallel.device == "auto"
                                             and torch.cuda.is_available())


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
        raise ValueError(GLOO_ON_CUDA.format(device=f"{cfg.parallel.device} (CUDA here)"))
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


