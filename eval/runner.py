"""Evaluate a finished run with lm-eval: `commbench eval RUN_DIR --suite smoke|paper`.

`self_evaluate` is the same after training (`eval.suite` in the run's config): the
command line calls it once `commbench run` or a sweep's run ends ok.

`evaluate_run` checks everything a user can get wrong (run directory, checkpoint,
config, suite, task names, datasets available) before evaluating, then writes
RUN_DIR/eval.json atomically and puts the key numbers into summary.json under `eval`
(`{"task/metric": value}`). Results of earlier evaluations of other tasks are kept, so
smoke and paper results of one run live side by side; a failure writes nothing.

eval.json:
    lm_eval_version, evaluated_at, last (what the latest call ran),
    tasks: {task: {suite, version, num_fewshot, num_samples, limit, lm_eval_version,
                   step, evaluated_at, metrics: {metric: {value, stderr}}}},
    summary: {"task/metric": value}
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from importlib import metadata
from pathlib import Path

import yaml

from bench.config import Config
from bench.run.files import read_json, write_json
from bench.run.records import RunDir
from eval.lm import CommbenchLM, checkpoint_path
from eval.suites import get_suite, load_tasks, select_tasks


def _read_config(run_dir: Path) -> dict:
    path = RunDir(run_dir).config
    if not path.is_file():
        raise ValueError(f"run directory {str(run_dir)!r} has no config.yaml")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: unreadable YAML ({err})") from err
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a mapping of config sections")
    return config


def _number(value) -> float | None:
    """A metric as a JSON-safe float (None for lm-eval's "N/A" and non-finite values)."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _task_records(results: dict) -> dict[str, dict]:
    """lm-eval's results -> {task: {version, num_fewshot, num_samples, metrics}}.
    A metric is named by lm-eval's metric name, suffixed with ",filter" unless the
    filter is "none"."""
    records = {}
    for task, row in results["results"].items():
        metrics = {}
        for key, value in row.items():
            if "," not in key:
                continue
            metric, filter_name = key.split(",", 1)
            if metric.endswith("_stderr"):
                continue
            name = metric if filter_name == "none" else key
            stderr = row.get(f"{metric}_stderr,{filter_name}")
            metrics[name] = {"value": _number(value), "stderr": _number(stderr)}
        samples = results.get("n-samples", {}).get(task, {})
        records[task] = {
            "version": results.get("versions", {}).get(task),
            "num_fewshot": results.get("n-shot", {}).get(task),
            "num_samples": samples.get("effective"),
            "metrics": metrics,
        }
    return records


@contextlib.contextmanager
def _serial_bootstrap():
    """lm-eval's bootstrapped standard errors in this process (its `DISABLE_MULTIPROC`):
    otherwise it forks a pool from a process whose torch threads may hold a lock at the
    fork, and a forked worker can wait on it for ever (seen: a quickstart sweep hung in
    "bootstrapping for stddev: perplexity"). Serial resampling costs seconds here."""
    before = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["DISABLE_MULTIPROC"]
        else:
            os.environ["DISABLE_MULTIPROC"] = before


def evaluate_run(
    run_dir: str | Path,
    suite: str = "smoke",
    tasks: list[str] | None = None,
    limit: int | None = None,
    batch_size: int = 16,
    device: str = "cpu",
    bootstrap_iters: int | None = None,
) -> dict:
    """Run the suite's tasks (or `tasks`) on the run's evaluation model; returns the new
    eval.json content. `limit` caps examples per task; `bootstrap_iters` overrides the
    suite's resamples for bootstrapped standard errors."""
    from lm_eval import simple_evaluate

    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        # lm-eval returns no results on other local ranks: evaluate in one process.
        raise ValueError("evaluate_run must be called on local rank 0 only")
    check_device(device)
    run_dir = Path(run_dir)
    checkpoint = checkpoint_path(run_dir)
    config = _read_config(run_dir)
    spec = get_suite(suite)
    names = select_tasks(spec, tasks)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"eval.limit must be an integer >= 1 or null, got {limit!r}")
    with RunDir(run_dir).lock("commbench eval"):  # the run's other writers wait for it
        return _evaluate(run_dir, checkpoint, config, spec, suite, names, limit, batch_size,
                         device, bootstrap_iters, simple_evaluate)


