"""A rank's environment: the machine and code it runs on, and what the launcher asks of it.

Used by every rank of `commbench run` (bench/train.py):
- `capture_env` is env.json: the git commit and a hash of the uncommitted diff (the
  code's identity), package versions, host, CPU/GPU, world size and backend;
- `resolve_device` turns parallel.device/backend `auto` into this rank's device and
  backend; `peak_flops` is a known GPU's dense bf16 peak (for MFU);
- `fault_injection` reads COMMBENCH_FAULT, which makes one rank fail on purpose.
"""

from __future__ import annotations

import hashlib
import os
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from bench.config import Config


def git_identity(repo: Path) -> dict:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, timeout=10, check=True
        ).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        diff = git("diff", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, "diff_sha256": None}
    return {
        "commit": commit,
        "dirty": bool(diff),
        "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
    }


PACKAGES = ("torch", "numpy", "deepspeed", "lm_eval", "tiktoken", "pandas", "commbench")


def capture_env(world_size: int, backend: str, device: str) -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "git": git_identity(Path(__file__).resolve().parent.parent),
        "packages": versions,
        "python": sys.version.split()[0],
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "gpus": gpus,
        "cuda": torch.version.cuda,
        "world_size": world_size,
        "backend": backend,
        "device": device,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def resolve_device(cfg: Config) -> tuple[torch.device, str]:
    """(this rank's device, its process-group backend); `auto` picks CUDA and NCCL if present."""
    want = cfg.parallel.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("parallel.device is 'cuda' but no CUDA device is available")
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    return device, backend


def fault_injection(rank: int) -> tuple[int, str] | None:
    """COMMBENCH_FAULT="RANK:STEP:crash|hang" makes one rank fail on purpose.

    Used by the tests (and handy on a cluster) to check that a dead or stuck rank ends
    the run with status failed and its error text, within the process-group timeout.
    """
    spec = os.environ.get("COMMBENCH_FAULT")
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) != 3 or not (parts[0].isdigit() and parts[1].isdigit()) or \
            parts[2] not in ("crash", "hang"):
        raise ValueError(f"COMMBENCH_FAULT must be RANK:STEP:crash|hang, got {spec!r}")
    return (int(parts[1]), parts[2]) if int(parts[0]) == rank else None


def inject_fault(mode: str, rank: int, step: int) -> None:
    if mode == "hang":
        time.sleep(10**6)
    raise RuntimeError(f"injected fault on rank {rank} at step {step} (COMMBENCH_FAULT)")


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of known GPUs (for MFU); None when unknown."""
    name = torch.cuda.get_device_name(device)
    for key, flops in {"H200": 989e12, "H100": 989e12, "A100": 312e12, "GH200": 989e12}.items():
        if key in name:
            return flops
    return None


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so host timers measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
