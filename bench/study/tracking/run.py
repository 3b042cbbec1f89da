"""A run directory as the tracking sinks see it (`TrackedRun.load`): its config, env,
summary, metrics rows and eval numbers, its sweep's name. Read by bench/study/tracking/sync.py,
which hands it to the sinks (bench/study/tracking/sinks.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from bench.config.typed import check_name, flatten
from bench.run import files
from bench.run.records import RunDir, status_of
from bench.run.summary import nonfinite_loss_steps


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
        from bench.study.report.read import flatten_eval

        run = RunDir(run_dir)
        config_yaml = run.config.read_text() if run.config.exists() else ""
        config = read_yaml(config_yaml)
        env = files.read_json(run.env) if run.env.exists() else {}
        summary = run.read_summary() or {}
        if not isinstance(summary, dict):  # a crafted or garbage record: refused, not sent
            raise ValueError(f"{run.summary} is not a run's summary (a JSON object), got a "
                             f"JSON {type(summary).__name__}; nothing of this run is sent")
        sweep = run.path.parent / "sweep.json"
        sweep_record = files.read_json(sweep) if sweep.exists() else {}
        group = sweep_record.get("name") if isinstance(sweep_record, dict) else None
        if group is not None:  # a folder of the TensorBoard sink, a W&B/MLflow group
            check_name(f"{sweep}: name", group, "the tracker's group of the sweep's runs")
        evals = flatten_eval(summary.get("eval"))
        if not evals and run.eval.exists():
            evals = flatten_eval(files.read_json(run.eval))
        return cls(path=run.path.absolute(), name=run.path.name, group=group, config=config,
                   config_yaml=config_yaml, config_hash=summary.get("config_hash"),
                   strategy=str(summary.get("strategy") or _strategy_name(config)),
                   env=env if isinstance(env, dict) else {}, summary=summary,
                   rows=[r for r in run.read_metrics([]) if isinstance(r, dict) and
                         isinstance(r.get("step"), int)], eval=evals)

    def doubts(self) -> list[str]:
        """What in the rows an ok run cannot hold (each a line to warn with): a loss that is
        not a finite number, a step past the steps the summary records (rows appended after
        the run ended)."""
        if self.status != "ok":
            return []
        out = []
        bad = nonfinite_loss_steps(self.rows)
        if bad:
            out.append(f"{self.path / 'metrics.jsonl'}: a finished ok run with a loss that "
                       f"is not finite (NaN or Infinity) at {bad}: rows "
                       "written after the run? (not sent: sinks take finite numbers only)")
        recorded = self.summary.get("steps")
        if isinstance(recorded, int) and not isinstance(recorded, bool):
            past = [r["step"] for r in self.rows if r["step"] > recorded]
            if past:
                out.append(f"{self.path / 'metrics.jsonl'}: rows at step {max(past)} past the "
                           f"{recorded} steps summary.json records for this ok run: rows "
                           "written after the run?")
        return out

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
        measured seconds (validation and logging excluded, bench/run/meter.py)."""
        try:
            start = datetime.strptime(self.attempt, "%Y-%m-%dT%H:%M:%S%z").timestamp()
        except (TypeError, ValueError):
            return None
        return start + (elapsed_s or 0.0)


def _strategy_name(config: dict) -> str:
    strategy = config.get("strategy")
    return str(strategy.get("name") or "unknown") if isinstance(strategy, dict) else "unknown"


def read_yaml(text: str) -> dict:
    import yaml

    data = yaml.safe_load(text) if text.strip() else {}
    return data if isinstance(data, dict) else {}
