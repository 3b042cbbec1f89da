"""Tracking sinks: a run's records shown live in TensorBoard, Weights & Biases or MLflow.

    commbench run configs/ddp-tiny.yaml --set tracking.tensorboard.dir=tb    # live
    commbench track results/quickstart --to mlflow                            # backfill
    tensorboard --logdir tb

The records stay the source of truth; a sink is a view of them. The `tracking:` section
names the sinks; `bench.cli.run_and_evaluate` follows the run (`follow`): a thread of the
launcher on the node of rank 0, not the training processes, reads each new row of
metrics.jsonl and writes it to every sink, then summary.json's numbers when the run ends
and eval.json's after the self-evaluation. Every sink gets the same series: each row's
numbers as `train/KEY` or `val/KEY` (the comm/compute split, bytes, the strategy's
scalars, `train/comm_share` = comm_s / step_s, each network profile's projected clock as
`KIND/projected_elapsed_s/PROFILE`), the resolved config as hyper-parameters, env.json
as tags/notes, and at the end `summary/KEY` and `eval/TASK/METRIC`. A sweep groups its
runs: a W&B group, an MLflow parent run, TensorBoard sub-directories SWEEP/RUN.

A sink that fails (package missing, unwritable directory, network down) warns once and
is dropped: the run goes on and its records are complete; `commbench track` backfills
them later (idempotent: what a sink already holds is not sent again; bench/tracking/sync.py
keeps the account in the run directory's tracking.json).

Packages: `pip install 'commbench[tensorboard]'`, `[wandb]`, `[mlflow]` (mlflow-skinny).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from bench.typed import fail


@dataclass
class TensorBoardConfig:
    dir: str = "tb"
    """Directory of the event files: each run writes DIR/RUN (DIR/SWEEP/RUN in a sweep);
    `tensorboard --logdir DIR` shows them."""


@dataclass
class WandbConfig:
    project: str = "commbench"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); null = the logged-in user's default."""
    mode: Literal["online", "offline"] = "online"
    """online uploads as it goes (if W&B's server cannot be reached within 5 s, the run is
    written offline instead, with a warning); offline writes local files to upload later
    with `wandb sync DIR/wandb/offline-run-*`."""
    group: str | None = None
    """W&B group; null = the sweep's name (no group for a run outside a sweep)."""
    tags: list[str] = field(default_factory=list)
    """Tags added to each run (the strategy's name is always one)."""
    dir: str | None = None
    """Where W&B keeps its local files (DIR/wandb/); null = W&B's default (WANDB_DIR or the
    working directory)."""


@dataclass
class MlflowConfig:
    tracking_uri: str | None = None
    """MLflow tracking URI (http://host:5000, sqlite:///mlflow.db, a directory); null =
    MLFLOW_TRACKING_URI, else the local file store ./mlruns (allowed with
    MLFLOW_ALLOW_FILE_STORE, which commbench sets for a file store)."""
    experiment: str = "commbench"
    """MLflow experiment (created when missing)."""


@dataclass
class TrackingConfig:
    """Where the run is shown besides its records; none by default.

    Not part of the run's identity (bench.config NON_IDENTITY_KEYS): a sink only reads the
    records, from the launcher, after the rows are written; it never enters the training
    processes, so it cannot change what is trained or measured, nor meet a strategy (no
    combination with a strategy, optimizer or network option to refuse or to test). A run
    resumed with other sinks is the same run."""

    tensorboard: TensorBoardConfig | None = None
    """Event files for TensorBoard, e.g. {dir: tb} (needs the tensorboard package)."""
    wandb: WandbConfig | None = None
    """A W&B run per run: {project, entity, mode: online|offline, group, tags, dir}
    (needs wandb)."""
    mlflow: MlflowConfig | None = None
    """An MLflow run per run: {tracking_uri, experiment} (needs mlflow-skinny or mlflow)."""
    poll_s: float = 5.0
    """Seconds between the launcher's reads of new metrics rows (how live the curves are)."""
    timeout_s: float = 60.0
    """Seconds the sinks get to finish after the run (and its evaluation) ended; a sink
    still busy then is left behind with a warning (the records are complete)."""

    def sinks(self) -> dict[str, object]:
        """The configured sinks' configs by sink name."""
        return {name: spec for name in SINK_NAMES
                if (spec := getattr(self, name)) is not None}


SINK_NAMES = ("tensorboard", "wandb", "mlflow")
SINK_CONFIGS = {"tensorboard": TensorBoardConfig, "wandb": WandbConfig, "mlflow": MlflowConfig}


def check_tracking(cfg: TrackingConfig, path: str = "tracking") -> None:
    """Ranges and names (ValueError naming the key); whether a package is installed is not
    checked here: a missing one drops its sink with a warning when the run starts."""
    for key in ("poll_s", "timeout_s"):
        if getattr(cfg, key) <= 0:
            raise fail(f"{path}.{key}", getattr(cfg, key), "> 0 seconds")
    if cfg.tensorboard is not None and not cfg.tensorboard.dir.strip():
        raise fail(f"{path}.tensorboard.dir", cfg.tensorboard.dir, "a directory path")
    if cfg.wandb is not None and not cfg.wandb.project.strip():
        raise fail(f"{path}.wandb.project", cfg.wandb.project, "a W&B project name")
    if cfg.mlflow is not None and not cfg.mlflow.experiment.strip():
        raise fail(f"{path}.mlflow.experiment", cfg.mlflow.experiment,
                   "an MLflow experiment name")

