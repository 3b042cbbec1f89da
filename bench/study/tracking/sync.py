"""What a run's records look like to a sink, what each sink already holds, and sending the
rest: live (`follow`, the launcher's thread) or after the fact (`track`).

    commbench track results/quickstart --to tensorboard --set dir=tb

`TrackedRun.load(run_dir)` reads the records (config.yaml, env.json, metrics.jsonl,
summary.json, eval.json). `RunSync(run_dir, sinks).sync()` sends each sink what it does
not hold yet, by the account in RUN_DIR/tracking.json: per sink destination, the sink's
run (`handle`), the attempt it belongs to (summary.json `started`), the last training and
validation step sent, and digests of the summary and eval numbers sent. So a second sync
sends nothing, a later `commbench eval` adds only its numbers, a resumed run continues
its sink run (rows the resume recomputes after its checkpoint are not sent twice: the
sink keeps the first attempt's, losses equal by bit-exact resume, clocks within timing
noise), and a new attempt of the run (`--run-dir` again) starts a new sink run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import socket
import sys
import threading
import time
from pathlib import Path

from bench.config.schema import SINK_CONFIGS, SINK_NAMES, TrackingConfig
from bench.config.typed import flatten
from bench.run import files
from bench.run.records import RunDir
from bench.study.tracking.run import TrackedRun, read_yaml
from bench.study.tracking.sinks import make_sink, warn


def row_series(row: dict) -> tuple[str, dict[str, float]]:
    """A metrics row as ("train" | "val", {series name: value}): every number of the row
    under KIND/, the projected clocks as KIND/projected_elapsed_s/PROFILE, and a training
    row's comm share (comm_s / step_s)."""
    kind = "val" if "val_loss" in row else "train"
    out = {}
    for key, value in row.items():
        if key == "step":
            continue
        if isinstance(value, dict):
            out.update({f"{kind}/{key}/{k}": v for k, v in value.items() if _number(v)})
        elif _number(value):
            out[f"{kind}/{key}"] = value
    if kind == "train" and _number(row.get("step_s")) and row["step_s"] > 0:
        out["train/comm_share"] = row.get("comm_s", 0.0) / row["step_s"]
    return kind, out


def summary_series(summary: dict) -> dict[str, float]:
    """summary.json's numbers as summary/KEY (nested: summary/projected/PROFILE/total_s)."""
    flat = flatten({k: v for k, v in summary.items() if k != "eval"}, "summary/", "/")
    return {k: v for k, v in flat.items() if _number(v)}


def _number(value) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def _digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------ the account


_LEDGER = threading.Lock()


