"""`commbench doctor`: the first command to run on a new GPU node or cluster.

    commbench doctor [--world-size N] [--out doctor-report.md] [--keep DIR] [--only NAMES]
    commbench doctor --nnodes N --node-rank R --rdzv-endpoint HOST:PORT   # on every node

Checks, one line each in a pass / fail / skip table (with the error's last line), written
to `--out` so it can be attached to a bug report:
- environment: torch, CUDA, NCCL and DeepSpeed versions, the GPUs;
- network interfaces: the variables that choose them, the host's, and warnings
  (bench/node/doctor_nodes.py);
- devices: one GPU per rank for `--world-size` ranks on this node;
- collectives: all_reduce, broadcast, all_gather, send/recv and a batched exchange on the
  run's backend (NCCL on GPUs, gloo on CPU), results checked, through torchrun; with
  `--nnodes N`, across the nodes, with the all-reduce's bus bandwidth (doctor_nodes.py);
- timing: CUDA-event time of a matmul loop against host time after a synchronise;
- bf16 autocast: a GPT forward under autocast gives bf16 activations;
- short runs through the real launcher (`bench.launch.run.run_config`, 2 ranks, a few steps of
  a tiny GPT): DDP, DDP sharded by FSDP2, DiLoCo, DiLoCo with an int8 outer exchange,
  streaming DiLoCo (2 fragments, fp4), GASLoC, a 2-stage pipeline (torch 1F1B),
  PipeDream-2BW, DeepSpeed ZeRO-1, and a checkpoint then `--resume`;
- compile with DDP: a compiled run whose first gradient bucket must be launched before
  the backward ends (bench/node/doctor_overlap.py).
On a machine without a GPU the CPU subset runs (gloo; compile and the timing check need a
GPU) and the table lists what was skipped and why. On a node with one GPU (or
`--world-size 1`) everything runs on one rank: NCCL's collectives at world size 1, the
runs of one replica, and what needs two ranks (point-to-point, GASLoC, the pipelines) is
skipped, saying so. Tested by `pytest tests/test_doctor.py`.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.node.doctor_nodes import check_interfaces, validate_nodes

PASS, FAIL, SKIP = "pass", "FAIL", "skip"


@dataclass
class Result:
    check: str
    status: str
    """pass, FAIL or skip."""
    detail: str = ""
    """What was seen (pass), the error's last line (FAIL) or why it did not run (skip)."""
    seconds: float = 0.0


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Context], str]
    """Returns the detail of a pass; raises on a failure; `Skip(reason)` to skip."""
    needs_gpu: str | None = None
    """Why the check needs a GPU (skipped without one), or None."""
    min_ranks: int = 1
    """Ranks the check needs (one GPU each); skipped where `--world-size` is smaller."""


class Skip(Exception):
    """A check that cannot run here (the reason is its message)."""


@dataclass
class Context:
    """What the checks share: the machine and where the short runs go."""

    world_size: int
    """Ranks on this node."""
    gpus: int
    work_dir: Path
    nnodes: int = 1
    node_rank: int = 0
    endpoint: str | None = None
    """torchrun's c10d rendezvous across nodes (HOST:PORT); None on one node."""

    @property
    def device(self) -> str:
        return "cuda" if self.gpus else "cpu"


# ---------------------------------------------------------------------------- checks


def check_environment(ctx: Context) -> str:
    import torch

    parts = [f"torch {torch.__version__}", f"python {platform.python_version()}"]
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(ctx.gpus)})
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        parts += [f"CUDA {torch.version.cuda}", f"NCCL {nccl}", f"{ctx.gpus} x {', '.join(names)}"]
    else:
        parts.append("no CUDA device")
    try:
        from importlib.metadata import version

        parts.append(f"deepspeed {version('deepspeed')}")
    except Exception:
        parts.append("deepspeed not installed")
    return "; ".join(parts)


def check_devices(ctx: Context) -> str:
    if ctx.world_size > ctx.gpus:
        raise RuntimeError(f"--world-size {ctx.world_size} ranks on this node, one GPU each, "
                           f"but it has {ctx.gpus} GPUs")
    return f"{ctx.world_size} ranks on {ctx.gpus} GPUs"


def check_collectives(ctx: Context) -> str:
    """The ranks' collectives and p2p through torchrun (doctor_nodes.py
    `collectives_worker`), on every node's ranks with `--nnodes`."""
    out = ctx.work_dir / "collectives.txt"
    return torchrun(ctx, ["bench.node.doctor_nodes", str(out)], out, across_nodes=True)


