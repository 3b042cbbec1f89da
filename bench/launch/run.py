"""Launch one training run: torchrun on this machine, or one node of a multi-node run.

`commbench run configs/ddp-tiny.yaml` validates the config, creates the run directory,
writes config.yaml, starts `torchrun ... -m bench.run.train RUN_DIR`, shows a live progress
line, and leaves summary.json with status ok, diverged or failed (with the error text).
A rank that crashes makes torchrun stop the others; a rank stuck in a collective fails
after `parallel.timeout_s`; either way the run ends with status failed, never a hang, and
the error's headline names the culprit rank (bench/launch/failure.py). Self-evaluation
(`eval.suite`) is the command line's job (bench/cli.py), after `run_config` returns: the
harness does not import `eval`. Before torchrun starts, this process checks the node has a
GPU per rank (CUDA runs) and tokenises the corpus into the cache, so no rank waits in a
barrier, past `parallel.timeout_s`, for another to tokenise.

Stopping (bench/run/stop.py holds both sides). While torchrun runs, the first stop signal
(Ctrl-C, SIGTERM from Slurm or `kill`, SIGHUP from a closed terminal, SIGUSR1/2 from
Slurm's `--signal` before a time limit) is relayed to the ranks, which checkpoint at the
next step boundary and stop; a second SIGINT, SIGTERM or SIGHUP stops them at once
(losing the steps since the last checkpoint). Either way the run is recorded failed with
`interrupted: true` (partial: `--resume` and the next sweep continue it) and `run_config`
raises `Stopped` (`Terminated` for SIGTERM), a KeyboardInterrupt. torchrun itself ignores
these signals and dies with this process (bench/launch/torchrun.py), and the ranks with torchrun:
a killed launcher leaves no rank training into a record that a later sweep resumes.

Each launch is one attempt, appended to summary.json `attempts` ({job_id, host, start,
end, reason}: a Slurm job id, or null); a resume keeps the earlier ones. `wall_s` counts
training time only (steps redone after a resume once), never the time between attempts.

What a run directory accepts (checked before anything in it changes):
- `--run-dir DIR`: a new or empty directory, or one holding the same config (same hash)
  that has not finished: the run starts at step 0 with a clean record. A directory of
  another run, or of this run finished, is refused.
- `--resume DIR`: the config in DIR/config.yaml; only `run.steps` may grow (recorded as
  `steps_extended_from`), besides where things go (output paths, `launch`, `checkpoint`).
  A finished run is refused unless its steps grow. Every rank's checkpoint must load and
  hold the same step; without checkpoints the run restarts at step 0, and says so.
A resumed run that finishes has a clean summary (status ok, no stale error).
From its check to its record the launcher holds the directory (`RunDir.lock`, which every
writer of a run's records honours): a second `--resume` of it, a sweep moving it aside or
`commbench eval` of it meanwhile is refused, naming this process.

Multi-node (Slurm or by hand): set `launch.nnodes` and `launch.rdzv_endpoint` and start
`commbench run CONFIG --run-dir SHARED_DIR` once per node (a Slurm sweep does it for you,
bench/launch/jobentry.py); torchrun's c10d rendezvous assigns node ranks. The run directory must
be on a shared filesystem. The first node (Slurm's node 0, else the host named in
`launch.rdzv_endpoint`) writes config.yaml, the header and the attempts; rank 0's node
writes summary.json; on the other nodes success is torchrun's exit code 0.

A rank that dies after every rank finished the run (each writes logs/finished-rankN
before the last barrier), e.g. a library aborting at interpreter exit, does not fail the
run: its record stays as rank 0 wrote it, with the failure under `teardown_error`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from collections import deque
from pathlib import Path

from bench.config import Config, config_hash, identity_dict, load_config, to_yaml
from bench.config.preflight import check_gpus, check_output_dir
from bench.config.typed import flatten
from bench.data import cached_corpus, corpus_identity, same_data
from bench.launch import torchrun
from bench.launch.failure import error_text
from bench.run import checkpoint
from bench.run.files import NO_SPACE, write_text
from bench.run.records import DONE_STATUSES, RunDir, status_of
from bench.run.stop import Stopped, Terminated, relaying, stop_received, stop_signals
from bench.run.summary import running_header


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
    if nnodes > 1 and cfg.launch.rdzv_endpoint is None:
        raise ValueError("launch.rdzv_endpoint (host:port) is required when launch.nnodes > 1")
    return torchrun.command("bench.run.train", [str(run_dir)],
                            cfg.parallel.world_size // nnodes, nnodes,
                            cfg.launch.rdzv_endpoint, config_hash(cfg),
                            cfg.launch.rdzv_timeout_s, cfg.launch.torchrun_args,
                            launcher="bench.launch.torchrun")  # torchrun, minus its signal handling


def run_config(cfg: Config, run_dir: Path | None = None, progress: bool = True,
               resume: bool = False) -> dict:
    """Train one run into `run_dir` (a new directory when None); returns summary.json
    with `run_dir` added. Raises ValueError, before changing anything, when the directory
    cannot take this run (module docstring), `records.Busy` when another process holds it,
    and `Stopped` after recording a stopped run."""
    run = RunDir(run_dir if run_dir is not None else new_run_dir(cfg))
    def check() -> dict:  # changes nothing: a refused directory is left as it was
        header = check_resume(cfg, run) if resume else check_run_dir(cfg, run)
        if resume:
            check_same_data(cfg, run, data)
        return {**header, "data": data}

    # tokenise here, in one process, before the ranks start: tokenising in rank 0 while the
    # others wait in a barrier times them out (parallel.timeout_s) on a large corpus
    data = corpus_identity(cached_corpus(cfg.data.corpus, cfg.data.tokenizer,
                                         cfg.data.cache_dir, cfg.data.val_fraction))
    check()
    check_gpus(cfg)  # on this node, where torchrun starts its ranks (a Slurm job's too)
    if cfg.launch.nnodes == 1 and cfg.launch.rdzv_endpoint is None:
        torchrun.check_loopback()  # the standalone rendezvous: else torchrun retries mutely
    run.path.mkdir(parents=True, exist_ok=True)
    shared = (f"{config_hash(cfg)}@{cfg.launch.rdzv_endpoint}" if cfg.launch.nnodes > 1
              else None)  # the nodes of one multi-node run hold it together
    with run.lock("commbench run --resume" if resume else "commbench run", shared=shared):
        return _train(cfg, run, check(), progress)  # checked again: now nobody else writes


def _train(cfg: Config, run: RunDir, header: dict, progress: bool) -> dict:
    """run_config's work once the run directory is checked and held (nothing in it has
    changed yet)."""
    if "resumed_from_step" in header and not header["resumed_from_step"]:
        print(f"--resume {run.path}: no checkpoint was saved (checkpoint.every); the run "
              "restarts at step 0 and its metrics rows are replaced", file=sys.stderr)
    first = first_node(cfg)
    with stop_signals():
        run.prepare()
        if header.get("resumed_from_step"):
            checkpoint.adopt_states(run, cfg.parallel.world_size, header["resumed_from_step"])
        fault = os.environ.get("COMMBENCH_FAULT")  # bench/env.py: a rank fails on purpose
        if fault:
            print(f"warning: COMMBENCH_FAULT={fault} is set: a rank of this run fails on "
                  "purpose (recorded in summary.json fault_injected)", file=sys.stderr)
        if first:  # one writer of the header and the attempts per run
            write_text(run.config, to_yaml(cfg))
            run.write_summary(running_header(
                cfg.run.name, config_hash(cfg), cfg.strategy.name, cfg.parallel.world_size,
                started=_now(),
                **{**header, "attempts": [*header.get("attempts", []), new_attempt()]},
                **({"fault_injected": fault} if fault else {})))
        env = dict(os.environ, COMMBENCH_PROGRESS="1", PYTHONUNBUFFERED="1")
        env.pop("COMMBENCH_RESUME", None)  # the launcher alone says resume (below): one left
        # exported would make a new attempt continue an old checkpoint
        env.setdefault("OMP_NUM_THREADS", "1")
        if cfg.launch.cuda_visible_devices:
            env["CUDA_VISIBLE_DEVICES"] = cfg.launch.cuda_visible_devices
        if header.get("resumed_from_step"):
            env["COMMBENCH_RESUME"] = "1"
        started = time.perf_counter()
        if cfg.launch.nnodes > 1:
            print(f"waiting for the rendezvous of launch.nnodes={cfg.launch.nnodes} nodes at "
                  f"{cfg.launch.rdzv_endpoint} (at most launch.rdzv_timeout_s="
                  f"{cfg.launch.rdzv_timeout_s:g} s; start `commbench run` on every node)",
                  file=sys.stderr)
        try:
            rc, tail, log_error = _run_torchrun(torchrun_command(cfg, run.path), env, run,
                                                progress, cfg.launch.rdzv_timeout_s)
        except Stopped as stop:  # at once: torchrun and the ranks are killed
            what = {signal.SIGINT: "interrupted by the user",
                    signal.SIGTERM: "terminated (SIGTERM)"}.get(stop.signum, f"stopped by {stop}")
            summary = run.update_summary({"status": "failed", "error": what, "interrupted": True,
                                          "launcher_wall_s": time.perf_counter() - started})
            if first:
                end_attempt(run, what)
            with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
                print(f"\n{what}; {resume_hint(run, cfg.parallel.world_size)}",
                      file=sys.stderr)
            raise
        summary = _record_outcome(cfg, run, rc, tail, log_error, time.perf_counter() - started)
        if first:
            end_attempt(run, f"stopped by {summary['stopped_by']}" if summary.get("stopped_by")
                        else summary["status"])
        if stop_received() is not None:  # the ranks stopped (or finished) as asked
            if status_of(summary) == "partial":
                with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
                    print(f"\n{summary.get('error')}; "
                          f"{resume_hint(run, cfg.parallel.world_size)}", file=sys.stderr)
            signum = stop_received()
            raise (Terminated if signum == signal.SIGTERM else Stopped)(signum)
    return {**summary, "run_dir": str(run.path)}


def _record_outcome(cfg: Config, run: RunDir, rc: int, tail: list[str] | None,
                    log_error: OSError | None, wall: float) -> dict:
    """summary.json once torchrun has exited: rank 0's record, or a failure naming the
    culprit (bench/launch/failure.py) or the rendezvous that never completed (tail None), with
    what to do on a full disk, or this node's success on a multi-node run."""
    summary = run.read_summary() or {}
    if rc == 0 and cfg.launch.nnodes > 1 and summary.get("status") == "running":
        # rank 0 is on another node and writes the record; this node's ranks succeeded
        return {**summary, "status": "ok",
                "note": "this node's ranks finished; rank 0's node writes summary.json"}
    if rc != 0 or summary.get("status") == "running":
        error = (error_text(run, rc, tail, cfg.parallel.world_size, cfg.parallel.timeout_s)
                 if tail is not None else not_started(cfg))
        if log_error is not None or any(f"[Errno {e}]" in error for e in NO_SPACE):
            error = _no_space(error, log_error, run, cfg.parallel.world_size)
        if summary.get("status") in DONE_STATUSES and run.all_finished(cfg.parallel.world_size):
            # every rank finished the run and rank 0 wrote its record; a rank died at exit
            summary = run.update_summary({"teardown_error": error, "launcher_wall_s": wall})
            print(f"warning: every rank finished the run, then torchrun exited with {rc}: "
                  f"{error.splitlines()[0]} (kept as {summary['status']}; summary.json "
                  "teardown_error)", file=sys.stderr)
            return summary
        updates = {"status": "failed", "error": error, "launcher_wall_s": wall}
        if stop_received() is not None:  # the ranks failed while stopping: still resumable
            updates["interrupted"] = True
        return run.update_summary(updates)
    if cfg.launch.nnodes == 1:  # several nodes: only rank 0 writes (no lost update)
        return run.update_summary({"launcher_wall_s": wall})
    return summary


