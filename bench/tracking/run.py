"""A run directory as the tracking sinks see it (`TrackedRun.load`): its config, env,
summary, metrics rows and eval numbers, its sweep's name. Read by bench/tracking/sync.py,
which hands it to the sinks (bench/tracking/sinks.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from bench import records
from bench.records import RunDir, status_of
from bench.typed import flatten


@dataclass
class TrackedRun:
    """A run directory as the sinks see it."""

    path: Path
    name: str
    """The run directory's name (RUN)."""
    group: str | None
    """The sweep's name when the run is part of one (SWEEP/sweep.json beside it)."""
    config: dict
    config_yaml: str
    config_hash: str | None
    strategy: str
    env: dict
    summary: dict
    rows: list[dict]
    eval: dict[str, float]

    @classmethod
    def load(cls, run_dir: str | os.PathLike) -> TrackedRun:
        from bench.report.load import _flatten_eval

        run = RunDir(run_dir)
        config_yaml = run.config.read_text() if run.config.exists() else ""
        config = read_yaml(config_yaml)
        env = records.read_json(run.env) if run.env.exists() else {}
        summary = run.read_summary() or {}
        sweep = run.path.parent / "sweep.json"
        group = records.read_json(sweep).get("name") if sweep.exists() else None
        evals = _flatten_eval(summary.get("eval"))
        if not evals and run.eval.exists():
            evals = _flatten_eval(records.read_json(run.eval))
        return cls(path=run.path.absolute(), name=run.path.name, group=group, config=config,
                   config_yaml=config_yaml, config_hash=summary.get("config_hash"),
                   strategy=str(summary.get("strategy") or
                                (config.get("strategy") or {}).get("name") or "unknown"),
                   env=env if isinstance(env, dict) else {}, summary=summary,
                   rows=[r for r in run.read_metrics([]) if isinstance(r, dict) and
                         isinstance(r.get("step"), int)], eval=evals)

    @property
    def attempt(self) -> str | None:
        """When this attempt started (summary.json `started`, written by the launcher)."""
        return self.summary.get("started")

    @property
    def status(self) -> str:
        return status_of(self.summary)

    @property
    def last_step(self) -> int:
        return int(self.summary.get("steps") or max((r["step"] for r in self.rows), default=0))

    @property
    def hyperparameters(self) -> dict:
        """The resolved config without its tracking section (where it is shown, not what ran)."""
        return {k: v for k, v in self.config.items() if k != "tracking"}

    def params(self) -> dict:
        """The hyper-parameters flat: {"optim.lr": 0.001, ...}."""
        return flatten(self.hyperparameters)

    def walltime(self, elapsed_s: float | None) -> float | None:
        """The attempt's start plus the run's clock: a sink's time axis shows the run's own
        measured seconds (validation and logging excluded, bench/meter.py)."""
        try:
            start = datetime.strptime(self.attempt, "%Y-%m-%dT%H:%M:%S%z").timestamp()
        except (TypeError, ValueError):
            return None
        return start + (elapsed_s or 0.0)


def read_yaml(text: str) -> dict:
    import yaml

    data = yaml.safe_load(text) if text.strip() else {}
    return data if isinstance(data, dict) else {}
