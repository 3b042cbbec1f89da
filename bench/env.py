"""A rank's environment: the machine and code it runs on, and what the launcher asks of it.

Used by every rank of `commbench run` (bench/run/train.py):
- `capture_env` is env.json: the git commit and a hash of the uncommitted diff (the
  code's identity), package versions, host, CPU/GPU, world size and backend;
- `resolve_device` turns parallel.device/backend `auto` into this rank's device and
  backend; `peak_flops` is a known GPU's dense peak for the run's precision (for MFU);
- `fault_injection` reads COMMBENCH_FAULT, which makes one rank fail on purpose;
- `StragglerConfig` (the config's `run.straggler`) makes one rank slow on purpose.
"""

from __future__ import annotations

import hashlib
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from bench.config.schema import Config, StragglerConfig


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


def cores_available() -> int:
    """CPU cores this process may run on (its affinity mask: a Slurm job's or a cgroup's
    share, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks (macOS)
        return os.cpu_count() or 1


def share_cores(local_ranks: int) -> int:
    """Give this rank its share of the node's cores as torch's intra-op threads, on every
    device, and return it. CPU ranks compute with them; GPU ranks need them for host work
    (DiLoCo's offloaded outer step, checkpoints), and torchrun starts every rank with
    OMP_NUM_THREADS=1 when a node runs more than one, which would leave that on one core."""
    threads = max(1, cores_available() // max(1, local_ranks))
    torch.set_num_threads(threads)
    return threads


def ranks_per_core(local_ranks: int, device: torch.device) -> float | None:
    """This node's ranks per CPU core they may use, on CPU devices (None on a GPU, where
    ranks compute on their own devices): above 1, ranks wait for cores, which wall
    time counts (bench/run/meter.py, Compute clock)."""
    return local_ranks / cores_available() if device.type == "cpu" else None


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


FAULT_MODES = ("crash", "hang", "stop", "kill", "nan", "exit", "sigterm")


def fault_injection(rank: int) -> tuple[int, str] | None:
    """COMMBENCH_FAULT="RANK:STEP:MODE" makes rank RANK fail on purpose before step STEP.

    Modes: crash (raises), hang (sleeps forever: the others time out in their next
    collective after `parallel.timeout_s`), stop (SIGSTOP to itself: frozen, as by a
    debugger or a stuck driver), kill (SIGKILL to itself, like the OOM killer),
    nan (its parameters become NaN: its loss is the first non-finite one), exit (the run
    completes, then the rank aborts in teardown, as a library's exit path can; STEP is
    ignored), sigterm (SIGTERM to itself, as a scheduler's preemption reaching one rank
    first: the ranks agree on a step boundary, checkpoint there and stop, bench/run/stop.py).
    Used by
    tests/test_crash_safety.py (and handy on a cluster) to check that the run ends with
    the right status and names the culprit rank, within the process-group timeout.
    """
    spec = os.environ.get("COMMBENCH_FAULT")
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) != 3 or not (parts[0].isdigit() and parts[1].isdigit()) or \
            parts[2] not in FAULT_MODES:
        raise ValueError(f"COMMBENCH_FAULT must be RANK:STEP:MODE with MODE one of "
                         f"{list(FAULT_MODES)}, got {spec!r}")
    return (int(parts[1]), parts[2]) if int(parts[0]) == rank else None


def inject_fault(mode: str, rank: int, step: int, model: torch.nn.Module) -> None:
    """Make this rank fail as `mode` says (see `fault_injection`; `exit` acts in teardown)."""
    if mode == "exit":
        return
    if mode == "sigterm":  # its handler asks for a stop (bench/run/stop.py); the step goes on
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if mode == "hang":
        time.sleep(10**6)
    if mode in ("stop", "kill"):
        os.kill(os.getpid(), signal.SIGSTOP if mode == "stop" else signal.SIGKILL)
        time.sleep(10**6)  # SIGSTOP: frozen here until torchrun kills it
    if mode == "nan":
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        return
    raise RuntimeError(f"injected fault on rank {rank} at step {step} (COMMBENCH_FAULT)")


def straggle(straggler: StragglerConfig, rank: int, step_s: float) -> float:
    """Sleep (slowdown - 1) x step_s on the straggler rank; the seconds slept (0 elsewhere)."""
    if straggler.rank != rank or straggler.slowdown <= 1:
        return 0.0
    extra = (straggler.slowdown - 1) * step_s
    time.sleep(extra)
    return extra


PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12},
    "H100 PCIe": {"fp32": 51e12, "tf32": 378e12, "bf16": 756.5e12},
    "H100 NVL": {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12},
    "H200 SXM": {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12},
    "H200 NVL": {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12},
    "GH200": {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12},
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12},
}
"""Dense peak FLOP/s per GPU model and math mode (NVIDIA's datasheets; their tensor-core
figures "with sparsity" halved). fp32 is the CUDA-core rate: torch runs fp32 matmuls
without TF32 unless `torch.backends.cuda.matmul.allow_tf32` is set."""


def gpu_model(device_name: str) -> str | None:
    """The `PEAK_FLOPS` key of a CUDA device name (`torch.cuda.get_device_name`), or None
    when the name does not tell the part apart: an H100 without SXM/HBM3, PCIe or NVL in
    its name gets no peak rather than a wrong one."""
    name = device_name.upper()
    if "GH200" in name:
        return "GH200"
    for family in ("H200", "H100"):
        if family in name:
            if "NVL" in name:
                return f"{family} NVL"
            if "PCIE" in name:
                return f"{family} PCIe"
            if "SXM" in name or "HBM3" in name or family == "H200":  # H200: SXM unless NVL
                return f"{family} SXM"
            return None
    return "A100" if "A100" in name else None


def peak_flops_of(device_name: str, precision: str, tf32: bool = False) -> float | None:
    """Dense peak FLOP/s of a GPU named `device_name` for `model.precision` (bf16, or fp32:
    the TF32 tensor-core rate when `tf32` matmuls are allowed); None when unknown."""
    model = gpu_model(device_name)
    if model is None:
        return None
    mode = "bf16" if precision == "bf16" else ("tf32" if tf32 else "fp32")
    return PEAK_FLOPS[model][mode]


def peak_flops(device: torch.device, precision: str) -> float | None:
    """This rank's GPU's dense peak for `precision` (for MFU); None on CPU or when unknown."""
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device), precision,
                         tf32=torch.backends.cuda.matmul.allow_tf32)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so host timers measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