class RunSync:
    """Sends one run's records to its sinks; a sink that raises is dropped with one warning
    (the others go on). `failed` names the dropped sinks."""

    def __init__(self, run_dir: str | os.PathLike, sinks: list):
        self.records, self.sinks = RunDir(run_dir), list(sinks)
        self.opened: set[str] = set()
        self.failed: list[str] = []

    def sync(self) -> list[str]:
        """Send what each sink lacks; one line per sink that got something."""
        run = TrackedRun.load(self.records.path)
        lines = []
        for sink in list(self.sinks):
            try:
                line = self._push(sink, run)
            except ImportError as err:
                self._drop(sink, f"its package is not installed ({err}); pip install "
                                 f"'commbench[{sink.name}]'")
            except Exception as err:  # any library error: never the run's
                self._drop(sink, f"{type(err).__name__}: {err}")
            else:
                if line:
                    lines.append(line)
        return lines

    def close(self) -> None:
        for sink in list(self.sinks):
            try:
                sink.close()
            except Exception as err:
                self._drop(sink, f"closing: {type(err).__name__}: {err}")

    def _drop(self, sink, reason: str) -> None:
        self.sinks.remove(sink)
        self.failed.append(sink.name)
        warn(f"{sink.name} dropped for {self.records.path.name}: {reason.strip()}. The run's "
              f"records are complete; `commbench track RESULTS_DIR --to {sink.name}` "
              "sends them later")
        with contextlib.suppress(Exception):
            sink.close()

    def _entry(self, key: str) -> dict:
        path = self.records.tracking
        try:
            return (files.read_json(path) if path.exists() else {}).get(key) or {}
        except ValueError:
            return {}

    def _save(self, key: str, entry: dict) -> None:
        """Record one destination's account (the sinks of a run are followed in threads of
        one process: each rewrites its own key)."""
        with _LEDGER:
            path = self.records.tracking
            try:
                ledger = files.read_json(path) if path.exists() else {}
            except ValueError:
                ledger = {}
            ledger[key] = entry
            files.write_json(path, ledger)

    def _push(self, sink, run: TrackedRun) -> str | None:
        key = sink.key()
        entry = self._entry(key)
        if entry and key not in self.opened and entry.get("attempt") != run.attempt \
                and not run.summary.get("resumed_from_step"):
            entry = {}  # a new attempt of the run (started again from step 0): a new sink run
        sent = {"train": entry.get("train", -1), "val": entry.get("val", -1)}
        rows = []
        for row in run.rows:
            kind, scalars = row_series(row)
            if row["step"] > sent[kind]:
                rows.append((kind, row, scalars))
        ended = run.status != "partial"
        summary = summary_series(run.summary) if ended else {}
        summary_digest = _digest([summary, run.status]) if ended else None
        eval_digest = _digest(run.eval) if run.eval else None
        todo_summary = ended and summary_digest != entry.get("summary")
        todo_eval = eval_digest is not None and eval_digest != entry.get("eval")
        if not (rows or todo_summary or todo_eval):
            return None

        if key not in self.opened:
            entry["handle"] = sink.open(run, entry.get("handle"))
            entry["attempt"] = run.attempt
            self.opened.add(key)
            self._save(key, entry)
        sink.write_rows([(row["step"], run.walltime(row.get("elapsed_s")), scalars)
                         for _, row, scalars in rows])
        for kind, row, _ in rows:
            entry[kind] = row["step"]
        step, walltime = run.last_step, run.walltime(run.summary.get("wall_s"))
        if todo_summary:
            sink.finish(step, walltime, summary, run.status)
            entry["summary"] = summary_digest
        if todo_eval:
            sink.finish(step, walltime, {f"eval/{k}": v for k, v in run.eval.items()}, None)
            entry["eval"] = eval_digest
        self._save(key, entry)
        what = [f"{len(rows)} rows"] + ["summary"] * todo_summary + ["eval"] * todo_eval
        return f"{sink.name}: {', '.join(what)} -> {sink.where(entry['handle'])}"


def sync_run(run_dir: str | os.PathLike, sinks: list) -> tuple[list[str], list[str]]:
    """Send one run's records once: (lines of what was sent, names of the sinks that failed)."""
    sync = RunSync(run_dir, sinks)
    lines = sync.sync()
    sync.close()
    return lines, sync.failed


# ------------------------------------------------------------------------------- live


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class Follower:
    """Launcher threads, one per sink (a slow one holds back no other), that send the
    run's new records every `poll_s` seconds.

    They wait for this attempt's metrics.jsonl: rank 0 replaces the file (atomically, a new
    inode) before its first step (bench/run/checkpoint.py `load_state`), so rows of an earlier
    attempt are never sent as this one's. On a multi-node run only the launcher on rank
    0's node (env.json's host) sends anything."""

    def __init__(self, cfg: TrackingConfig, run_dir: str | os.PathLike):
        self.cfg, self.records = cfg, RunDir(run_dir)
        self.stale = _identity(self.records.metrics)
        self.syncs = [RunSync(run_dir, [make_sink(name, spec, cfg.timeout_s)])
                      for name, spec in cfg.sinks().items()]
        self.live, self.final = False, True
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(sync,), daemon=True,
                                         name=f"tracking {sync.sinks[0].name}")
                        for sync in self.syncs]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self, final: bool = True) -> None:
        """Send the last records (unless `final` is False: Ctrl-C) and close the sinks,
        waiting at most tracking.timeout_s."""
        self.final = final
        self.done.set()
        deadline = time.monotonic() + (self.cfg.timeout_s if final
                                       else min(5.0, self.cfg.timeout_s))
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        late = [t.name.removeprefix("tracking ") for t in self.threads if t.is_alive()]
        if late:
            warn(f"{', '.join(late)} did not finish {self.records.path.name} within "
                  f"tracking.timeout_s={self.cfg.timeout_s:g} s and are left behind (the "
                  "records are complete; `commbench track` sends what is missing)")

    def _ready(self) -> bool:
        if not self.live:
            now = _identity(self.records.metrics)
            if now is None or now == self.stale:
                return False
            if self._env().get("host") not in (None, socket.gethostname()):
                for sync in self.syncs:  # rank 0 runs on another node: its launcher sends
                    sync.sinks.clear()
                return False
            self.live = True
        return True

    def _env(self) -> dict:
        try:
            env = files.read_json(self.records.env) if self.records.env.exists() else {}
        except ValueError:
            return {}
        return env if isinstance(env, dict) else {}

    def _loop(self, sync: RunSync) -> None:
        seen = None
        while True:
            stopping = self.done.wait(self.cfg.poll_s)
            if stopping and not self.final:
                break
            if self._ready() and sync.sinks:
                now = tuple(_identity(p) for p in (self.records.metrics, self.records.summary,
                                                   self.records.eval))
                if now != seen:
                    try:
                        sync.sync()
                        seen = now
                    except Exception as err:  # records being written: the next poll retries
                        if stopping:
                            warn(f"could not read {self.records.path}: "
                                  f"{type(err).__name__}: {err}")
            if stopping:
                break
        sync.close()


