"""Sweep specs, run identity, resume, failure isolation and executors, with a fake runner.

The fake runner (`fake_runner`, module level so that submitit jobs can import it) writes
the files a real run writes (config.yaml, metrics.jsonl, summary.json) in milliseconds.
Environment variables steer it, so they reach submitit's job processes too:
FAKE_RUNNER_LOG (append one line per training), FAKE_RUNNER_FAIL (comma-separated run
names that end with status failed) and FAKE_RUNNER_RAISE (run names whose launcher raises).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from algorithms.base import STRATEGIES, DataParallelStrategy, StrategyConfig
from bench.config import config_hash, to_yaml
from bench.launch import run as launch
from bench.run import files, records
from bench.run.records import RunDir
from bench.run.summary import train_row, val_row
from bench.study.sweep import load_spec, run_sweep
from bench.study.sweep.store import record_state, retire
from tests.fakes import make_summary, write_fake_run

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent

BASE = {
    "run": {"name": "base", "steps": 40, "log_every": 10, "val_every": 20},
    "model": {"preset": "tiny", "seq_len": 32},
    "data": {"corpus": "embedded", "batch_size": 4},
    "parallel": {"world_size": 2},
    "strategy": {"name": "ddp", "backend": "torch"},
}


# ------------------------------------------------------------------------- fake runner


def _names(var: str) -> set[str]:
    return {n for n in os.environ.get(var, "").split(",") if n}


def fake_runner(cfg, run_dir, progress=True) -> dict:
    if os.environ.get("FAKE_RUNNER_LOG"):
        with open(os.environ["FAKE_RUNNER_LOG"], "a") as f:
            f.write(f"{cfg.run.name} {cfg.run.seed}\n")
    head = {"run_name": cfg.run.name, "config_hash": config_hash(cfg),
            "strategy": cfg.strategy.name, "world_size": cfg.parallel.world_size}
    if cfg.run.name in _names("FAKE_RUNNER_RAISE"):
        write_fake_run(run_dir, to_yaml(cfg))
        raise RuntimeError("launcher crashed")
    if cfg.run.name in _names("FAKE_RUNNER_FAIL"):
        summary = make_summary(**head, status="failed", error="RuntimeError: boom at step 3")
        write_fake_run(run_dir, to_yaml(cfg), summary=summary)
        return summary
    speed = 1.0 if cfg.strategy.name == "ddp" else 2.0
    tokens_per_step = 100
    rows = []
    for step in range(10, cfg.run.steps + 1, 10):
        clock = (step, step * tokens_per_step, step / speed, {})
        loss = 5.0 - step / 20 + 0.01 * cfg.run.seed
        rows.append(train_row(*clock, lr=1e-3, loss=loss, step_s=1 / speed,
                              compute_s=1 / speed, comm_s=0.0, comm_bytes=0))
        if step % 20 == 0:
            rows.append(val_row(*clock, val_loss=loss))
    steps = cfg.run.steps
    summary = make_summary(**head, status="ok", steps=steps,
                           total_tokens=steps * tokens_per_step, wall_s=steps / speed,
                           final_val_loss=5.0 - steps / 20)
    write_fake_run(run_dir, to_yaml(cfg), rows, summary)
    return summary


def hanging_runner(cfg, run_dir, progress=True) -> dict:
    """Trains like fake_runner, but the third run hangs after starting (to be killed)."""
    log = Path(os.environ["FAKE_RUNNER_LOG"])
    if log.exists() and len(log.read_text().splitlines()) == 2:
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True)
        files.write_text(run_dir / "config.yaml", to_yaml(cfg))
        files.write_json(run_dir / "summary.json", {"status": "running"})
        (run_dir / "metrics.jsonl").write_text('{"step": 10, "loss": 4.5}\n{"step": 2')
        time.sleep(600)
    return fake_runner(cfg, run_dir, progress)


def _trained(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def env(tmp_path, monkeypatch):
    log = tmp_path / "trained.log"
    monkeypatch.setenv("FAKE_RUNNER_LOG", str(log))
    monkeypatch.delenv("FAKE_RUNNER_FAIL", raising=False)
    monkeypatch.delenv("FAKE_RUNNER_RAISE", raising=False)
    # submitit's job processes import this module by name, and `bench` from the repo
    paths = [str(TESTS_DIR), str(REPO), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    return log


def write_spec(tmp_path: Path, body: dict, name: str = "spec.yaml") -> Path:
    body = {"output_dir": str(tmp_path / "results"), "report_dir": str(tmp_path / "report"),
            **body}
    if "base" not in body:
        (tmp_path / "base.yaml").write_text(yaml.safe_dump(BASE))
        body["base"] = "base.yaml"
    path = tmp_path / name
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


# A second strategy with its own knobs, so that these tests do not depend on which
# algorithms are registered yet.
@dataclass
class ToyConfig(StrategyConfig):
    name: str = "toy"
    inner_steps: int = 10
    """Local steps between synchronisations."""


class Toy(DataParallelStrategy):
    Config = ToyConfig


@pytest.fixture
def toy_strategy(monkeypatch):
    monkeypatch.setitem(STRATEGIES, "toy", f"{__name__}:Toy")


TWO_VARIANTS = {"ddp": {"strategy.name": "ddp"},
                "toy-H5": {"strategy.name": "toy", "strategy.inner_steps": 5}}


# ---------------------------------------------------------------------------- expansion


def test_grid_zip_seeds_and_variants_expand_to_their_product(tmp_path, toy_strategy):
    spec = load_spec(write_spec(tmp_path, {
        "name": "expand",
        "grid": {"optim.lr": [1e-3, 3e-3]},
        "zip": {"data.batch_size": [4, 8], "optim.warmup_steps": [5, 10]},
        "seeds": [0, 1],
        "variants": TWO_VARIANTS,
    }))
    runs = spec.runs
    assert len(runs) == 2 * 2 * 2 * 2
    assert len({r.run_id for r in runs}) == len(runs)
    assert [r.seed for r in runs] == [0] * 8 + [1] * 8  # seeds outermost
    zipped = {(r.config.data.batch_size, r.config.optim.warmup_steps) for r in runs}
    assert zipped == {(4, 5), (8, 10)}
    toy = [r for r in runs if r.variant == "toy-H5"]
    assert all(r.config.strategy.name == "toy" and r.config.strategy.inner_steps == 5
               for r in toy)
    assert all(r.config.run.name == r.variant for r in runs)
    assert runs[1].label == "toy-H5 lr=0.001 batch_size=4 warmup_steps=5"
    assert all(r.config.run.steps == 40 for r in runs)  # the base file's value
    assert spec.sweep_dir == tmp_path / "results" / "expand"


def test_switching_strategy_drops_the_base_strategy_knobs(tmp_path, toy_strategy):
    # the base sets strategy.backend, which the toy strategy does not have
    spec = load_spec(write_spec(tmp_path, {"variants": TWO_VARIANTS}))
    ddp, toy = spec.runs
    assert ddp.config.strategy.backend == "torch"
    assert not hasattr(toy.config.strategy, "backend")
    # the same when the switch comes from the spec's set or from --set
    for body, overrides in (({"set": {"strategy.name": "toy"}}, ()),
                            ({}, ["strategy.name=toy", "strategy.inner_steps=3"])):
        (run,) = load_spec(write_spec(tmp_path, body), overrides=overrides).runs
        assert run.config.strategy.name == "toy" and not hasattr(run.config.strategy, "backend")


def test_inline_base_set_and_default_name(tmp_path):
    spec = load_spec(write_spec(tmp_path, {"base": BASE, "set": {"run.steps": 7}},
                                name="my-sweep.yaml"))
    (run,) = spec.runs
    assert spec.name == "my-sweep"
    assert run.config.run.steps == 7 and run.config.run.name == "base"
    assert run.dir_name == f"base-{run.run_id}"


def test_run_ids_are_stable_across_processes(tmp_path, env):
    path = write_spec(tmp_path, {"grid": {"optim.lr": [1e-3, 2e-3]}, "seeds": [0, 1],
                                 "variants": {"a": {"optim.weight_decay": 0.0},
                                              "b": {"optim.weight_decay": 0.1}}})
    here = [(r.run_id, r.variant, r.seed) for r in load_spec(path).runs]
    code = ("import json, sys; from bench.study.sweep import load_spec; "
            "print(json.dumps([(r.run_id, r.variant, r.seed) "
            "for r in load_spec(sys.argv[1]).runs]))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "123"})
    assert [tuple(r) for r in json.loads(out.stdout)] == here


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("body, message", [
    ({"gird": {"optim.lr": [1]}}, "unknown config key 'gird' (did you mean 'grid'?)"),
    ({"grid": {}}, "grid is empty"),
    ({"grid": {"optim.lr": []}}, "grid.optim.lr has no values"),
    ({"grid": {"optim.lr": 0.1}}, "grid.optim.lr must be a list of values"),
    ({"grid": {"optim.lr": [1e-3]}, "zip": {"optim.lr": [1e-3]}},
     "'optim.lr' is set twice: in grid and in zip"),
    ({"grid": {"optim": [{"lr": 1e-3}]}, "variants": {"x": {"optim.lr": 1e-3}}},
     "'optim' and 'optim.lr' is set twice"),
    ({"seeds": [0], "grid": {"run.seed": [1, 2]}}, "'run.seed' is set twice"),
    ({"zip": {"optim.lr": [1e-3, 2e-3], "optim.warmup_steps": [1]}},
     "must have the same length"),
    ({"variants": {"pier": {"strategy.name": "nosuch"}}},
     "run (variant 'pier'): strategy.name must be one of"),
    ({"variants": {"x": {"optim.lrr": 1.0}}}, "unknown config key 'optim.lrr'"),
    ({"base": "missing.yaml"}, "base config 'missing.yaml' not found"),
    ({"seeds": 3}, "seeds must be a non-empty list of integers"),
    ({"variants": {"a b": {}}}, "variant name must be"),
    ({"executor": {"name": "slurm", "partiton": "gpu"}},
     "unknown config key 'executor.partiton' (did you mean 'partition'?)"),
    ({"executor": {"name": "kubernetes"}},
     "executor.name must be one of ['local', 'slurm'], got 'kubernetes'"),
    ({"executor": {"max_parallel": "2"}}, "executor.max_parallel must be an integer, got '2'"),
    ({"variants": {"a": {}, "b": {"run.name": "a"}}}, "resolve to the same config"),
])
def test_bad_specs_fail_with_a_clear_message(tmp_path, body, message):
    with pytest.raises(ValueError) as err:
        load_spec(write_spec(tmp_path, body))
    assert message in str(err.value)
    assert "spec.yaml" in str(err.value)


SHIPPED_SPECS = [REPO / "configs" / "quickstart.yaml",
                 *sorted((REPO / "configs" / "sweeps").glob("*.yaml"))]


@pytest.mark.parametrize("path", SHIPPED_SPECS, ids=lambda p: p.name)
def test_shipped_sweep_specs_are_valid(path):
    variants = yaml.safe_load(path.read_text())["variants"].values()
    names = {v["strategy.name"] for v in variants if "strategy.name" in v}
    missing = names - set(STRATEGIES)
    if missing:
        pytest.skip(f"strategies not registered yet: {sorted(missing)}")
    spec = load_spec(path)
    assert spec.runs and len({r.run_id for r in spec.runs}) == len(spec.runs)


PLAN = {"name": "plan", "base": {"model": {"preset": "tiny", "seq_len": 32},
                                  "data": {"tokenizer": "byte", "batch_size": 4}},
        "hardware": {"compute_s_per_step": 0.05},
        "world": {"replicas": 2, "gpus_per_replica": 1, "gpus_per_node": 1},
        "network": {"profile": "eth-10g", "model": "gloo", "points": 3},
        "tokens": 1.0e+5, "methods": {"ddp": {"strategy": {"name": "ddp"}}}}
"""A what-if scenario that evaluates in about a second (a spec's `whatif:`)."""


@pytest.mark.parametrize("value, scenario, message", [
    ("missing.yaml", None, "whatif scenario 'missing.yaml' not found (looked for"),
    (3, None, "whatif must be a what-if scenario path"),
    ("plan.yaml", {"world": {"replicas": 0}}, "whatif scenario 'plan.yaml': world.replicas"),
    ("plan.yaml", {"methods": {"x": {"strategy": {"name": "nosuch"}}}},
     "whatif scenario 'plan.yaml': methods.x: strategy.name must be one of"),
])
def test_a_specs_whatif_scenario_is_checked_when_it_loads(tmp_path, value, scenario, message):
    if scenario is not None:
        (tmp_path / "plan.yaml").write_text(yaml.safe_dump({**PLAN, **scenario}))
    with pytest.raises(ValueError) as err:
        load_spec(write_spec(tmp_path, {"whatif": value}))
    assert message in str(err.value) and "spec.yaml" in str(err.value)


def test_a_specs_whatif_scenario_goes_into_the_sweeps_report(tmp_path, env):
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans" / "plan.yaml").write_text(yaml.safe_dump(PLAN))
    path = write_spec(tmp_path, {"name": "w", "whatif": "plans/plan.yaml"})
    assert load_spec(path).whatif == tmp_path / "plans" / "plan.yaml"
    assert load_spec(write_spec(tmp_path, {"name": "w"}, "plain.yaml")).whatif is None
    result = run_sweep(path, runner=fake_runner)
    md = (tmp_path / "report" / "report.md").read_text()
    assert result.ok and "## What-if: plan (at 400 Gbit/s)" in md
    assert "| ddp | 2 |" in md  # the method's row: 2 GPUs


def test_missing_spec_file(tmp_path):
    with pytest.raises(ValueError, match="sweep spec not found"):
        load_spec(tmp_path / "nope.yaml")


# ------------------------------------------------------------------- running and resume


def test_dry_run_lists_runs_and_launches_nothing(tmp_path, env, capsys):
    path = write_spec(tmp_path, {"name": "dry", "seeds": [0, 1],
                                 "variants": {"a": {"optim.lr": 1e-3}, "b": {"optim.lr": 2e-3}}})
    result = run_sweep(path, dry_run=True, runner=fake_runner)
    out = capsys.readouterr().out
    assert result.dry_run and len(result.outcomes) == 4
    assert all(o.status == "new" for o in result.outcomes)
    for outcome in result.outcomes:
        assert outcome.run.run_id in out
    assert "optim.lr=0.002" in out
    assert not _trained(env)
    assert not (tmp_path / "results").exists()


def test_sweep_runs_all_then_rerun_does_no_training_and_is_fast(tmp_path, env):
    path = write_spec(tmp_path, {"name": "s", "seeds": [0, 1],
                                 "variants": {"a": {"optim.lr": 1e-3}, "b": {"optim.lr": 2e-3}}})
    result = run_sweep(path, runner=fake_runner, report=False)
    assert result.ok and result.count("ok") == 4 and result.num_launched == 4
    assert len(_trained(env)) == 4
    sweep = json.loads((tmp_path / "results" / "s" / "sweep.json").read_text())
    for outcome in result.outcomes:
        assert outcome.run_dir.name == f"{outcome.run.variant}-{outcome.run.run_id}"
        entry = sweep["runs"][outcome.run.run_id]
        assert (entry["variant"], entry["seed"]) == (outcome.run.variant, outcome.run.seed)

    again = run_sweep(path, runner=fake_runner, report=False)
    assert again.num_launched == 0 and again.count("ok") == 4
    assert len(_trained(env)) == 4


def test_output_dir_and_set_from_the_command_line(tmp_path, env):
    path = write_spec(tmp_path, {"name": "o", "set": {"run.steps": 30},
                                 "variants": {"a": {"optim.lr": 1e-3}}})
    result = run_sweep(path, runner=fake_runner, report=False, output_dir=tmp_path / "else",
                       overrides=["run.steps=20", "optim.warmup_steps=2"])
    (outcome,) = result.outcomes
    assert outcome.run_dir.parent == tmp_path / "else" / "o"
    assert not (tmp_path / "results").exists()
    cfg = outcome.run.config
    assert (cfg.run.steps, cfg.optim.warmup_steps) == (20, 2)  # --set wins over the spec's set
    plain = load_spec(path).runs[0]
    assert plain.run_id != outcome.run.run_id and plain.config.run.steps == 30


def test_one_failing_run_does_not_stop_the_sweep(tmp_path, env, monkeypatch):
    monkeypatch.setenv("FAKE_RUNNER_FAIL", "bad")
    monkeypatch.setenv("FAKE_RUNNER_RAISE", "crash")
    path = write_spec(tmp_path, {"name": "f", "variants": {
        "bad": {"optim.lr": 1e-3}, "crash": {"optim.lr": 2e-3}, "good": {"optim.lr": 3e-3}}})
    result = run_sweep(path, runner=fake_runner, report=False)
    status = {o.run.variant: o.status for o in result.outcomes}
    assert status == {"bad": "failed", "crash": "failed", "good": "ok"}
    assert not result.ok
    crash = next(o for o in result.outcomes if o.run.variant == "crash")
    summary = records.read_summary(crash.run_dir)
    assert summary["status"] == "failed" and "launcher crashed" in summary["error"]
    assert (crash.run_dir / "config.yaml").exists()

    # failed runs are kept: a plain re-run trains nothing
    again = run_sweep(path, runner=fake_runner, report=False)
    assert again.num_launched == 0 and again.count("failed") == 2

    # --retry-failed moves the old records aside and trains them again
    monkeypatch.setenv("FAKE_RUNNER_FAIL", "")
    monkeypatch.setenv("FAKE_RUNNER_RAISE", "")
    retried = run_sweep(path, runner=fake_runner, report=False, retry_failed=True)
    assert retried.ok and retried.num_launched == 2
    retired = sorted(p.name for p in (tmp_path / "results" / "f" / "_retired").iterdir())
    assert retired == sorted(f"{o.run_dir.name}.1" for o in retried.outcomes
                             if o.run.variant in ("bad", "crash"))
    old = records.read_summary(tmp_path / "results" / "f" / "_retired" / retired[0])
    assert old["status"] == "failed"


def test_resume_after_a_killed_sweep_completes_only_the_missing_runs(tmp_path, env):
    path = write_spec(tmp_path, {"name": "k", "seeds": [0, 1],
                                 "variants": {"a": {"optim.lr": 1e-3}, "b": {"optim.lr": 2e-3}}})
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(TESTS_DIR)!r}, {str(REPO)!r}]
        import test_sweep
        from bench.study.sweep import run_sweep
        run_sweep({str(path)!r}, runner=test_sweep.hanging_runner, report=False)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    sweep_dir = tmp_path / "results" / "k"
    deadline = time.time() + 60
    while time.time() < deadline and len(list(sweep_dir.glob("*/metrics.jsonl"))) < 3:
        time.sleep(0.1)
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(_trained(env)) == 2
    states = sorted(record_state(d) for d in sweep_dir.iterdir() if d.is_dir())
    assert states == ["ok", "ok", "partial"]

    result = run_sweep(path, runner=fake_runner, report=False)
    assert result.ok and result.count("ok") == 4 and result.num_launched == 2
    assert len(_trained(env)) == 4  # the killed run and the one never started
    (killed,) = (sweep_dir / "_retired").iterdir()
    assert (killed / "config.yaml").exists()  # moved aside, never deleted