def torchrun(ctx: Context, program: list[str], out: Path, across_nodes: bool = False) -> str:
    """`program` (a module and its arguments) on this node's ranks through torchrun, or on
    every node's (`across_nodes` with `--nnodes`); the text it wrote to `out`, or a
    RuntimeError with its error line."""
    from bench.node.doctor_nodes import torchrun_args

    nodes = (ctx.nnodes, ctx.node_rank, ctx.endpoint) if across_nodes else (1, 0, None)
    cmd = [sys.executable, "-m", "torch.distributed.run",
           *torchrun_args(*nodes, ctx.world_size, os.environ), "-m", *program]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(_last_error(proc.stdout + proc.stderr))
    return out.read_text().strip()


def check_timing(ctx: Context) -> str:
    """CUDA events against host time around the same queued work (bench/run/meter.py times
    steps on the host after a synchronise; algorithms/ddp.py and the pipelines use events)."""
    import torch

    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(3):
        a @ a  # warm-up: cuBLAS handles, clocks
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = time.perf_counter()
    start.record()
    for _ in range(50):
        a @ a
    end.record()
    torch.cuda.synchronize()
    host_s, event_s = time.perf_counter() - host, start.elapsed_time(end) / 1e3
    if not 0.8 < event_s / host_s <= 1.05:
        raise RuntimeError(f"events {event_s * 1e3:.1f} ms vs host {host_s * 1e3:.1f} ms: "
                           "device timing disagrees with the host clock")
    return f"events {event_s * 1e3:.1f} ms, host {host_s * 1e3:.1f} ms"


def check_bf16(ctx: Context) -> str:
    import torch

    from bench.model import GPT, GPTConfig, autocast_context

    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, n_embd=32))
    model.to(ctx.device)
    seen = []
    model.head.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    x = torch.randint(0, 64, (2, 16), device=ctx.device)
    with autocast_context(ctx.device, "bf16"):
        _, loss = model(x, x)
    loss.backward()
    if seen != [torch.bfloat16] or not torch.isfinite(loss):
        raise RuntimeError(f"logits {seen}, loss {loss.item()}")
    return f"logits bf16 on {ctx.device}, loss {loss.item():.3f}"


RUN_SETTINGS = ["run.steps=3", "run.log_every=1", "run.val_every=0", "run.val_sequences=8",
                "model.n_layer=2", "model.seq_len=32", "data.batch_size=4",
                "network.profiles=[nvlink]", "checkpoint.final=false", "parallel.timeout_s=120"]
"""A few steps of a tiny GPT (on 2 ranks, or 1 where the node runs one): what every short
run shares."""

RUNS: dict[str, tuple[str, list[str], int]] = {
    "run ddp": ("configs/ddp-tiny.yaml", [], 1),
    "run ddp + fsdp": ("configs/ddp-tiny.yaml", ["parallel.shard=fsdp"], 2),
    "run diloco": ("configs/diloco-tiny.yaml", ["strategy.inner_steps=2"], 1),
    "run diloco int8 exchange": ("configs/diloco-tiny.yaml", [
        "strategy.inner_steps=2", "strategy.outer_compression=int8",
        "strategy.compression_row=16"], 1),
    "run streaming diloco (2 fragments, fp4)": ("configs/streaming-diloco-tiny.yaml", [
        "strategy.inner_steps=4", "run.steps=4"], 1),
    "run gasloc": ("configs/gasloc-tiny.yaml", ["strategy.inner_steps=2"], 2),
    "run pipeline 1f1b (2 stages)": ("configs/pipeline-1f1b-tiny.yaml",
                                     ["parallel.num_microbatches=2"], 2),
    "run pipedream-2bw (2 stages)": ("configs/2bw-tiny.yaml",
                                     ["parallel.num_microbatches=2"], 2),
    "run deepspeed zero-1": ("configs/ddp-tiny.yaml", ["strategy.backend=deepspeed",
                                                       "strategy.zero_stage=1"], 1),
}
"""name: (config, overrides, the ranks it needs: a gossip peer, two pipeline stages, two
shards)."""

ON_CUDA = {"run streaming diloco (2 fragments, fp4)": ["strategy.overlap_steps=0"]}
"""Overrides on GPUs: streaming DiLoCo's overlapped exchange is refused on CUDA for now
(configs/streaming-diloco-tiny.yaml, docs/algorithms.md); its fragments still run."""


