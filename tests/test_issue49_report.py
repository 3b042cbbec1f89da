"""Issue 49, the report's and the what-if's share: what they read without a word.

- a symbolic link to a run directory inside a results tree is named, with its target,
  in the report's warnings, and in the error when it is all the tree holds;
- an ok run's metrics rows holding a non-finite loss, or rows past the steps its
  summary.json records (appended after the run), are warned of, and the report uses the
  recorded steps;
- `commbench whatif --run` (and `hardware.run`) refuse a run whose compute per step was
  measured on the wall clock while its ranks shared cores.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from bench.cli import main
from bench.run.records import RunDir
from bench.run.summary import train_row, val_row
from bench.study.report import build_report, load_results
from tests.test_report import DDP_VAL, STEPS, _save, _sweep, write_run

# --------------------------------------------------------------- symlinked run directories


def test_a_symlinked_run_directory_is_named_with_its_target(tmp_path):
    """One real run and one linked in: the report reads the real one and its warnings name
    the link and where it points (os.walk does not follow it)."""
    results = tmp_path / "results"
    sweep_dir, sweep = _sweep(results)
    write_run(sweep_dir, sweep, "ddp", "ddp", 0, DDP_VAL, 1.0)
    _save(sweep_dir, sweep)
    elsewhere, other = _sweep(tmp_path / "elsewhere", "o")
    target = write_run(elsewhere, other, "diloco", "diloco", 0, DDP_VAL, 0.5)
    link = sweep_dir / "linked-run"
    link.symlink_to(target, target_is_directory=True)

    res = load_results(results)
    assert list(res.runs["strategy"]) == ["ddp"]
    named = [w for w in res.warnings if str(link) in w]
    assert len(named) == 1, res.warnings
    assert "symbolic link to a directory: not read" in named[0]
    assert repr(str(target.resolve())) in named[0]

    md = (build_report(results, tmp_path / "out").parent / "report.md").read_text()
    assert "linked-run" in md and "symbolic link to a directory" in md


def test_a_tree_holding_only_a_link_says_so(tmp_path):
    elsewhere, other = _sweep(tmp_path / "elsewhere", "o")
    target = write_run(elsewhere, other, "ddp", "ddp", 0, DDP_VAL, 1.0)
    results = tmp_path / "results"
    results.mkdir()
    (results / "run").symlink_to(target, target_is_directory=True)
    with pytest.raises(ValueError, match="no run records") as err:
        load_results(results)
    assert f"{results / 'run'} is a symbolic link to a directory" in str(err.value)
    assert repr(str(target.resolve())) in str(err.value)


def test_links_where_no_run_is_looked_for_are_not_named(tmp_path):
    """Inside a run directory (its logs/, checkpoints/) or a skipped `_*` folder a link is no
    run directory the walk passed over."""
    sweep_dir, sweep = _sweep(tmp_path / "results")
    run_dir = write_run(sweep_dir, sweep, "ddp", "ddp", 0, DDP_VAL, 1.0)
    _save(sweep_dir, sweep)
    (run_dir / "logs").mkdir(exist_ok=True)
    (run_dir / "logs" / "latest").symlink_to(tmp_path, target_is_directory=True)
    (sweep_dir / "_retired").mkdir()
    (sweep_dir / "_retired" / "old").symlink_to(run_dir, target_is_directory=True)
    res = load_results(tmp_path / "results")
    assert not [w for w in res.warnings if "symbolic link" in w], res.warnings


# --------------------------------------------------- rows an ok run cannot hold (appended)


def _ok_run_with_rows_appended(root: Path, appended: list[dict]) -> Path:
    """An ok run of 40 steps (summary.json steps 40) with `appended` rows after its own."""
    sweep_dir, sweep = _sweep(root)
    run_dir = write_run(sweep_dir, sweep, "ddp", "ddp", 0, DDP_VAL, 1.0)
    _save(sweep_dir, sweep)
    with open(RunDir(run_dir).metrics, "a") as f:
        for row in appended:
            f.write(json.dumps(row) + "\n")  # json writes NaN and Infinity as Python reads them
    return sweep_dir


def test_non_finite_losses_of_an_ok_run_are_warned_of(tmp_path):
    clock = (STEPS[-1], 1000 * STEPS[-1], 40.0, {})
    root = _ok_run_with_rows_appended(tmp_path, [
        train_row(*clock, lr=1e-3, loss=math.nan, step_s=1.0, compute_s=0.8, comm_s=0.2,
                  comm_bytes=1e6),
        val_row(*clock, val_loss=math.inf)])
    res = load_results(root)
    warned = [w for w in res.warnings if "not finite" in w]
    assert len(warned) == 1, res.warnings
    assert f"{RunDir(root / res.runs['run_id'][0].split('/')[-1]).metrics}" in warned[0]
    assert "step 40" in warned[0] and "the run as ok" in warned[0]
    assert list(res.runs["status"]) == ["ok"]
    assert res.runs["steps_done"][0] == 40


def test_rows_past_the_recorded_steps_are_warned_of_and_left_out(tmp_path):
    """summary.json says 40 steps; rows at 50 and 60 were appended: steps_done is 40 (the
    recorded steps, which the warning names), and the rows are in no curve."""
    rows = []
    for step in (50, 60):
        clock = (step, 1000 * step, float(step), {})
        rows += [train_row(*clock, lr=1e-3, loss=0.5, step_s=1.0, compute_s=0.8, comm_s=0.2,
                           comm_bytes=1e6), val_row(*clock, val_loss=0.1)]
    res = load_results(_ok_run_with_rows_appended(tmp_path, rows))
    warned = [w for w in res.warnings if "past the 40 steps summary.json records" in w]
    assert len(warned) == 1, res.warnings
    assert "4 rows" in warned[0] and "steps up to 60" in warned[0]
    assert "uses the 40 recorded steps" in warned[0]
    assert res.runs["steps_done"][0] == 40
    assert res.steps["step"].max() == 40
    assert res.runs["last_train_loss"][0] == pytest.approx(DDP_VAL[-1] + 0.05)


def test_a_clean_ok_run_and_a_diverged_one_are_not_warned_of(tmp_path):
    """A run's own rows give no warning; a diverged run's NaN loss is what diverged means."""
    sweep_dir, sweep = _sweep(tmp_path)
    write_run(sweep_dir, sweep, "ddp", "ddp", 0, DDP_VAL, 1.0)
    write_run(sweep_dir, sweep, "diloco", "diloco", 0, [4.0, math.nan], 0.5,
              status="diverged", error="loss is nan at step 20")
    res = load_results(_save(sweep_dir, sweep))
    assert res.warnings == []


# --------------------------------------------- whatif of a run whose ranks shared cores


def _measured_run(run_dir: Path, **summary) -> Path:
    """A fake ddp-tiny run (4 ranks, batch 8 x 128 tokens) with its compute per step."""
    run_dir.mkdir(parents=True)
    shutil.copy("configs/ddp-tiny.yaml", run_dir / "config.yaml")
    stats = {"steps": [10] * 4, "median_s": [0.5] * 4, "p10_s": [0.4] * 4,
             "p90_s": [0.9] * 4, "mean_s": [0.6] * 4}
    (run_dir / "summary.json").write_text(json.dumps({
        "status": "ok", "flops_per_token": 2e6, "ranks_per_node": 1,
        "compute_per_step": {"train:all_reduce": stats}, **summary}))
    return run_dir


@pytest.mark.parametrize("clock", [{}, {"compute_clock": "wall"}])
def test_whatif_refuses_wall_clock_compute_on_shared_cores(tmp_path, capsys, clock):
    run_dir = _measured_run(tmp_path / "run", ranks_per_core=2.0, **clock)
    assert main(["whatif", "--run", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert str(run_dir) in err
    assert "ranks_per_core 2 > 1" in err
    assert f"compute_clock {repr(clock['compute_clock']) if clock else 'not recorded'}" in err
    assert "no more ranks than cores" in err and "run.compute_clock: auto" in err

    from bench.study.whatif.report import measured_flops_per_s
    with pytest.raises(ValueError, match="shared cores"):  # hardware.run reads it too
        measured_flops_per_s(str(run_dir))


@pytest.mark.parametrize("summary", [
    {"ranks_per_core": 2.0, "compute_clock": "thread_cpu"},
    {"ranks_per_core": 1.0, "compute_clock": "wall"},
    {"ranks_per_core": 0.5},
    {"ranks_per_core": None, "compute_clock": "wall"},  # a GPU run
    {},  # recorded before either field
])
def test_whatif_reads_runs_whose_compute_holds_no_wait_for_a_core(tmp_path, capsys, summary):
    run_dir = _measured_run(tmp_path / "run", **summary)
    assert main(["whatif", "--run", str(run_dir)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "what-if" in out

    from bench.study.whatif.report import measured_flops_per_s
    assert measured_flops_per_s(str(run_dir)) == pytest.approx(2e6 * 8 * 128 / 0.5)
