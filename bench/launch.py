"""Launch one training run: torchrun on this machine, or one node of a multi-node run.

`commbench run configs/ddp-tiny.yaml` validates the config, creates the run directory,
writes config.yaml, starts `torchrun ... -m bench.train RUN_DIR`, shows a live progress
line, and leaves summary.json with status ok, diverged or failed (with the error text).
A rank that crashes makes torchrun stop the others; a rank stuck in a collective fails
after `parallel.timeout_s`; either way the run ends with status failed, never a hang.
Ctrl-C stops torchrun, records the run failed with `interrupted: true` (partial: a sweep
trains it again) and re-raises the KeyboardInterrupt to the caller. Self-evaluation
(`eval.suite`) is the command line's job (bench/cli.py), after `run_config` returns: the
harness does not import `eval`.

Multi-node (Slurm or by hand): set `launch.nnodes` and `launch.rdzv_endpoint` and start
`commbench run CONFIG --run-dir SHARED_DIR` once per node; torchrun's c10d rendezvous
assigns node ranks. The run directory must be on a shared filesystem.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from bench.config import Config, check_output_dir, config_hash, to_yaml
from bench.records import RunDir, write_text
from bench.summary import running_header


def new_run_dir(cfg: Config) -> Path:
    """results/NAME-HASH, with -2, -3... appended rather than overwrite an earlier record."""
    out = check_output_dir(cfg.run.output_dir)
    base = out / f"{cfg.run.name}-{config_hash(cfg)}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def torchrun_command(cfg: Config, run_dir: Path) -> list[str]:
    nnodes = cfg.launch.nnodes
    cmd = [sys.executable, "-m", "torch.distributed.run",
           f"--nproc-per-node={cfg.parallel.world_size // nnodes}"]
    if nnodes == 1 and cfg.launch.rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        if cfg.launch.rdzv_endpoint is None:
            raise ValueError("launch.rdzv_endpoint (host:port) is required when launch.nnodes > 1")
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={cfg.launch.rdzv_endpoint}",
                f"--rdzv-id={config_hash(cfg)}"]
    cmd += list(cfg.launch.torchrun_args)
    return cmd + ["-m", "bench.train", str(run_dir)]


def run_config(cfg: Config, run_dir: Path | None = None, progress: bool = True,
               resume: bool = False) -> dict:
    """Train one run into `run_dir` (a new directory when None); returns summary.json
    with `run_dir` added."""
    run = RunDir(run_dir if run_dir is not None else new_run_dir(cfg))
    run.prepare()
    write_text(run.config, to_yaml(cfg))
    run.update_summary(running_header(
        cfg.run.name, config_hash(cfg), cfg.strategy.name, cfg.parallel.world_size,
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z")))
    env = dict(os.environ, COMMBENCH_PROGRESS="1", PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    if resume:
        env["COMMBENCH_RESUME"] = "1"
    started = time.perf_counter()
    try:
        rc, tail = _run_torchrun(torchrun_command(cfg, run.path), env, run.torchrun_log,
                                 progress)
    except KeyboardInterrupt:  # torchrun is stopped: record the run, let the caller stop too
        run.update_summary({
            "status": "failed", "error": "interrupted by the user", "interrupted": True,
            "launcher_wall_s": time.perf_counter() - started,
        })
        print(f"\ninterrupted; continue with: commbench run --resume {run.path}",
              file=sys.stderr)
        raise
    summary = run.read_summary() or {}
    if rc != 0 or summary.get("status") == "running":
        summary = run.update_summary({
            "status": "failed", "error": _error_text(run, rc, tail),
            "launcher_wall_s": time.perf_counter() - started,
        })
    else:
        summary = run.update_summary({"launcher_wall_s": time.perf_counter() - started})
    return {**summary, "run_dir": str(run.path)}


def _run_torchrun(cmd: list[str], env: dict, log_path: Path, progress: bool):
    tail: deque[str] = deque(maxlen=40)
    interactive = progress and sys.stderr.isatty()
    with open(log_path, "a") as log:
        log.write(" ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                text=True, bufsize=1)
        try:
            for line in proc.stdout:
                log.write(line)
                if line.startswith("PROGRESS "):
                    if progress:
                        text = line[len("PROGRESS "):].rstrip()
                        print(f"\r{text}\033[K" if interactive else text, end="" if interactive
                              else "\n", file=sys.stderr, flush=True)
                else:
                    tail.append(line.rstrip())
            rc = proc.wait()
        except KeyboardInterrupt:  # stop the ranks; run_config records the run
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.write("interrupted by the user (KeyboardInterrupt)\n")
            raise
        finally:
            if interactive:
                print(file=sys.stderr)
    return rc, list(tail)


def _error_text(run: RunDir, rc: int, tail: list[str]) -> str:
    # The first rank to fail is the cause; the others usually fail on the broken collective.
    errors = run.error_logs()
    if errors:
        first = errors[0]
        lines = first.read_text().strip().splitlines()
        rank = first.stem.removeprefix("error-")
        text = f"{rank}: {lines[-1] if lines else 'unknown error'}"
        if len(errors) > 1:
            others = ", ".join(p.stem.removeprefix("error-") for p in errors[1:])
            text += f" (then {others} failed too)"
        return text + "\n" + "\n".join(lines[-15:])
    return f"torchrun exited with code {rc}\n" + "\n".join(tail[-15:])