def short_run(ctx: Context, name: str, config: str, overrides: list[str],
              resume_to: int | None = None) -> str:
    """Train `config` briefly through the launcher; the summary's key numbers (raises with
    the run's error headline when it fails)."""
    from bench.config import load_config
    from bench.launch.run import run_config

    settings = [*RUN_SETTINGS, f"parallel.world_size={min(2, ctx.world_size)}", *overrides,
                *(ON_CUDA.get(name, []) if ctx.gpus else []),
                f"run.name={_slug(name)}",
                f"run.output_dir={ctx.work_dir / 'runs'}",
                f"parallel.device={ctx.device}", "parallel.backend=auto"]
    cfg = load_config(_repo_path(config), settings)
    summary = run_config(cfg, progress=False)
    if resume_to is not None and summary["status"] == "ok":
        longer = load_config(_repo_path(config), [*settings, f"run.steps={resume_to}"])
        summary = run_config(longer, Path(summary["run_dir"]), progress=False, resume=True)
        saved = cfg.run.steps - 1 - (cfg.run.steps - 1) % cfg.checkpoint.every
        if summary.get("resumed_from_step") != saved:
            raise RuntimeError(f"resumed from step {summary.get('resumed_from_step')}, "
                               f"expected {saved}")
    if summary["status"] != "ok":
        raise RuntimeError(str(summary.get("error", summary["status"])).splitlines()[0])
    loss = summary.get("final_val_loss")
    return (f"{summary['steps']} steps, val loss {loss:.3f}, "
            f"{summary.get('throughput_tokens_per_s') or 0:,.0f} tok/s steady, "
            f"{(summary.get('comm_bytes_total') or 0) / 2**10:,.0f} KiB communicated")


def check_deepspeed_installed() -> None:
    try:
        import deepspeed  # noqa: F401
    except Exception as err:
        raise Skip(f"deepspeed not importable ({type(err).__name__})") from None


def run_check(name: str, config: str, overrides: list[str]) -> Callable[[Context], str]:
    def run(ctx: Context) -> str:
        if "deepspeed" in name:
            check_deepspeed_installed()
        return short_run(ctx, name, config, overrides)

    return run


OVERLAP_SETTINGS = ["run.steps=6", "run.warmup_steps=2", "run.log_every=1", "run.val_every=0",
                    "run.val_sequences=8", "model.n_layer=4", "model.n_embd=128",
                    "model.seq_len=32", "data.batch_size=4", "strategy.bucket_cap_mb=1",
                    "network.profiles=[nvlink]", "checkpoint.final=false",
                    "parallel.timeout_s=120", "parallel.backend=auto"]
"""DDP with 4 buckets a step (3.3 MB of fp32 gradients, 1 MiB buckets: DDP's and the
compiler's first bucket cap), 2 warm-up steps for compilation, 4 judged."""


def check_overlap(ctx: Context, compile: bool = True) -> str:
    """DDP (compiled in bf16 by default) through the real loop under torchrun; fails when
    its first gradient bucket is launched only after the backward ended
    (bench/node/doctor_overlap.py)."""
    from bench.node.doctor_overlap import read_verdict

    out = ctx.work_dir / "overlap.json"
    settings = [*OVERLAP_SETTINGS, f"parallel.world_size={ctx.world_size}",
                f"parallel.device={ctx.device}", f"model.compile={str(compile).lower()}",
                f"model.precision={'bf16' if compile else 'fp32'}"]
    torchrun(ctx, ["bench.node.doctor_overlap", str(out), _repo_path("configs/ddp-tiny.yaml"),
                   *settings], out)
    return read_verdict(out)


def check_resume(ctx: Context) -> str:
    return short_run(ctx, "checkpoint and resume", "configs/ddp-tiny.yaml",
                     ["run.steps=3", "checkpoint.every=2"], resume_to=5)


CHECKS: list[Check] = [
    Check("environment", check_environment),
    Check("network interfaces", check_interfaces),
    Check("one GPU per rank", check_devices, needs_gpu="the ranks run on CPU here"),
    Check("collectives and p2p", check_collectives),
    Check("CUDA events vs host timing", check_timing, needs_gpu="CUDA events"),
    Check("bf16 autocast", check_bf16),
    *(Check(name, run_check(name, config, overrides), min_ranks=ranks)
      for name, (config, overrides, ranks) in RUNS.items()),
    Check("compile with DDP, bucket overlap", check_overlap, needs_gpu="torch.compile's GPU "
          "path; the order compile(DDP(model)) is pinned by the test suite on CPU"),
    Check("checkpoint and resume", check_resume),
]


# ---------------------------------------------------------------------------- running


def run_checks(checks: list[Check], ctx: Context, echo=None) -> list[Result]:
    """Every check in order; a failure or skip never stops the others."""
    results = []
    for check in checks:
        start = time.perf_counter()
        try:
            if check.needs_gpu and not ctx.gpus:
                raise Skip(f"needs a GPU: {check.needs_gpu}")
            if ctx.world_size < check.min_ranks:
                raise Skip(f"needs {check.min_ranks} ranks (one GPU each), "
                           f"--world-size is {ctx.world_size}")
            result = Result(check.name, PASS, check.run(ctx))
        except Skip as reason:
            result = Result(check.name, SKIP, str(reason))
        except Exception as err:
            result = Result(check.name, FAIL, _last_error(
                "".join(traceback.format_exception_only(type(err), err))))
        result.seconds = time.perf_counter() - start
        results.append(result)
        if echo:
            echo(format_row(result))
    return results


