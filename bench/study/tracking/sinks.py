"""The three sinks: TensorBoard event files, a W&B run, an MLflow run (bench/study/tracking/).

Each writes what bench/study/tracking/sync.py hands it and nothing else: `open(run, handle)`
starts the sink's run for a record (handle None) or continues it (the handle `open`
returned before, kept in the run's tracking.json), `write_rows([(step, walltime,
scalars)])` metrics rows' series, `finish(step, walltime, scalars, status)` the summary
or eval numbers, `close()`. The libraries are imported in `open`, so a missing package fails
there, and the caller drops the sink with a warning.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from bench.config.typed import flatten

if TYPE_CHECKING:
    from bench.config.schema import MlflowConfig, TensorBoardConfig, WandbConfig
    from bench.study.tracking.run import TrackedRun


_STDERR = threading.Lock()


def warn(message: str) -> None:
    """One `warning: tracking:` line on stderr, written whole: the sinks run in threads,
    and print's separate write of the newline let two warnings share a line."""
    with _STDERR:
        sys.stderr.write(f"warning: tracking: {message}\n")
        sys.stderr.flush()


class TensorBoardSink:
    """Event files in DIR/RUN (DIR/SWEEP/RUN), through torch.utils.tensorboard. A new
    attempt of a run whose directory is taken writes RUN.2, RUN.3, ... (the old curves
    stay as they were, like a run directory's -2)."""

    name = "tensorboard"

    def __init__(self, spec: TensorBoardConfig):
        self.root = Path(spec.dir).expanduser().absolute()
        self.writer = None

    def key(self) -> str:
        return f"tensorboard:{self.root}"

    def where(self, handle: str) -> str:
        return str(self.root / handle)

    def inside(self, handle: str) -> Path:
        """root/handle; ValueError unless `handle` (made of a record's names: the sweep's,
        tracking.json's) is a relative path without `..`: a crafted record must not make
        the sink write outside its directory."""
        parts = Path(handle).parts
        if not parts or Path(handle).is_absolute() or ".." in parts:
            raise ValueError(f"the records name the TensorBoard run {handle!r}, which is not "
                             f"a path inside {self.root}; refused")
        return self.root / handle

    def open(self, run: TrackedRun, handle: str | None) -> str:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        new = handle is None
        if new:
            base = f"{run.group}/{run.name}" if run.group else run.name
            handle, n = base, 1
            while self.inside(handle).exists():
                n += 1
                handle = f"{base}.{n}"
        self.writer = SummaryWriter(str(self.inside(handle)), flush_secs=10)
        if new:
            self.writer.add_text("config", _code(run.config_yaml, "yaml"), 0)
            self.writer.add_text("env", _code(json.dumps(run.env, indent=2), "json"), 0)
            params = {k: v if isinstance(v, int | float | str | bool) else json.dumps(v)
                      for k, v in run.params().items()}
            for summary in hparams(params, {"val/val_loss": 0.0, "train/loss": 0.0}):
                self.writer.file_writer.add_summary(summary)
        return handle

    def write(self, step: int, walltime: float | None, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step, walltime=walltime)

    def write_rows(self, rows: list[tuple[int, float | None, dict[str, float]]]) -> None:
        for row in rows:
            self.write(*row)

    def finish(self, step: int, walltime: float | None, scalars: dict[str, float],
               status: str | None) -> None:
        self.write(step, walltime, scalars)
        if status is not None:
            from bench.study.report.render import md_text  # the pages' one escaping rule

            self.writer.add_text("status", md_text(status), step, walltime=walltime)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class WandbSink:
    """One W&B run per record (its id kept in tracking.json, so a backfill or a resume
    continues it), in `group` or the sweep's group."""

    name = "wandb"

    def __init__(self, spec: WandbConfig, timeout_s: float = 60.0):
        self.spec, self.timeout_s, self.run = spec, timeout_s, None
        self.exit_code = 0

    def key(self) -> str:
        return f"wandb:{self.spec.entity or ''}/{self.spec.project}"

    def where(self, handle: str) -> str:
        return f"W&B {self.spec.entity + '/' if self.spec.entity else ''}" \
               f"{self.spec.project} run {handle}"

    def open(self, run: TrackedRun, handle: str | None) -> str:
        import secrets

        import wandb

        handle = handle or secrets.token_hex(4)
        mode = self.spec.mode
        base_url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
        if mode == "online" and not reachable(base_url, timeout_s=5.0):
            warn(f"W&B's server {base_url} cannot be reached; {run.name} is written offline "
                 "(upload it later with `wandb sync`)")
            mode = "offline"
        if self.spec.dir:
            Path(self.spec.dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            id=handle, resume="allow", project=self.spec.project, entity=self.spec.entity,
            mode=mode, group=self.spec.group or run.group, name=run.name,
            tags=sorted({run.strategy, *self.spec.tags}), notes=json.dumps(run.env, indent=1),
            config=run.hyperparameters, dir=self.spec.dir, reinit="create_new",
            settings=wandb.Settings(**_known(wandb.Settings, {
                "silent": True, "console": "off", "init_timeout": self.timeout_s,
                "disable_git": True, "save_code": False,
                # no system-metrics sampling beside a benchmark; W&B's private names
                "x_disable_stats": True, "x_save_requirements": False})))
        return handle

    def write_rows(self, rows: list[tuple[int, float | None, dict[str, float]]]) -> None:
        for step, _, scalars in rows:
            self.run.log(scalars, step=step)

    def finish(self, step: int, walltime: float | None, scalars: dict[str, float],
               status: str | None) -> None:
        self.run.summary.update({**scalars, **({"status": status} if status else {})})
        if status == "failed":
            self.exit_code = 1

    def close(self) -> None:
        if self.run is not None:
            self.run.finish(exit_code=self.exit_code)
            self.run = None