def first_node(cfg: Config) -> bool:
    """Whether this launcher writes the run's config, header and attempts: always on one
    node; on several, Slurm's node 0, else the host that launch.rdzv_endpoint names."""
    if cfg.launch.nnodes == 1:
        return True
    if "SLURM_NODEID" in os.environ:
        return os.environ["SLURM_NODEID"] == "0"
    host = (cfg.launch.rdzv_endpoint or "").rsplit(":", 1)[0]
    return host in ("localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn())


def slurm_job_id() -> str | None:
    """This Slurm job's id as scontrol takes it (an array task: ARRAYID_TASK), or None."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def new_attempt() -> dict:
    """An entry of summary.json `attempts`: this launch, its end still open."""
    return {"job_id": slurm_job_id(), "host": socket.gethostname(), "start": _now(),
            "end": None, "reason": None}


def end_attempt(run: RunDir, reason: str, **more) -> None:
    """Close the last attempt of summary.json `attempts` with why it ended."""
    summary = _read_summary(run)
    attempts = list(summary.get("attempts") or [new_attempt()])
    attempts[-1] = {**attempts[-1], "end": _now(), "reason": reason, **more}
    run.update_summary({"attempts": attempts})


def check_run_dir(cfg: Config, run: RunDir) -> dict:
    """Refuse (ValueError) a directory holding another run, or this run finished."""
    if not run.config.exists():
        return {}
    old = _recorded_config(run, "--run-dir")
    if config_hash(old) != config_hash(cfg):
        raise ValueError(
            f"--run-dir {run.path}: it holds another run ({old.run.name}, config "
            f"{config_hash(old)}); this config is {cfg.run.name}, config {config_hash(cfg)}. "
            "Give a new directory, or leave out --run-dir (OUTPUT_DIR/NAME-HASH)")
    status = _recorded_status(run)
    if status in DONE_STATUSES:
        raise ValueError(
            f"--run-dir {run.path}: this run is already recorded there, finished (status "
            f"{status}); delete the directory to train it again, or extend it with "
            f"`commbench run --resume {run.path} --set run.steps=N`")
    return {}


def check_resume(cfg: Config, run: RunDir) -> dict:
    """What a resume may do (ValueError naming the keys otherwise); the header fields it adds:
    resumed_from_step (0 = restarts) and steps_extended_from. Of the layout keys
    (checkpoint.LAYOUT_KEYS) only what `checkpoint.layout_change_problem` allows may
    change: torch DDP, unsharded, onto another world size with the global batch kept."""
    old = _recorded_config(run, "--resume")
    before, after = flatten(identity_dict(old)), flatten(identity_dict(cfg))
    changed = sorted(k for k in before.keys() | after.keys()
                     if k != "run.steps" and before.get(k) != after.get(k))
    layout = checkpoint.layout_change_problem(old, cfg)  # world size, groups, rank batch
    changed_layout = any(k in checkpoint.LAYOUT_KEYS for k in changed)
    changed = [k for k in changed if k not in checkpoint.LAYOUT_KEYS]
    diffs = ", ".join(f"{k} {before.get(k)!r} -> {after.get(k)!r}" for k in changed)
    if layout is not None and changed_layout:
        raise ValueError(f"--resume {run.path}: {layout}" + (
            f". These keys differ too (recorded -> asked): {diffs}; only run.steps may grow"
            if changed else ""))
    if changed:
        raise ValueError(
            f"--resume {run.path}: a resume continues the same run, but these keys differ "
            f"from its config.yaml (recorded -> asked): {diffs}. Only run.steps may grow (and "
            "output paths, launch.*, checkpoint.* may change); start a new run for other values")
    if cfg.run.steps < old.run.steps:
        raise ValueError(f"--resume {run.path}: run.steps can only grow on resume: recorded "
                         f"{old.run.steps}, got {cfg.run.steps}")
    extended = cfg.run.steps > old.run.steps
    status = _recorded_status(run)
    if status == "diverged" or (status == "ok" and not extended):
        raise ValueError(
            f"--resume {run.path}: the run already finished (status {status}); nothing to "
            "resume" + ("" if status == "diverged" else
                        f". To train it longer: --set run.steps=N with N > {old.run.steps}"))
    step = checkpoint.verify_states(run, cfg.parallel.world_size)
    summary = _read_summary(run)
    header = {"resumed_from_step": step or 0, "attempts": list(summary.get("attempts") or [])}
    if extended:
        header["steps_extended_from"] = [*summary.get("steps_extended_from", []),
                                         old.run.steps]
    return header


def check_same_data(cfg: Config, run: RunDir, data: dict) -> None:
    """ValueError when the data a resume would train on are not the run's (summary.json
    `data`, recorded from the run's start): the same data.corpus may name other text, e.g.
    a relative path read from another directory, or a file changed since."""
    recorded = _read_summary(run).get("data")
    if not isinstance(recorded, dict) or not recorded.get("sha256") or same_data(recorded,
                                                                                  data):
        return  # a record from before the data were recorded: nothing to compare with
    def show(d):
        return (f"{d.get('source')!r} (text sha256 {str(d.get('sha256'))[:12]}, "
                f"{d.get('num_train_tokens')} training tokens)")

    raise ValueError(
        f"--resume {run.path}: its data differ from the run's: it trained on {show(recorded)}, "
        f"data.corpus {cfg.data.corpus!r} now holds {show(data)}; a resume must train on the "
        "same tokens (make data.corpus hold them again, or start a new run)")


def resume_hint(run: RunDir, world_size: int) -> str:
    """What `--resume` would do for this run now (the line after Ctrl-C)."""
    try:
        step = checkpoint.verify_states(run, world_size)
    except ValueError:
        step = None
    if step:
        return f"continue from step {step} with: commbench run --resume {run.path}"
    return (f"no checkpoint was saved yet: `commbench run --resume {run.path}` would "
            "restart it from step 0")


def _no_space(error: str, log_error: OSError | None, run: RunDir, world_size: int) -> str:
    """The failure's text with what a full disk (or a lost log) means for the user: the
    line after the headline says what to do."""
    headline, _, rest = error.partition("\n")
    try:
        step = checkpoint.verify_states(run, world_size)
    except ValueError:
        step = None
    lost = f"logs/torchrun.log stopped: {log_error}; " if log_error is not None else ""
    note = (f"{lost}free space on the filesystem of {run.path}, then run `commbench run "
            f"--resume {run.path}` " + (f"(it continues from step {step})" if step else
                                        "(no checkpoint was saved: it restarts at step 0)"))
    return f"{headline}\n{note}\n{rest}".rstrip("\n")


def _recorded_config(run: RunDir, flag: str) -> Config:
    try:
        return load_config(run.config)
    except ValueError as err:
        raise ValueError(f"{flag} {run.path}: its config.yaml cannot be read ({err})") from None


def _read_summary(run: RunDir) -> dict:
    try:
        return run.read_summary() or {}
    except ValueError:
        return {}


def _recorded_status(run: RunDir) -> str:
    return status_of(_read_summary(run))


def _run_torchrun(cmd: list[str], env: dict, run: RunDir, progress: bool,
                  start_timeout_s: float):
    """(torchrun's exit code, the last lines of its output or None when its ranks never
    started within `start_timeout_s`, the OSError that stopped the log file, if any: a
    full disk must not stop the launcher, which records the run). Stop signals go to its
    ranks meanwhile (bench/run/stop.py)."""
    tail: deque[str] = deque(maxlen=400)  # torchrun's failure summary is at the end
    interactive = progress and sys.stderr.isatty()
    log = _Log(run.torchrun_log)
    log.write(" ".join(cmd) + "\n")

    def on_line(line: str) -> None:
        log.write(line)
        if line.startswith("PROGRESS "):
            if progress:
                text = line[len("PROGRESS "):].rstrip()
                print(f"\r{text}\033[K" if interactive else text, end="" if interactive
                      else "\n", file=sys.stderr, flush=True)
        else:
            tail.append(line.rstrip())

    try:
        rc, stopped = torchrun.run(cmd, env, on_line, start_timeout_s,
                                   relay=lambda proc: relaying(proc, run))
    except KeyboardInterrupt as stop:  # torchrun is killed; run_config records the run
        log.write(f"stopped at once ({stop!r})\n")
        raise
    finally:
        log.close()
        if interactive:
            print(file=sys.stderr)
    return rc, None if stopped == torchrun.NOT_STARTED else list(tail), log.error


def not_started(cfg: Config) -> str:
    """The error of a run whose ranks never started (torchrun stopped by the launcher)."""
    bound = f"launch.rdzv_timeout_s={cfg.launch.rdzv_timeout_s:g} s"
    if cfg.launch.nnodes > 1:
        return (f"the rendezvous at {cfg.launch.rdzv_endpoint} did not complete within {bound}"
                f": the endpoint did not answer, or not all launch.nnodes={cfg.launch.nnodes} "
                "nodes started `commbench run` (raise launch.rdzv_timeout_s for slow queues)")
    return (f"torchrun's ranks did not start within {bound} (its standalone rendezvous on "
            "this machine did not complete; see logs/torchrun.log)")


class _Log:
    """logs/torchrun.log, appended line by line; after a failed write (a full disk) it
    writes no more and keeps the error (`error`)."""

    def __init__(self, path: Path):
        self.error: OSError | None = None
        try:
            self.file = open(path, "a", buffering=1)  # line-buffered: errors surface here
        except OSError as err:
            self.file, self.error = None, err

    def write(self, text: str) -> None:
        if self.file is None:
            return
        try:
            self.file.write(text)
        except OSError as err:
            self.error = err
            self.close()

    def close(self) -> None:
        if self.file is not None:
            file, self.file = self.file, None
            try:
                file.close()
            except OSError as err:
                self.error = self.error or err