def md_text(text) -> str:
    """bench/study/report/render.py `md_text`, the pages' one escaping rule (imported when a report
    is written: pandas stays out of `commbench --help`)."""
    from bench.study.report.render import md_text as escape

    return escape(text)


def format_row(r: Result) -> str:
    """A table row; the detail (an error's text: paths, a host's output) escaped as the
    report's pages are (bench/study/report/render.py `md_text`)."""
    detail = " ".join(md_text(r.detail).replace("|", "/").split())
    return f"| {md_text(r.check)} | {r.status} | {r.seconds:.0f} s | {detail} |"


def format_report(results: list[Result], ctx: Context) -> str:
    """The markdown report: machine, table, counts and what was skipped."""
    lines = [
        "# commbench doctor",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S')} on {md_text(platform.node())} "
        f"({md_text(platform.platform())}), "
        f"{ctx.world_size} ranks, device {ctx.device}, {ctx.gpus} GPUs"
        + (f"; node {ctx.node_rank} of {ctx.nnodes} (rendezvous {md_text(ctx.endpoint)})."
           if ctx.nnodes > 1 else "."),
        "",
        "| check | result | time | detail |",
        "|---|---|---|---|",
        *(format_row(r) for r in results),
        "",
        *outcome(results),
    ]
    if any(r.status == FAIL for r in results):
        lines += ["", "Attach this file to a bug report; each run's logs are under the "
                      "work directory's runs/ (keep it with --keep DIR)."]
    return "\n".join(lines) + "\n"


def outcome(results: list[Result]) -> list[str]:
    """The counts, and the checks skipped with their reasons."""
    count = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, SKIP)}
    lines = [f"{count[PASS]} passed, {count[FAIL]} failed, {count[SKIP]} skipped."]
    skipped = [f"{r.check} ({md_text(r.detail)})" for r in results if r.status == SKIP]
    if skipped:
        lines.append("Skipped: " + "; ".join(skipped))
    return lines


def _last_error(text: str) -> str:
    """The line that says what went wrong: the last exception line, else the last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["(no output)"])[-1][:300]


def _slug(name: str) -> str:
    return "doctor-" + "".join(c if c.isalnum() else "-" for c in name).strip("-")


def _repo_path(config: str) -> str:
    """Shipped configs, found from the installed package when run outside the repo."""
    here = Path(config)
    return str(here if here.exists() else Path(__file__).resolve().parents[2] / config)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks, one GPU each (default: the node's GPUs, or 2 on CPU); with 1, "
                   "the checks that need 2 ranks are skipped")
    p.add_argument("--out", default="doctor-report.md", help="the report to write")
    p.add_argument("--keep", metavar="DIR", help="keep the short runs under DIR (default: a "
                   "temporary directory, removed at the end)")
    p.add_argument("--only", metavar="NAMES", help="comma-separated checks to run, each a "
                   "check's name or the start of names (e.g. 'environment,collectives,run')")
    p.add_argument("--nnodes", type=int, default=1, help="nodes the collectives check "
                   "spans (run doctor on each; the short runs stay on each node)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's rank, 0 to "
                   "NNODES-1 (default: SLURM_NODEID)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", default=None, help="torchrun's "
                   "c10d rendezvous, the same on every node (e.g. the first node:29400)")


def select_checks(only: str | None, checks: list[Check]) -> list[Check]:
    """The checks `--only` names (each entry a name or the start of names), in their
    order; a ValueError naming an entry that matches none, with the names."""
    if only is None:
        return checks
    entries = [e.strip().lower() for e in only.split(",") if e.strip()]
    for entry in entries:
        if not any(c.name.lower().startswith(entry) for c in checks):
            raise ValueError(f"doctor --only: {entry!r} starts no check's name; the checks: "
                             + ", ".join(c.name for c in checks))
    return [c for c in checks if any(c.name.lower().startswith(e) for e in entries)]


def run_cli(args) -> int:
    nodes = validate_nodes(args.nnodes, args.node_rank, args.rdzv_endpoint, dict(os.environ))
    checks = select_checks(args.only, CHECKS)
    if args.world_size is not None and args.world_size < 1:
        raise ValueError(f"doctor --world-size must be >= 1, got {args.world_size}")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = args.world_size if args.world_size is not None else (gpus or 2)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="commbench-doctor-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Context(world, gpus, work, *nodes)
    print("| check | result | time | detail |\n|---|---|---|---|", flush=True)
    try:
        results = run_checks(checks, ctx, echo=lambda row: print(row, flush=True))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report = format_report(results, ctx)
    Path(args.out).write_text(report)
    print("\n".join(outcome(results)))
    print(f"wrote {args.out}")
    return 1 if any(r.status == FAIL for r in results) else 0