_MLFLOW_PARENTS = threading.Lock()  # the runs of one sweep followed in threads of a process


class MlflowSink:
    """One MLflow run per record, a child of its sweep's parent run (tag
    commbench.role=sweep), through MlflowClient (no global active run: sweeps follow
    several runs at once)."""

    name = "mlflow"

    def __init__(self, spec: MlflowConfig):
        uri = spec.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "mlruns"
        if "://" not in uri and not uri.startswith("file:"):
            uri = Path(uri).expanduser().absolute().as_uri()
        self.uri, self.experiment = uri, spec.experiment
        self.client = self.run_id = None

    def key(self) -> str:
        return f"mlflow:{self.uri}#{self.experiment}"

    def where(self, handle: str) -> str:
        return f"MLflow {self.uri} experiment {self.experiment!r} run {handle}"

    def open(self, run: TrackedRun, handle: str | None) -> str:
        if self.uri.startswith("file:"):  # MLflow 3 refuses its file store unless told
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        if handle is not None:
            self.run_id = handle
            return handle
        experiment = self._experiment_id()
        tags = {"commbench.run_dir": str(run.path), "commbench.strategy": run.strategy,
                **{f"env.{k}": str(v)[:5000] for k, v in flatten(run.env).items()}}
        if run.group:
            tags["mlflow.parentRunId"] = self._parent(experiment, run.group)
        created = self.client.create_run(experiment, run_name=run.name, tags=tags)
        self.run_id = created.info.run_id
        params = [Param(k, json.dumps(v) if not isinstance(v, str) else v[:6000])
                  for k, v in run.params().items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_batch(self.run_id, tags=[RunTag("commbench.config_hash",
                                                         str(run.config_hash))])
        return self.run_id

    def _experiment_id(self) -> str:
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(self.experiment)
        except Exception:  # created meanwhile by another run of the sweep
            return self.client.get_experiment_by_name(self.experiment).experiment_id

    def _parent(self, experiment: str, group: str) -> str:
        query = (f"tags.`commbench.role` = 'sweep' and tags.`commbench.sweep` = "
                 f"'{group.replace(chr(39), '')}'")
        with _MLFLOW_PARENTS:
            found = self.client.search_runs([experiment], query, order_by=["start_time ASC"])
            if found:
                return found[0].info.run_id
            parent = self.client.create_run(experiment, run_name=group, tags={
                "commbench.role": "sweep", "commbench.sweep": group})
            self.client.set_terminated(parent.info.run_id, "FINISHED")
            # another process may have made one too: the oldest is the sweep's
            found = self.client.search_runs([experiment], query, order_by=["start_time ASC"])
            return found[0].info.run_id if found else parent.info.run_id

    def write_rows(self, rows: list[tuple[int, float | None, dict[str, float]]]) -> None:
        import time

        from mlflow.entities import Metric

        metrics = [Metric(mlflow_key(k), v, int((t if t is not None else time.time()) * 1000),
                          step) for step, t, scalars in rows for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def finish(self, step: int, walltime: float | None, scalars: dict[str, float],
               status: str | None) -> None:
        self.write_rows([(step, walltime, scalars)])
        if status is not None:
            self.client.set_tag(self.run_id, "commbench.status", status)
            self.client.set_terminated(self.run_id, "FAILED" if status == "failed"
                                       else "FINISHED")

    def close(self) -> None:
        self.client = None


def make_sink(name: str, spec, timeout_s: float = 60.0):
    if name == "tensorboard":
        return TensorBoardSink(spec)
    if name == "wandb":
        return WandbSink(spec, timeout_s)
    if name == "mlflow":
        return MlflowSink(spec)
    raise ValueError(f"unknown sink {name!r}: tensorboard, wandb or mlflow")


# ----------------------------------------------------------------------------- helpers


def mlflow_key(key: str) -> str:
    """MLflow metric names allow letters, digits, _ - . space and /."""
    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", key)


def reachable(url: str, timeout_s: float) -> bool:
    """Whether a TCP connection to the URL's host opens within `timeout_s`."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _known(settings_class, wanted: dict) -> dict:
    """The settings this version of the library has (private ones come and go)."""
    fields = getattr(settings_class, "model_fields", None)
    return wanted if fields is None else {k: v for k, v in wanted.items() if k in fields}


def _code(text: str, language: str) -> str:
    """`text` as a fenced code block of TensorBoard's markdown: the fence is longer than any
    run of backticks inside (a record's text cannot close it and add markup after)."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text}\n{fence}"