def _evaluate(run_dir, checkpoint, config, spec, suite, names, limit, batch_size, device,
              bootstrap_iters, simple_evaluate) -> dict:
    eval_path = RunDir(run_dir).eval
    previous = read_json(eval_path) if eval_path.exists() else {}
    lm = CommbenchLM.from_run(run_dir, batch_size=batch_size, device=device)
    manager, task_objects = load_tasks(spec, names, config.get("data") or {})

    start = time.perf_counter()
    with _serial_bootstrap():
        results = simple_evaluate(
            model=lm,
            tasks=task_objects,
            task_manager=manager,
            limit=limit,
            batch_size=batch_size,
            device=device,
            bootstrap_iters=spec.bootstrap_iters if bootstrap_iters is None else bootstrap_iters,
            log_samples=False,
        )
    seconds = time.perf_counter() - start

    version = metadata.version("lm_eval")
    now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    tasks_out = dict(previous.get("tasks", {}))
    for task, record in _task_records(results).items():
        tasks_out[task] = {
            "suite": suite,
            **record,
            "limit": limit,
            "lm_eval_version": version,
            "step": lm.info.get("step"),
            "evaluated_at": now,
        }
    summary = {
        f"{task}/{metric}": value["value"]
        for task, record in sorted(tasks_out.items())
        for metric, value in record["metrics"].items()
    }
    out = {
        "lm_eval_version": version,
        "evaluated_at": now,
        "last": {
            "suite": suite,
            "tasks": names,
            "limit": limit,
            "batch_size": batch_size,
            "device": device,
            "checkpoint": str(checkpoint.relative_to(run_dir)),
            "seconds": round(seconds, 3),
        },
        "tasks": tasks_out,
        "summary": summary,
    }
    write_json(eval_path, out)
    RunDir(run_dir).update_summary({"eval": summary})
    return out


def check_device(device: str) -> None:
    """ValueError naming --device unless `device` exists here: cpu, or cuda[:N] with
    such a GPU visible."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"eval --device must be cpu or cuda[:N], got {device!r}") from None
    if parsed.type == "cpu":
        return
    count = torch.cuda.device_count() if parsed.type == "cuda" else 0
    if parsed.type != "cuda" or (parsed.index or 0) >= count:
        raise ValueError(f"eval --device {device!r} does not exist here: this machine has "
                         f"{count} CUDA device{'s' * (count != 1)} (valid: cpu"
                         + (f", cuda:0 to cuda:{count - 1})" if count else ")"))


def eval_device(cfg: Config) -> str:
    """Where a run's self-evaluation runs: the device the run trained on (its first GPU:
    `launch.cuda_visible_devices`' first, numbered as this process sees it), else CPU."""
    from bench.config.preflight import runs_on_cuda

    if not runs_on_cuda(cfg):
        return "cpu"
    chosen = cfg.launch.cuda_visible_devices
    if not chosen:
        return "cuda"
    first = chosen.split(",")[0].strip()
    mine = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [d.strip() for d in mine.split(",")] if mine else None
    if visible is not None and first in visible:
        return f"cuda:{visible.index(first)}"
    return f"cuda:{first}" if first.isdigit() else "cuda"


def self_evaluate(cfg: Config, run_dir: str | Path) -> dict:
    """Evaluate a run that just trained with its config's `eval` section, on the run's
    device (`eval_device`); returns its summary.json. lm-eval's chatter goes to
    logs/eval.log, not the terminal; a failure is recorded as `eval_error` (the training
    record stays valid), never raised."""
    run = RunDir(run_dir)
    run.logs.mkdir(parents=True, exist_ok=True)
    with open(run.eval_log, "a") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        root = logging.getLogger()
        saved = root.handlers[:]
        root.handlers = [logging.StreamHandler(log)]
        try:
            evaluate_run(run.path, suite=cfg.eval.suite, tasks=cfg.eval.tasks or None,
                         limit=cfg.eval.limit, batch_size=cfg.eval.batch_size,
                         device=eval_device(cfg))
        except Exception as err:
            return run.update_summary(
                {"eval_error": f"{type(err).__name__}: {err} (see {run.eval_log})"})
        finally:
            root.handlers = saved
    return run.read_summary()
