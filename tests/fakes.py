"""Fake run records for tests: a run directory as a finished (or killed) run leaves it,
built with the record schema's own builders (bench/run/summary.py `train_row`, `val_row`).

    from tests.fakes import make_summary, write_fake_run
    run = write_fake_run(tmp_path / "run", config, [train_row(...)], make_summary(...))
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from bench.run.files import write_json, write_text
from bench.run.records import RunDir
from bench.run.summary import Projection, Summary


def make_summary(**fields: Any) -> dict[str, Any]:
    """summary.json content from `Summary`'s fields; `projected` may map profile -> Projection
    or profile -> total seconds (then all compute: comm_s is 0, step_s total / steps)."""
    projected = fields.pop("projected", {}) or {}
    steps, tokens = fields.get("steps", 0), fields.get("total_tokens", 0)
    fields["projected"] = {
        name: p if isinstance(p, Projection) else Projection.of(float(p), float(p), steps, tokens)
        for name, p in projected.items()
    }
    return Summary(**fields).to_dict()


def write_fake_run(path: str | os.PathLike, config: dict | str, rows: list[dict] = (),
                   summary: dict | None = None, torn_tail: str | None = None) -> RunDir:
    """A run directory as a finished (or killed) run leaves it.

    `config` is a config mapping (or YAML text), `rows` the metrics rows in order,
    `summary` the summary.json content (build it with `make_summary`; None = killed before
    writing one), `torn_tail` a partial last metrics line.
    """
    run = RunDir(path)
    run.path.mkdir(parents=True, exist_ok=True)
    if not isinstance(config, str):
        config = yaml.safe_dump(config, sort_keys=False)
    write_text(run.config, config)
    run.write_metrics(list(rows))
    if torn_tail:
        with open(run.metrics, "a") as f:
            f.write(torn_tail)
    if summary is not None:
        write_json(run.summary, summary)
    return run
