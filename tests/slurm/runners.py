"""Runners for Slurm jobs in tests/slurm, imported by name inside the jobs (bench.jobentry).

`instant_runner` writes a finished record in milliseconds. `hanging_runner` is the real
launcher (bench.launch.run_config), except that runs whose name is listed in
COMMBENCH_TEST_HANG (comma-separated; the variable reaches the jobs through sbatch's
environment export) start, record status running, and hang until Slurm ends them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench import records
from bench.config import config_hash, to_yaml
from bench.launch import run_config


def _head(cfg) -> dict:
    return {"run_name": cfg.run.name, "config_hash": config_hash(cfg),
            "strategy": cfg.strategy.name, "world_size": cfg.parallel.world_size}


def instant_runner(cfg, run_dir, progress=True) -> dict:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    records.write_text(run_dir / "config.yaml", to_yaml(cfg))
    summary = {**_head(cfg), "status": "ok", "steps": cfg.run.steps}
    records.write_json(run_dir / "summary.json", summary)
    return summary


def hanging_runner(cfg, run_dir, progress=True) -> dict:
    if cfg.run.name in os.environ.get("COMMBENCH_TEST_HANG", "").split(","):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        records.write_text(run_dir / "config.yaml", to_yaml(cfg))
        records.write_json(run_dir / "summary.json", {**_head(cfg), "status": "running"})
        time.sleep(3600)
    return run_config(cfg, run_dir, progress=progress)