@contextlib.contextmanager
def follow(cfg: TrackingConfig, run_dir: str | os.PathLike):
    """Inside the block, the run at `run_dir` is sent to `cfg`'s sinks as it is recorded;
    at its end, the last records (bounded by cfg.timeout_s). No sinks: nothing happens."""
    if not cfg.sinks():
        yield
        return
    follower = Follower(cfg, run_dir)
    follower.start()
    ended = False
    try:
        yield
        ended = True
    finally:
        follower.stop(final=ended)


# --------------------------------------------------------------------------- backfill


def sink_config(run_dir: Path, name: str, overrides: list[str] = ()):
    """The sink `name`'s config for a recorded run: the run's own tracking.NAME (if it had
    one), then `overrides` (FIELD=VALUE, e.g. dir=tb)."""
    from bench.config.typed import from_mapping, set_override

    data = {}
    run = RunDir(run_dir)
    if run.config.exists():
        recorded = (read_yaml(run.config.read_text()).get("tracking") or {}).get(name)
        data = dict(recorded) if isinstance(recorded, dict) else {}
    for key in _DESTINATIONS:
        if isinstance(data.get(key), str):
            _check_recorded_destination(run, name, key, data[key])
    for assignment in overrides:
        set_override(data, assignment)
    return from_mapping(SINK_CONFIGS[name], data, f"tracking.{name}")


_DESTINATIONS = ("dir", "tracking_uri")
"""Sink settings that say where files are written."""


def _check_recorded_destination(run: RunDir, name: str, key: str, value: str) -> None:
    """A destination read from a run's record (not given by the user) must be a relative
    path below the current directory: results directories travel, and a crafted config
    must not make `commbench track` write anywhere else. Anything else: give it with --set."""
    path = Path(value.removeprefix("file:")) if "://" not in value else None
    if path is not None and not path.is_absolute() and ".." not in path.parts \
            and not value.startswith("~"):
        return
    raise ValueError(
        f"{run.config}: tracking.{name}.{key} {value!r} comes from the run's record, and "
        "commbench track sends records only to a destination below the current directory "
        f"unless you name it: give it with --set {key}=... (e.g. --set {key}={value})")


def track(results_dir: str | os.PathLike, to: str, overrides: list[str] = ()) -> int:
    """`commbench track`: send every run under `results_dir` (a run, a sweep or a tree of
    them) to the sink `to`; prints what each got. Returns the number of runs whose sink
    failed (each with a warning)."""
    from bench.study.report.load import find_run_dirs

    if to not in SINK_NAMES:
        raise ValueError(f"--to must be one of {list(SINK_NAMES)}, got {to!r}")
    root = Path(results_dir)
    if not root.is_dir():
        raise ValueError(f"results directory not found: {str(root)!r}")
    run_dirs = find_run_dirs(root)
    if not run_dirs:
        raise ValueError(f"no run records under {str(root)!r}")
    specs = {run_dir: sink_config(run_dir, to, overrides) for run_dir in run_dirs}  # all
    unreadable = []                                             # checked before sending any
    for run_dir in run_dirs:
        try:
            for line in TrackedRun.load(run_dir).doubts():
                warn(line)
        except ValueError as err:
            unreadable.append(str(err))
    if unreadable:
        raise ValueError("nothing sent: " + "; ".join(unreadable) + " (move it out of "
                         f"{str(root)!r} or mend it, then run track again)")
    failures = 0
    for run_dir, spec in specs.items():
        name = run_dir.name if run_dir == root else str(run_dir.relative_to(root))
        try:
            with RunDir(run_dir).lock("commbench track"):  # tracking.json has one writer
                lines, failed = sync_run(run_dir, [make_sink(to, spec)])
        except ValueError as err:  # held (a live run's launcher sends it), or not plain
            print(f"{name}: not sent: {err}", file=sys.stderr)
            failures += 1
            continue
        failures += bool(failed)
        for line in lines or ([] if failed else [f"{to}: up to date"]):
            print(f"{name}: {line}")
    return failures