resumed: list[tuple[str, bool, str]] = []


def resuming_runner(cfg, run_dir, progress=True, resume=False) -> dict:
    """fake_runner, noting (run name, resume, run dir): what the sweep asked for."""
    resumed.append((cfg.run.name, resume, str(run_dir)))
    return fake_runner(cfg, run_dir, progress)


def _stop(run_dir: Path, checkpoint_step: int | None, world_size: int = 2,
          dcp: bool = False) -> None:
    """Leave a run as a stop leaves it: interrupted, with every rank's state at a step
    (`dcp`: a torch.distributed.checkpoint directory, else the older per-rank files)."""
    import shutil

    from tests.test_bad_input import dcp_checkpoint

    run = RunDir(run_dir)
    run.update_summary({"status": "failed", "interrupted": True, "error": "stopped by SIGTERM",
                        "steps": checkpoint_step, "attempts": [{"job_id": None}]})
    for stale in run.state_files():
        stale.unlink()
    for _, stale in run.state_dirs():
        shutil.rmtree(stale)
    if checkpoint_step and dcp:
        for name, content in dcp_checkpoint(checkpoint_step, world_size).items():
            path = run.path / name.removeprefix("r/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
        return
    for rank in range(world_size if checkpoint_step else 0):
        run.save_torch({"step": checkpoint_step}, run.state_checkpoint(rank))


@pytest.mark.parametrize("dcp", [True, False], ids=["dcp", "per-rank"])
def test_a_stopped_run_continues_from_its_checkpoint_in_its_own_directory(tmp_path, env,
                                                                        capsys, dcp):
    """Issue 25: a stopped run with every rank's checkpoint is resumed in place (the
    runner gets resume=True, as `commbench run --resume`); one without is trained from step
    0 after its record is moved aside, and the sweep says why; --status shows both."""
    from bench.study.sweep import sweep_status

    path = write_spec(tmp_path, {"name": "s", "variants": {"a": {"optim.lr": 1e-3},
                                                           "b": {"optim.lr": 2e-3},
                                                           "c": {"optim.lr": 3e-3}}})
    first = run_sweep(path, runner=fake_runner, report=False)
    dirs = {o.run.variant: o.run_dir for o in first.outcomes}
    _stop(dirs["a"], 20, dcp=dcp)
    _stop(dirs["b"], None, dcp=dcp)
    capsys.readouterr()
    rows = {r["variant"]: r for r in sweep_status(path)}
    assert rows["a"]["state"] == "stopped, resumes from step 20"
    assert rows["b"]["state"] == "stopped, no checkpoint" and rows["c"]["state"] == "ok"
    assert rows["a"]["attempts"] == 1 and rows["a"]["last_step"] == 20
    assert "resumes from step 20" in capsys.readouterr().out
    assert not _trained(env)[3:]  # --status started nothing

    resumed.clear()
    again = run_sweep(path, runner=resuming_runner, report=False)
    assert again.ok and again.num_launched == 2
    assert sorted(resumed) == [("a", True, str(dirs["a"])), ("b", False, str(dirs["b"]))]
    (retired,) = (tmp_path / "results" / "s" / "_retired").iterdir()
    assert retired.name.startswith(dirs["b"].name)  # only b's record was moved aside
    err = capsys.readouterr().err
    assert "no checkpoint was saved; trains from step 0" in err and "resuming ->" in err
    assert {r["state"] for r in sweep_status(path)} == {"ok"}


def test_retry_failed_resumes_a_failed_run_from_its_checkpoint(tmp_path, env):
    path = write_spec(tmp_path, {"name": "f"})
    (outcome,) = run_sweep(path, runner=fake_runner, report=False).outcomes
    _stop(outcome.run_dir, 30)
    RunDir(outcome.run_dir).update_summary({"interrupted": False})  # failed, not stopped
    resumed.clear()
    assert run_sweep(path, runner=resuming_runner, report=False).num_launched == 0
    assert run_sweep(path, runner=resuming_runner, report=False, retry_failed=True).ok
    assert resumed == [("base", True, str(outcome.run_dir))]


def wait_for_ctrl_c(run_dir: Path, press=lambda: False) -> None:
    """Block like a training run (after a Ctrl-C to this process if `press()`); on Ctrl-C,
    do what bench.launch.run.run_config does: record the run as interrupted, re-raise."""
    try:
        if press():
            os.kill(os.getpid(), signal.SIGINT)  # reaches the main thread only
        for _ in range(200):
            time.sleep(0.05)
    except KeyboardInterrupt:
        records.update_summary(run_dir, {"status": "failed", "error": "interrupted by the user",
                                         "interrupted": True})
        raise
    raise AssertionError("no Ctrl-C reached this run")


def test_ctrl_c_stops_the_sweep_and_leaves_the_run_to_redo(tmp_path, env):
    def interrupted_runner(cfg, run_dir, progress=True):
        fake_runner(cfg, run_dir, progress)
        wait_for_ctrl_c(run_dir, press=lambda: True)

    path = write_spec(tmp_path, {"name": "c", "variants": {"a": {"optim.lr": 1e-3},
                                                           "b": {"optim.lr": 2e-3}}})
    with pytest.raises(KeyboardInterrupt):
        run_sweep(path, runner=interrupted_runner, report=False)
    assert len(_trained(env)) == 1  # the sweep stopped after the interrupted run
    (run_dir,) = (d for d in (tmp_path / "results" / "c").iterdir() if d.is_dir())
    assert record_state(run_dir) == "partial"
    result = run_sweep(path, runner=fake_runner, report=False)
    assert result.ok and result.num_launched == 2


def test_ctrl_c_reaches_the_runs_in_flight_of_a_parallel_sweep(tmp_path, env):
    both_running = threading.Barrier(2, timeout=10)

    def interrupted_runner(cfg, run_dir, progress=True):
        """Both runs in flight, then Ctrl-C: the main thread gets the KeyboardInterrupt,
        and each run's torchrun, killed by the terminal's SIGINT, exits non-zero."""
        fake_runner(cfg, run_dir, progress)
        if both_running.wait() == 0:
            os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
        return records.update_summary(run_dir, {"status": "failed",
                                                "error": "torchrun exited with code -2"})

    path = write_spec(tmp_path, {"name": "pc", "seeds": [0, 1, 2],
                                 "executor": {"name": "local", "max_parallel": 2}})
    with pytest.raises(KeyboardInterrupt):
        run_sweep(path, runner=interrupted_runner, report=False)
    assert len(_trained(env)) == 2  # the third run was never started
    sweep_dir = tmp_path / "results" / "pc"
    assert [record_state(d) for d in sweep_dir.iterdir() if d.is_dir()] == ["partial"] * 2
    result = run_sweep(path, runner=fake_runner, report=False)
    assert result.ok and result.num_launched == 3


def test_a_second_ctrl_c_in_the_real_launcher_stops_torchrun_at_once(tmp_path, env,
                                                                      monkeypatch):
    """The first Ctrl-C asks the ranks to checkpoint and stop (bench/run/stop.py); the second
    kills torchrun (and its ranks) at once, and the run is recorded interrupted."""
    # bench.launch.run.run_config, with torchrun replaced by a child that only waits
    marker = tmp_path / "child.pid"
    child = [sys.executable, "-c", "import os, sys, time; open(sys.argv[1] + '.tmp', 'w')"
             ".write(str(os.getpid())); os.rename(sys.argv[1] + '.tmp', sys.argv[1]); "
             "time.sleep(120)", str(marker)]
    monkeypatch.setattr(launch, "torchrun_command", lambda cfg, run_dir: child)

    def ctrl_c_once_the_child_runs():
        deadline = time.time() + 30
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.05)
        if marker.exists():
            os.kill(os.getpid(), signal.SIGINT)  # relayed to the (absent) ranks
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGINT)

    path = write_spec(tmp_path, {"name": "rc"})
    threading.Thread(target=ctrl_c_once_the_child_runs, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        run_sweep(path, report=False)  # the default runner: run_config
    with pytest.raises(ProcessLookupError):
        os.kill(int(marker.read_text()), 0)  # terminated and reaped
    (run_dir,) = (d for d in (tmp_path / "results" / "rc").iterdir() if d.is_dir())
    summary = records.read_summary(run_dir)
    assert summary["status"] == "failed" and summary["interrupted"] is True
    assert summary["error"] == "interrupted by the user"
    assert record_state(run_dir) == "partial"
    result = run_sweep(path, runner=fake_runner, report=False)
    assert result.ok and result.num_launched == 1


HOLD_SWEEP = """\
import sys, time
from bench.study.sweep.store import sweep_lock
from pathlib import Path
with sweep_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_second_sweep_process_on_the_same_directory_is_refused(tmp_path, env):
    path = write_spec(tmp_path, {"name": "l"})
    sweep_dir = tmp_path / "results" / "l"
    sweep_dir.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLD_SWEEP, str(sweep_dir)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "held\n"
        with pytest.raises(ValueError, match=r"in use by commbench sweep \(pid "
                                             rf"{proc.pid} on host"):
            run_sweep(path, runner=fake_runner, report=False)
        assert not _trained(env)
    finally:
        proc.kill()
        proc.wait()
    assert run_sweep(path, runner=fake_runner, report=False).ok  # the kernel freed the lock


def test_a_sweep_lock_that_is_a_directory_is_named(tmp_path, env):
    """Issue 29: a .sweep.lock that is a directory ended the sweep in a traceback."""
    path = write_spec(tmp_path, {"name": "l"})
    (tmp_path / "results" / "l" / ".sweep.lock").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"\.sweep\.lock is a directory; remove it"):
        run_sweep(path, runner=fake_runner, report=False)
    assert not _trained(env)


def test_a_sweep_never_moves_a_record_another_process_writes(tmp_path, env, monkeypatch):
    """Issue 29: a sweep retired a run directory while a hand `--resume` trained it (the
    resume then wrote its error into the sweep's new record). A held record stops the
    sweep before any record moves; the same sweep goes on once the holder is gone."""
    from tests.test_crash_safety import held_by_another_process

    path = write_spec(tmp_path, {"name": "h", "variants": {"a": {"optim.lr": 0.001},
                                                           "b": {"optim.lr": 0.002}}})
    monkeypatch.setenv("FAKE_RUNNER_FAIL", "a,b")
    first = run_sweep(path, runner=fake_runner, report=False)
    assert first.count("failed") == 2
    monkeypatch.setenv("FAKE_RUNNER_FAIL", "")
    held = max(o.run_dir for o in first.outcomes)  # the second to retire: nothing moves
    before = sorted(p.name for p in (tmp_path / "results" / "h").iterdir())
    with held_by_another_process(held, "commbench run --resume") as proc:
        with pytest.raises(records.Busy, match=rf"run directory {held} is in use by commbench "
                                               rf"run --resume \(pid {proc.pid}"):
            run_sweep(path, runner=fake_runner, report=False, retry_failed=True)
        with pytest.raises(records.Busy):  # a holder that starts after the check
            retire(held, tmp_path / "results" / "h")
    assert sorted(p.name for p in (tmp_path / "results" / "h").iterdir()) == before
    assert len(_trained(env)) == 2  # the first sweep's two runs only
    assert run_sweep(path, runner=fake_runner, report=False, retry_failed=True).ok


def test_local_executor_runs_several_at_once(tmp_path, env):
    both_running = threading.Barrier(2, timeout=10)  # broken unless two runs overlap
    calls = itertools.count()

    def overlapping_runner(cfg, run_dir, progress=True):
        if next(calls) < 2:
            both_running.wait()
        return fake_runner(cfg, run_dir, progress)

    path = write_spec(tmp_path, {"name": "p", "seeds": [0, 1, 2],
                                 "executor": {"name": "local", "max_parallel": 2}})
    result = run_sweep(path, runner=overlapping_runner, report=False)
    assert result.ok and result.count("ok") == 3


def test_slurm_path_with_submitits_local_executor(tmp_path, env, monkeypatch):
    monkeypatch.setenv("FAKE_RUNNER_FAIL", "b")
    path = write_spec(tmp_path, {"name": "slurm", "variants": {"a": {"optim.lr": 1e-3},
                                                               "b": {"optim.lr": 2e-3}},
                                 "executor": {"name": "slurm", "cluster": "local",
                                              "array": True, "poll_s": 0.2,
                                              "timeout_min": 5}})
    result = run_sweep(path, runner=fake_runner, report=False)  # one array of 2 jobs
    status = {o.run.variant: o.status for o in result.outcomes}
    assert status == {"a": "ok", "b": "failed"}
    jobs_path = tmp_path / "results" / "slurm" / "_slurm" / "jobs.json"
    first_jobs = json.loads(jobs_path.read_text())
    assert set(first_jobs) == {o.run.run_id for o in result.outcomes}

    monkeypatch.setenv("FAKE_RUNNER_FAIL", "")
    retried = run_sweep(path, runner=fake_runner, report=False, retry_failed=True)  # 1 job
    assert retried.ok and retried.num_launched == 1
    b_id = next(o.run.run_id for o in retried.outcomes if o.run.variant == "b")
    assert json.loads(jobs_path.read_text())[b_id] != first_jobs[b_id]
    assert run_sweep(path, runner=fake_runner, report=False).num_launched == 0


def busy_runner(cfg, run_dir, progress=True, resume=False) -> dict:
    """A run whose directory another process holds when its job starts."""
    raise records.Busy(f"run directory {run_dir}", {"purpose": "commbench eval", "pid": 4321,
                                                    "host": "elsewhere", "since": "now"})


def test_a_job_refused_its_run_directory_says_so_not_the_old_record(tmp_path, env):
    """Issue 49 (tox -e slurm): the retry's job was refused the run directory (Busy: it
    changes nothing there) and the sweep reported the failure still recorded from the
    attempt before ("ranks 2, 3 (node cbnode2) lost"), as if the retry had lost the node
    again. The job's own refusal is the outcome; the record stays as it was."""
    path = write_spec(tmp_path, {"name": "busy", "executor": {
        "name": "slurm", "cluster": "local", "poll_s": 0.2, "timeout_min": 5}})
    (failed,) = run_sweep(path, runner=fake_runner, report=False).outcomes
    _stop(failed.run_dir, 30)  # failed, with a checkpoint: the retry resumes it in place
    RunDir(failed.run_dir).update_summary({"interrupted": False, "error": "ranks 2, 3 lost"})
    before = (failed.run_dir / "summary.json").read_bytes()
    (retried,) = run_sweep(path, runner=busy_runner, report=False, retry_failed=True).outcomes
    assert retried.status == "failed" and retried.run_dir == failed.run_dir
    assert "is in use by commbench eval (pid 4321 on host elsewhere" in retried.error
    assert "lost" not in retried.error
    assert (failed.run_dir / "summary.json").read_bytes() == before


def test_a_registered_executor_gets_the_runs_to_train(tmp_path, env, monkeypatch):
    from bench.launch import executors

    seen = {}

    class Recording(executors.Executor):
        def prepare(self, tasks):
            seen["prepared"] = [t.run_id for t in tasks]
            return set()

        def run(self, tasks, runner, progress):
            seen["ran"] = [t.run_id for t in tasks]
            return {t.run_id: fake_runner(t.config, t.run_dir) for t in tasks}

    monkeypatch.setitem(executors.EXECUTORS, "local", Recording)
    result = run_sweep(write_spec(tmp_path, {"seeds": [0, 1]}), report=False)
    ids = [o.run.run_id for o in result.outcomes]
    assert seen == {"prepared": ids, "ran": ids} and result.count("ok") == 2


def test_executor_override_and_report_at_the_end(tmp_path, env, capsys):
    path = write_spec(tmp_path, {"name": "r", "variants": {"ddp": {"optim.lr": 1e-3},
                                                           "ddp-b": {"optim.lr": 2e-3}},
                                 "executor": {"name": "slurm"}})
    result = run_sweep(path, runner=fake_runner, executor="local", max_parallel=1)
    assert result.ok
    assert result.report == tmp_path / "report" / "report.html" and result.report.exists()
    assert f"report: {result.report}" in capsys.readouterr().out


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_real_two_run_sweep_end_to_end(tmp_path):
    """Two seeds of DDP on 2 gloo ranks with the real launcher, then the report."""
    base = {**BASE, "run": {"name": "tiny", "steps": 12, "log_every": 4, "val_every": 6,
                            "val_sequences": 8},
            "model": {"preset": "tiny", "seq_len": 32, "n_layer": 1}}
    path = write_spec(tmp_path, {"name": "e2e", "base": base, "seeds": [0, 1],
                                 "variants": {"ddp": {"strategy.name": "ddp"}}})
    result = run_sweep(path)
    assert result.ok, [o.error for o in result.outcomes]
    assert result.count("ok") == 2
    for outcome in result.outcomes:
        assert records.read_summary(outcome.run_dir)["config_hash"] == outcome.run.run_id
    html = result.report.read_text()
    assert "ddp" in html and html.count("data:image/png;base64") == 4
    assert run_sweep(path, report=False).num_launched == 0
