"""`commbench doctor`: the first command to run on a new GPU node or cluster.

    commbench doctor [--world-size N] [--out doctor-report.md] [--keep DIR]

Checks, one line each in a pass / fail / skip table (with the error's last line), written
to `--out` so it can be attached to a bug report:
- environment: torch, CUDA, NCCL and DeepSpeed versions, the GPUs;
- devices: one GPU per rank for `--world-size` ranks on this node;
- collectives: all_reduce, broadcast, all_gather, send/recv and a batched exchange on the
  run's backend (NCCL on GPUs, gloo on CPU), results checked, through torchrun;
- timing: CUDA-event time of a matmul loop against host time after a synchronise;
- bf16 autocast: a GPT forward under autocast gives bf16 activations;
- short runs through the real launcher (`bench.launch.run.run_config`, 2 ranks, a few steps of
  a tiny GPT): DDP, DiLoCo, GASLoC, a 2-stage pipeline (torch 1F1B), PipeDream-2BW,
  DeepSpeed ZeRO-1, compile with DDP, and a checkpoint then `--resume`.
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
    gpus: int
    work_dir: Path

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
    """The ranks' collectives and p2p through torchrun (`_collectives_worker`)."""
    out = ctx.work_dir / "collectives.txt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ctx.world_size}", "-m", "bench.node.doctor", "--worker", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(_last_error(proc.stdout + proc.stderr))
    return out.read_text().strip()


def _collectives_worker(out: str) -> int:
    """One rank under torchrun: every op the strategies use, checked against its result."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    try:
        t = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(t)
        assert t[0].item() == world * (world + 1) / 2, f"all_reduce gave {t[0].item()}"
        b = torch.full((8,), float(rank), device=device)
        dist.broadcast(b, src=world - 1)
        assert b[0].item() == world - 1, f"broadcast gave {b[0].item()}"
        parts = [torch.empty(4, device=device) for _ in range(world)]
        dist.all_gather(parts, torch.full((4,), float(rank), device=device))
        assert [p[0].item() for p in parts] == list(range(world)), "all_gather order"
        if world == 1:  # no peer to send to
            dist.barrier()
            Path(out).write_text(f"{backend}, 1 rank: all_reduce, broadcast, all_gather "
                                 "correct; send/recv not checked (needs 2 ranks)")
            return 0
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        got = torch.empty(16, device=device)
        if rank % 2 == 0:
            dist.send(torch.full((16,), float(rank), device=device), nxt)
            dist.recv(got, prev)
        else:
            dist.recv(got, prev)
            dist.send(torch.full((16,), float(rank), device=device), nxt)
        assert got[0].item() == prev, f"send/recv gave {got[0].item()}"
        got2 = torch.empty(16, device=device)
        ops = [dist.P2POp(dist.isend, torch.full((16,), float(rank), device=device), nxt),
               dist.P2POp(dist.irecv, got2, prev)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if cuda:
            torch.cuda.synchronize(device)
        assert got2[0].item() == prev, f"batched exchange gave {got2[0].item()}"
        dist.barrier()
        if rank == 0:
            Path(out).write_text(f"{backend}, {world} ranks: all_reduce, broadcast, all_gather, "
                                 "send/recv, batch_isend_irecv correct")
    finally:
        dist.destroy_process_group()
    return 0


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
    "run diloco": ("configs/diloco-tiny.yaml", ["strategy.inner_steps=2"], 1),
    "run gasloc": ("configs/gasloc-tiny.yaml", ["strategy.inner_steps=2"], 2),
    "run pipeline 1f1b (2 stages)": ("configs/pipeline-1f1b-tiny.yaml",
                                     ["parallel.num_microbatches=2"], 2),
    "run pipedream-2bw (2 stages)": ("configs/2bw-tiny.yaml",
                                     ["parallel.num_microbatches=2"], 2),
    "run deepspeed zero-1": ("configs/ddp-tiny.yaml", ["strategy.backend=deepspeed",
                                                       "strategy.zero_stage=1"], 1),
}
"""name: (config, overrides, the ranks it needs: a gossip peer, two pipeline stages)."""


def short_run(ctx: Context, name: str, config: str, overrides: list[str],
              resume_to: int | None = None) -> str:
    """Train `config` briefly through the launcher; the summary's key numbers (raises with
    the run's error headline when it fails)."""
    from bench.config import load_config
    from bench.launch.run import run_config

    settings = [*RUN_SETTINGS, f"parallel.world_size={min(2, ctx.world_size)}", *overrides,
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
            f"{summary.get('throughput_tokens_per_s') or 0:,.0f} tok/s steady")


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


def check_compile(ctx: Context) -> str:
    return short_run(ctx, "run ddp + compile", "configs/ddp-tiny.yaml",
                     ["model.compile=true", "model.precision=bf16"])


def check_resume(ctx: Context) -> str:
    return short_run(ctx, "checkpoint and resume", "configs/ddp-tiny.yaml",
                     ["run.steps=3", "checkpoint.every=2"], resume_to=5)


CHECKS: list[Check] = [
    Check("environment", check_environment),
    Check("one GPU per rank", check_devices, needs_gpu="the ranks run on CPU here"),
    Check("collectives and p2p", check_collectives),
    Check("CUDA events vs host timing", check_timing, needs_gpu="CUDA events"),
    Check("bf16 autocast", check_bf16),
    *(Check(name, run_check(name, config, overrides), min_ranks=ranks)
      for name, (config, overrides, ranks) in RUNS.items()),
    Check("compile with DDP", check_compile, needs_gpu="torch.compile's GPU path; the order "
          "compile(DDP(model)) is pinned by the test suite on CPU"),
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
        f"{ctx.world_size} ranks, device {ctx.device}, {ctx.gpus} GPUs.",
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


def run_cli(args) -> int:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = args.world_size if args.world_size is not None else (gpus or 2)
    if world < 1:
        raise ValueError(f"doctor --world-size must be >= 1, got {world}")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="commbench-doctor-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Context(world, gpus, work)
    print("| check | result | time | detail |\n|---|---|---|---|", flush=True)
    try:
        results = run_checks(CHECKS, ctx, echo=lambda row: print(row, flush=True))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report = format_report(results, ctx)
    Path(args.out).write_text(report)
    print("\n".join(outcome(results)))
    print(f"wrote {args.out}")
    return 1 if any(r.status == FAIL for r in results) else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(_collectives_worker(sys.argv[2]))
    sys.exit("usage: commbench doctor (this module's --worker is torchrun's program)")
