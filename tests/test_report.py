"""The report on a results fixture with known answers (built here, in a temporary folder).

The fixture is a sweep of DDP and DiLoCo over seeds 0 and 1, plus a failed run, a
diverged run and a partial one (killed: no summary, a torn last metrics line). Validation
every 10 steps, 1000 tokens per step. DDP takes 1 s per step, DiLoCo 0.5 s, so every
time to target below can be worked out by hand.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from bench.run.summary import Projection, train_row, val_row
from bench.study.report import build_report, load_results
from bench.study.report.analysis import compare, first_crossing, mean_ci, t_quantile_975
from bench.study.report.render import md_text
from tests.fakes import make_summary, write_fake_run

STEPS = [10, 20, 30, 40]
DDP_VAL = [4.0, 3.0, 2.5, 2.0]
DILOCO_VAL = {0: [3.8, 2.8, 2.0, 1.9], 1: [3.8, 2.8, 2.2, 1.8]}
PROJECTED_TOTAL = {"ddp": {"nvlink": 20.0, "wan-1g": 400.0},
                   "diloco": {"nvlink": 10.0, "wan-1g": 40.0}}
VAL_SET = {"id": "0123456789ab", "sequences": 64, "seq_len": 128, "tokens": 64 * 128}
"""The validation set the fixture's runs record (summary.json `val_set`)."""


def write_run(sweep_dir: Path, sweep: dict, name: str, strategy: str, seed: int,
              val: list[float] | None, seconds_per_step: float, status: str | None = "ok",
              error: str | None = None, point: dict | None = None, torn: bool = False,
              eval_scores: dict | None = None, config: dict | None = None,
              projected_elapsed: dict | None = None, summary_extra: dict | None = None,
              val_set: dict | None = VAL_SET) -> Path:
    """One run record. `config` is merged into config.yaml (e.g. {"optim": {...}});
    `projected_elapsed` {profile: cumulative seconds at each of STEPS} adds the harness's
    `projected_elapsed_s` to every metrics row; `summary_extra` is merged into summary.json;
    `val_set` is recorded in summary.json, and its size in config.yaml (None: a record
    from before run.val_sequences, without either)."""
    run_id = hashlib.sha256(f"{name}{seed}{point}{val_set}".encode()).hexdigest()[:12]
    run_dir = sweep_dir / f"{name}-{run_id}"
    full_config = {"run": {"name": name, "seed": seed, "steps": 40},
                   "strategy": {"name": strategy}}
    if val_set is not None:
        full_config["run"]["val_sequences"] = val_set["sequences"]
    for section, values in (config or {}).items():
        full_config.setdefault(section, {}).update(values)
    rows = []
    for i, step in enumerate(STEPS[: len(val or [])]):
        projected = {p: t[i] for p, t in (projected_elapsed or {}).items()}
        clock = (step, 1000 * step, seconds_per_step * step, projected)
        rows.append(train_row(*clock, lr=1e-3, loss=val[i] + 0.05, step_s=seconds_per_step,
                              compute_s=0.8 * seconds_per_step, comm_s=0.2 * seconds_per_step,
                              comm_bytes=1e6))
        rows.append(val_row(*clock, val_loss=val[i]))
    sweep["runs"][run_id] = {"dir": run_dir.name, "variant": name, "seed": seed,
                             "label": name, "point": point or {}, "strategy": strategy}
    summary = None
    if status is not None:  # None: killed before it wrote a summary
        steps = 40
        summary = make_summary(
            status=status, run_name=name, config_hash=run_id, strategy=strategy, world_size=4,
            num_params=1000, steps=steps, total_tokens=1000 * steps,
            wall_s=seconds_per_step * steps, compute_s_total=0.8 * seconds_per_step * steps,
            comm_s_total=0.2 * seconds_per_step * steps,
            comm_bytes_total=4e7 if strategy == "ddp" else 4e6,
            final_val_loss=val[-1] if val else None, best_val_loss=min(val or [9]),
            projected={p: Projection.of(t, 0.75 * t, steps, 1000 * steps)  # comm: 1/4
                       for p, t in PROJECTED_TOTAL.get(strategy, {}).items()},
            error=error, eval=eval_scores, val_set=val_set) | (summary_extra or {})
    write_fake_run(run_dir, full_config, rows, summary,
                   torn_tail='{"step": 50, "tokens": 500' if torn else None)
    return run_dir


def make_results(root: Path, target_loss: float | None = None) -> Path:
    sweep_dir = root / "paper"
    sweep = {"name": "paper", "target_loss": target_loss, "runs": {}}
    for seed in (0, 1):
        write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0,
                  eval_scores={"smoke/acc": 0.50 + 0.02 * seed})
        write_run(sweep_dir, sweep, "diloco-H10", "diloco", seed, DILOCO_VAL[seed], 0.5,
                  eval_scores={"smoke/acc": 0.48 + 0.02 * seed})
    write_run(sweep_dir, sweep, "pier", "pier", 0, [4.0], 1.0, status="failed",
              error="RuntimeError: rank 2 exploded\nTraceback ...")
    write_run(sweep_dir, sweep, "diloco-H50", "diloco", 0, [4.0, 9.0], 0.5, status="diverged",
              error="loss is nan at step 21")
    write_run(sweep_dir, sweep, "gasloc", "gasloc", 0, [3.9], 0.5, status=None, torn=True)
    (sweep_dir / "sweep.json").write_text(json.dumps(sweep))
    return sweep_dir


# --------------------------------------------------------------------------- the numbers


def _geomean(values) -> float:
    return float(np.exp(np.mean(np.log(values))))


def test_t_quantiles_and_confidence_interval():
    assert t_quantile_975(1) == pytest.approx(12.7062, abs=1e-4)
    assert t_quantile_975(30) == pytest.approx(2.0423, abs=1e-4)
    assert t_quantile_975(60) == pytest.approx(2.0003, abs=2e-4)
    assert t_quantile_975(1000) == pytest.approx(1.9623, abs=2e-4)
    mean, half, n = mean_ci([1.0, 2.0, 3.0, float("nan")])
    assert (mean, n) == (2.0, 3)
    assert half == pytest.approx(4.3027 * 1.0 / math.sqrt(3), rel=1e-4)
    assert mean_ci([5.0])[0] == 5.0 and math.isnan(mean_ci([5.0])[1])
    assert mean_ci([])[2] == 0


def test_t_quantiles_match_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 5, 29, 31, 45, 100, 500):
        assert t_quantile_975(df) == pytest.approx(stats.t.ppf(0.975, df), abs=2e-4)


def _val(losses, seconds_per_step=1.0):
    return pd.DataFrame({"step": STEPS[: len(losses)],
                         "tokens": [1000 * s for s in STEPS[: len(losses)]],
                         "elapsed_s": [seconds_per_step * s for s in STEPS[: len(losses)]],
                         "val_loss": losses})


def test_first_crossing_interpolates_between_validation_points():
    cross = first_crossing(_val([3.8, 2.8, 2.2, 1.8]), 2.0)
    assert cross == pytest.approx({"step": 35, "tokens": 35000, "elapsed_s": 35})
    # the first crossing counts, even if the curve rises again
    assert first_crossing(_val([3.0, 1.0, 3.0, 1.0]), 2.0)["step"] == pytest.approx(15)
    assert first_crossing(_val([1.5, 1.0]), 2.0)["step"] == 10  # below at the first point
    assert math.isnan(first_crossing(_val([3.0, 2.5]), 2.0)["tokens"])  # never reached


def test_speedup_and_time_to_target_against_ddps_final_loss(tmp_path):
    res = load_results(make_results(tmp_path))
    speedup, conv = compare(res.runs, res.steps, res.profiles)
    rows = speedup.set_index(["label", "clock"])
    # the target is DDP's final validation loss: 2.0 for both seeds
    assert set(speedup["target_loss"]) == {2.0}
    assert set(speedup["target_source"]) == {"DDP final val loss (highest over seeds)"}
    # DDP reaches it at its last validation, step 40 (40 s); DiLoCo at step 30 (seed 0)
    # and, interpolated between 2.2 and 1.8, at step 35 (seed 1): 15 s and 17.5 s.
    ddp = rows.loc[("ddp", "measured")]
    assert ddp["time_to_target_s"] == 40 and ddp["speedup"] == pytest.approx(1.0)
    diloco = rows.loc[("diloco-H10", "measured")]
    per_seed = np.array([40 / 15, 40 / 17.5])
    assert diloco["time_to_target_s"] == pytest.approx(16.25)
    assert diloco["speedup"] == pytest.approx(_geomean(per_seed))
    assert diloco["reached"] == "2/2" and diloco["baseline"] == "ddp"
    # projected: total time on the profile x fraction of tokens at the crossing
    wan = rows.loc[("diloco-H10", "wan-1g")]
    assert wan["time_to_target_s"] == pytest.approx((0.75 * 40 + 0.875 * 40) / 2)
    assert wan["speedup"] == pytest.approx(_geomean([400 / 30, 400 / 35]))
    assert rows.loc[("diloco-H10", "nvlink")]["speedup"] == pytest.approx(_geomean(per_seed))
    # convergence: tokens to target and the final loss gap to DDP
    c = conv.set_index("label").loc["diloco-H10"]
    assert c["tokens_to_target"] == pytest.approx(32500)
    assert c["token_ratio"] == pytest.approx(_geomean([30 / 40, 35 / 40]))
    assert c["val_loss_diff"] == pytest.approx(-0.15)
    assert c["final_val_loss"] == pytest.approx(1.85)
    # failed, diverged and partial runs are counted in their groups, with no speedup
    bad = speedup[speedup["clock"] == "measured"].set_index("label")
    assert bad.loc["pier", "failed"] == 1 and math.isnan(bad.loc["pier", "speedup"])
    assert bad.loc["diloco-H50", "diverged"] == 1 and bad.loc["gasloc", "partial"] == 1


def test_default_target_is_reached_by_every_ddp_seed(tmp_path):
    sweep_dir = tmp_path / "s"
    sweep = {"name": "s", "runs": {}}
    write_run(sweep_dir, sweep, "ddp", "ddp", 0, DDP_VAL, 1.0)
    write_run(sweep_dir, sweep, "ddp", "ddp", 1, [4.0, 3.0, 2.5, 2.25], 1.0)
    (sweep_dir / "sweep.json").write_text(json.dumps(sweep))
    res = load_results(sweep_dir)
    speedup, _ = compare(res.runs, res.steps, res.profiles)
    row = speedup.set_index("clock").loc["measured"]
    assert row["target_loss"] == 2.25 and row["reached"] == "2/2"
    # seed 0 crosses 2.25 halfway between steps 30 and 40; seed 1 at step 40
    assert row["time_to_target_s"] == pytest.approx(37.5)


def test_given_target_loss_overrides_the_default(tmp_path):
    res = load_results(make_results(tmp_path))
    speedup, _ = compare(res.runs, res.steps, res.profiles, target_loss=2.5)
    rows = speedup.set_index(["label", "clock"])
    assert rows.loc[("ddp", "measured"), "at_first_validation"] == 0
    assert rows.loc[("ddp", "measured")]["time_to_target_s"] == pytest.approx(30)
    # DiLoCo crosses 2.5 between 2.8 (step 20) and 2.0 / 2.2 (step 30): steps 23.75 and 25
    speeds = [30 / (0.5 * 23.75), 30 / (0.5 * 25)]
    assert rows.loc[("diloco-H10", "measured")]["speedup"] == pytest.approx(_geomean(speeds))
    assert set(speedup["target_source"]) == {"given"}


def test_sweep_spec_target_is_used_when_none_is_given(tmp_path):
    res = load_results(make_results(tmp_path, target_loss=2.5))
    speedup, _ = compare(res.runs, res.steps, res.profiles, sweep_targets=res.sweep_targets)
    assert set(speedup["target_source"]) == {"sweep spec"}
    assert set(speedup["target_loss"]) == {2.5}


def test_groups_are_compared_with_the_ddp_run_of_the_same_grid_point(tmp_path):
    sweep_dir = tmp_path / "grid"
    sweep = {"name": "grid", "runs": {}}
    for lr, scale in ((1e-3, 1.0), (3e-3, 2.0)):
        point = {"optim.lr": lr}
        write_run(sweep_dir, sweep, "ddp", "ddp", 0, DDP_VAL, scale, point=point)
        write_run(sweep_dir, sweep, "diloco", "diloco", 0, DDP_VAL, scale / 4, point=point)
    for entry in sweep["runs"].values():
        entry["label"] = f"{entry['variant']} lr={entry['point']['optim.lr']}"
    (sweep_dir / "sweep.json").write_text(json.dumps(sweep))
    res = load_results(sweep_dir)
    speedup, _ = compare(res.runs, res.steps, res.profiles)
    measured = speedup[speedup["clock"] == "measured"].set_index("label")
    assert measured.loc["diloco lr=0.003", "baseline"] == "ddp lr=0.003"
    assert measured.loc["diloco lr=0.001", "speedup"] == pytest.approx(4.0)
    assert measured.loc["diloco lr=0.003", "speedup"] == pytest.approx(4.0)


# ------------------------------------------------------------------------------ loading


def test_loading_lists_every_run_with_its_status(tmp_path):
    res = load_results(make_results(tmp_path))
    status = dict(zip(res.runs["label"], res.runs["status"], strict=False))
    assert status == {"ddp": "ok", "diloco-H10": "ok", "pier": "failed",
                      "diloco-H50": "diverged", "gasloc": "partial"}
    assert len(res.runs) == 7
    assert any("truncated last line" in w for w in res.warnings)
    assert res.profiles == ["nvlink", "wan-1g"]
    assert res.runs["strategy"].iloc[0] == "ddp"  # baselines first


def test_runs_without_a_sweep_json_are_grouped_by_config_minus_seed(tmp_path):
    sweep_dir = make_results(tmp_path)
    (sweep_dir / "sweep.json").unlink()
    res = load_results(sweep_dir)
    ok = res.runs[res.runs["status"] == "ok"]
    assert ok.groupby("label")["seed"].apply(sorted).to_dict() == {
        "ddp": [0, 1], "diloco-H10": [0, 1]}
    speedup, _ = compare(res.runs, res.steps, res.profiles)
    assert speedup.set_index(["label", "clock"]).loc[("diloco-H10", "measured"), "speedup"] \
        == pytest.approx(_geomean([40 / 15, 40 / 17.5]))


# ------------------------------------------------------------------------------- report


def test_report_from_results_with_a_failed_and_a_partial_run(tmp_path):
    out = tmp_path / "report"
    html_path = build_report(make_results(tmp_path / "results"), out)
    assert html_path == out / "report.html"
    html = html_path.read_text()
    md = (out / "report.md").read_text()
    for name in ("loss_vs_tokens", "loss_vs_time", "throughput", "communication"):
        assert (out / "figures" / f"{name}.png").stat().st_size > 10_000
        assert f"figures/{name}.png" in md
    assert html.count("data:image/png;base64,") == 5  # and the performance profile
    assert "One-step delay" not in md and "## Pipelines" not in md  # no such runs
    assert "<img" in html and 'src="figures' not in html  # self-contained
    for text in ("RuntimeError: rank 2 exploded", "loss is nan at step 21",
                 "no summary: killed midway, or still running", "Runs that did not finish ok",
                 "2.47× [0.93, 6.6] n<3", "truncated last line"):
        assert text.replace("<", "&lt;") in html and md_text(text) in md, text
    runs = pd.read_csv(out / "runs.csv")
    assert sorted(runs["status"]) == ["diverged", "failed", "ok", "ok", "ok", "ok", "partial"]
    steps = pd.read_csv(out / "steps.csv")
    assert {"loss", "val_loss", "tokens", "elapsed_s", "label", "seed"} <= set(steps.columns)
    assert len(steps) == 2 * (4 + 4) * 2 + 2 + 4 + 2  # ok runs + failed + diverged + partial
    down = pd.read_csv(out / "downstream.csv").set_index("label")
    assert down.loc["diloco-H10", "smoke/acc"] == pytest.approx(0.49)
    for name in ("speedup", "convergence", "communication"):
        assert (out / f"{name}.csv").exists()
    # communication: 20% of each step is comm (0.2 s of DDP's 1 s), DDP sends 4e7 B over 40
    # steps; a projected step is a quarter comm (comm_s = total_s / steps / 4), so over the
    # run DDP spends 400 s / 4 on wan-1g and DiLoCo 40 s / 4
    comm = pd.read_csv(out / "communication.csv").set_index("label")
    assert set(comm.index) == {"ddp", "diloco-H10"}  # ok runs only
    assert comm.loc["ddp", "comm_share.measured"] == pytest.approx(0.2)
    assert comm.loc["ddp", "comm_bytes_per_step"] == pytest.approx(1e6)
    assert comm.loc["ddp", "comm_share.wan-1g"] == pytest.approx(0.25)
    assert comm.loc["ddp", "comm_s.wan-1g"] == pytest.approx(100)
    assert comm.loc["diloco-H10", "comm_bytes_per_step"] == pytest.approx(1e5)
    assert comm.loc["diloco-H10", "comm_s.wan-1g"] == pytest.approx(10)
    assert comm.loc["diloco-H10", "throughput.measured"] == pytest.approx(2000)
    assert "| ddp | ddp | 10 MB | 250 kB | n/a | n/a | 8 | 32 | 20.0% | 25.0% | 25.0% |" in md


def test_report_says_when_a_target_is_not_reached(tmp_path):
    results = make_results(tmp_path / "results")
    md = (build_report(results, tmp_path / "out", target_loss=1.85).parent / "report.md")
    line = next(x for x in md.read_text().splitlines() if x.startswith("| ddp |"))
    assert "no speedup: 2 of 2 seeds did not reach" in line and "0/2" in line
    assert "1.85 (given" in md.read_text()


@pytest.mark.parametrize("val", [[4.0], None], ids=["after-a-row", "before-any-row"])
def test_report_when_every_run_failed(tmp_path, val):
    """Also when no run wrote a metrics row (a sweep whose every launch failed: it raised
    KeyError 'tokens' drawing the loss curves of an empty steps table)."""
    sweep_dir = tmp_path / "bad"
    sweep = {"name": "bad", "runs": {}}
    write_run(sweep_dir, sweep, "ddp", "ddp", 0, val, 1.0, status="failed", error="boom")
    write_run(sweep_dir, sweep, "diloco", "diloco", 0, val, 1.0, status="failed",
              error="boom")
    html = build_report(sweep_dir, tmp_path / "out").read_text()
    assert "No run finished ok" in html and "boom" in html


def test_report_input_errors(tmp_path):
    with pytest.raises(ValueError, match="results directory not found"):
        build_report(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no run records"):
        build_report(tmp_path / "empty", tmp_path / "out")


# ------------------------------------------------------- honest numbers (issue #10)


def _sweep(root: Path, name: str = "s") -> tuple[Path, dict]:
    return root / name, {"name": name, "runs": {}}


def _save(sweep_dir: Path, sweep: dict) -> Path:
    (sweep_dir / "sweep.json").write_text(json.dumps(sweep))
    return sweep_dir


def test_groups_with_missed_diverged_or_failed_seeds_get_no_speedup(tmp_path):
    """Defect 4 (survivorship): a seed that misses the target, diverges or fails voids the
    group's speedup, and the counts are shown instead of silently dropped."""
    sweep_dir, sweep = _sweep(tmp_path)
    for seed in (0, 1):
        write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0)
    write_run(sweep_dir, sweep, "late", "diloco", 0, DILOCO_VAL[0], 0.5)
    write_run(sweep_dir, sweep, "late", "diloco", 1, [3.8, 2.8, 2.4, 2.3], 0.5)  # never 2.0
    write_run(sweep_dir, sweep, "unstable", "pier", 0, DILOCO_VAL[0], 0.5)
    write_run(sweep_dir, sweep, "unstable", "pier", 1, [3.8, 9.0], 0.5, status="diverged")
    write_run(sweep_dir, sweep, "broken", "gasloc", 0, [3.9], 0.5, status="failed",
              error="boom")
    res = load_results(_save(sweep_dir, sweep))
    speedup, conv = compare(res.runs, res.steps, res.profiles)
    rows = speedup[speedup["clock"] == "measured"].set_index("label")
    late = rows.loc["late"]
    assert math.isnan(late["speedup"]) and math.isnan(late["time_to_target_s"])
    assert late["did_not_reach"] == 1 and late["reached"] == "1/2"
    assert "1 of 2 seeds did not reach" in late["reason"]
    unstable = rows.loc["unstable"]
    assert unstable["diverged"] == 1 and math.isnan(unstable["speedup"])
    assert "1 diverged" in unstable["reason"]
    assert rows.loc["broken", "failed"] == 1 and "1 failed" in rows.loc["broken", "reason"]
    assert rows.loc["ddp", "speedup"] == pytest.approx(1.0) and rows.loc["ddp", "reason"] == ""
    assert math.isnan(conv.set_index("label").loc["late", "tokens_to_target"])
    assert rows.loc["ddp", "at_first_validation"] == 0
    md = (build_report(sweep_dir, tmp_path / "out").parent / "report.md").read_text()
    assert "no speedup: 1 of 2 seeds did not reach" in md
    assert "no speedup: 1 diverged" in md and "no speedup: 1 failed" in md
    assert "Upper bounds" not in md


def test_projected_time_to_target_is_accumulated_step_by_step(tmp_path):
    """Defect 5: a Pier-like run whose first 10 steps cost 10 s each on the profile (DDP
    warmup traffic) and the rest 1 s: the uniform estimate (total x token fraction)
    understates its time to target; the step-wise one interpolates the cumulative clock."""
    sweep_dir, sweep = _sweep(tmp_path)
    ddp_clock = {"wan-1g": [100.0, 200.0, 300.0, 400.0]}  # 10 s every step
    pier_clock = {"wan-1g": [100.0, 110.0, 120.0, 130.0]}
    for seed in (0, 1, 2):
        write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0,
                  projected_elapsed=ddp_clock,
                  summary_extra={"projected": {"wan-1g": {"total_s": 400.0}}})
        write_run(sweep_dir, sweep, "pier", "pier", seed, DDP_VAL, 1.0,
                  projected_elapsed=pier_clock,
                  summary_extra={"projected": {"wan-1g": {"total_s": 130.0}}})
    res = load_results(_save(sweep_dir, sweep))
    speedup, _ = compare(res.runs, res.steps, res.profiles, target_loss=2.25)
    rows = speedup.set_index(["label", "clock"])
    # DDP_VAL crosses 2.25 halfway between steps 30 (2.5) and 40 (2.0): step 35
    pier = rows.loc[("pier", "wan-1g")]
    assert pier["time_to_target_s"] == pytest.approx(125.0)  # uniform: 130 x 35/40 = 113.75
    assert pier["projection"] == "step-wise"
    assert rows.loc[("ddp", "wan-1g"), "time_to_target_s"] == pytest.approx(350.0)
    assert pier["speedup"] == pytest.approx(350.0 / 125.0)
    # an old record without projected_elapsed_s falls back to the uniform estimate, marked
    old = load_results(make_results(tmp_path / "old"))
    old_rows = compare(old.runs, old.steps, old.profiles)[0].set_index(["label", "clock"])
    assert old_rows.loc[("diloco-H10", "wan-1g"), "projection"] == "uniform-step estimate"
    assert old_rows.loc[("diloco-H10", "wan-1g"), "time_to_target_s"] == pytest.approx(32.5)


def test_speedup_is_a_geometric_mean_with_a_log_ratio_interval(tmp_path):
    """Defect 6: per-seed speedups 40/15 and 40/17.5, paired by seed: the geometric mean,
    and the t-interval (1 degree of freedom) on the log-ratios, exponentiated."""
    res = load_results(make_results(tmp_path))
    speedup, _ = compare(res.runs, res.steps, res.profiles)
    row = speedup.set_index(["label", "clock"]).loc[("diloco-H10", "measured")]
    logs = np.log([40 / 15, 40 / 17.5])
    half = 12.7062 * logs.std(ddof=1) / math.sqrt(2)
    assert row["speedup"] == pytest.approx(math.exp(logs.mean()))
    assert row["speedup_low"] == pytest.approx(math.exp(logs.mean() - half), rel=1e-4)
    assert row["speedup_high"] == pytest.approx(math.exp(logs.mean() + half), rel=1e-4)
    assert row["speedup_method"] == "paired log-ratio" and row["flag"] == "n<3"


def test_unpaired_speedup_counts_the_baselines_spread(tmp_path):
    """Defect 6: DDP ran seeds 0 and 1, the method seeds 2 and 3: Welch on the logs, so a
    baseline whose times spread widens the interval (the old fallback ignored it)."""
    sweep_dir, sweep = _sweep(tmp_path)
    write_run(sweep_dir, sweep, "ddp", "ddp", 0, DDP_VAL, 1.0)   # 40 s to 2.0
    write_run(sweep_dir, sweep, "ddp", "ddp", 1, DDP_VAL, 2.0)   # 80 s
    write_run(sweep_dir, sweep, "fast", "diloco", 2, DDP_VAL, 0.25)  # 10 s
    write_run(sweep_dir, sweep, "fast", "diloco", 3, DDP_VAL, 0.5)   # 20 s
    res = load_results(_save(sweep_dir, sweep))
    speedup, _ = compare(res.runs, res.steps, res.profiles, target_loss=2.0)
    row = speedup.set_index(["label", "clock"]).loc[("fast", "measured")]
    # logs: DDP {ln 40, ln 80}, fast {ln 10, ln 20}: equal variances (ln 2)^2 / 2 each, so
    # SE = ln 2 / sqrt(2), Welch df = 2, t = 4.3027; estimate ln 4
    se = math.log(2) / math.sqrt(2)
    assert row["speedup"] == pytest.approx(4.0)  # old: mean of 60/10 and 60/20 = 4.5
    assert row["speedup_method"] == "welch log-ratio"
    assert row["speedup_low"] == pytest.approx(4 * math.exp(-4.3027 * se), rel=1e-4)
    assert row["speedup_high"] == pytest.approx(4 * math.exp(4.3027 * se), rel=1e-4)


def test_stats_known_intervals():
    from bench.study.report import stats
    # paired log-ratios ln 4, ln 2, 0: geometric mean 2, half-width t(2) ln2 / sqrt(3)
    ci = stats.ratio_interval({0: 40, 1: 40, 2: 40}, {0: 10, 1: 20, 2: 40})
    half = 4.302653 * math.log(2) / math.sqrt(3)
    assert (ci.estimate, ci.n, ci.method, ci.flag) == (pytest.approx(2.0), 3,
                                                       "paired log-ratio", "")
    assert ci.low == pytest.approx(2 * math.exp(-half)) and ci.high == pytest.approx(
        2 * math.exp(half))
    # Welch, unequal sizes and variances (reference: scipy.stats.ttest_ind, equal_var=False)
    w = stats.welch_interval([1.0, 2.0, 4.0], [2.0, 2.5, 3.5, 3.0])
    assert w.estimate == pytest.approx(-5 / 12)
    assert (w.low, w.high) == (pytest.approx(-3.7350705, abs=1e-6),
                               pytest.approx(2.9017372, abs=1e-6))
    # seed 2 only on one side: no pairs (none dropped), Welch on the logs of all five
    mixed = stats.ratio_interval({0: 40, 1: 40}, {0: 10, 1: 20, 2: 40})
    assert mixed.method == "welch log-ratio" and mixed.n == 2
    assert mixed.estimate == pytest.approx(40 / (10 * 20 * 40) ** (1 / 3))
    p = stats.paired_interval({0: 3.0, 1: 5.0, 2: 4.0, 9: 1.0}, {0: 1.0, 1: 2.0, 2: 2.0})
    assert (p.estimate, p.n) == (pytest.approx(7 / 3), 3)  # key 9 has no pair
    assert p.half_width == pytest.approx(4.302653 * math.sqrt(1 / 3) / math.sqrt(3))
    one = stats.mean_interval([2.0])
    assert one.estimate == 2.0 and math.isnan(one.low) and one.flag == "n<3"
    assert not one.excludes(0.0) and p.excludes(0.0)
    assert stats.t_quantile(0.975, 2.5) == pytest.approx(3.574655, abs=1e-5)
    with pytest.raises(ValueError, match="degrees of freedom must be > 0, got 0"):
        stats.t_quantile(0.975, 0)


def test_welch_interval_matches_scipy_on_random_samples():
    import scipy.stats as sp

    from bench.study.report import stats
    rng = np.random.default_rng(0)
    for n_a, n_b in ((2, 3), (3, 3), (5, 2), (7, 11)):
        a, b = rng.normal(1, 2, n_a), rng.normal(0, 0.5, n_b)
        expected = sp.ttest_ind(a, b, equal_var=False).confidence_interval()
        got = stats.welch_interval(a, b)
        assert (got.low, got.high) == (pytest.approx(expected.low, rel=1e-6),
                                       pytest.approx(expected.high, rel=1e-6))


def test_report_shows_logical_and_wire_bytes_under_separate_captions(tmp_path):
    """Defect 9: logical payload bytes and modelled wire bytes never share a column; a
    record without wire bytes shows n/a."""
    sweep_dir, sweep = _sweep(tmp_path)
    for seed in (0, 1):
        write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0,
                  summary_extra={"comm_wire_bytes_per_rank": 1.5e7})
        write_run(sweep_dir, sweep, "diloco", "diloco", seed, DILOCO_VAL[seed], 0.5)
    out = tmp_path / "out"
    build_report(_save(sweep_dir, sweep), out)
    md = (out / "report.md").read_text()
    comm = pd.read_csv(out / "communication.csv").set_index("label")
    assert comm.loc["ddp", "comm_bytes_per_rank"] == pytest.approx(1e7)
    assert comm.loc["ddp", "comm_wire_bytes_per_rank"] == pytest.approx(1.5e7)
    assert math.isnan(comm.loc["diloco", "comm_wire_bytes_per_rank"])
    header = next(x for x in md.splitlines() if "logical payload" in x)
    assert "modelled wire" in header and "Bytes sent" not in md
    assert "| ddp | ddp | 10 MB | 250 kB | 15 MB | 375 kB |" in md
    assert "| diloco | diloco | 1 MB | 25 kB | n/a | n/a |" in md


def test_report_shows_peak_bytes_per_sync_and_bytes_per_step(tmp_path):
    """Issue 24: the peak per sync beside the totals, and the per-step series drawn (DDP
    flat, DiLoCo a spike every H); records without them show n/a and no line."""
    sweep_dir, sweep = _sweep(tmp_path)
    for seed in (0, 1):
        write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0,
                  summary_extra={"comm_peak_sync_bytes": 250_000,
                                 "comm_peak_sync_wire_bytes": 375_000,
                                 "comm_bytes_series": [[1, 40, 250_000, 375_000]]})
        write_run(sweep_dir, sweep, "diloco", "diloco", seed, DILOCO_VAL[seed], 0.5)
    out = tmp_path / "out"
    build_report(_save(sweep_dir, sweep), out)
    md = (out / "report.md").read_text()
    comm = pd.read_csv(out / "communication.csv").set_index("label")
    assert comm.loc["ddp", "comm_peak_sync_bytes"] == 250_000
    assert math.isnan(comm.loc["diloco", "comm_peak_sync_bytes"])
    assert "peak payload B/rank/sync" in md and "peak wire B/rank/sync" in md
    assert "| 250 kB | 375 kB |" in md
    assert next(x for x in md.splitlines() if x.startswith("| diloco |") and "B" in x
                and "n/a" in x).endswith("| n/a | n/a |")
    assert (out / "figures" / "bytes_per_step.png").exists() and "Bytes per step over" in md
    assert "comm_bytes_series" not in pd.read_csv(out / "runs.csv")


def test_bytes_per_step_figure_of_a_49_group_study_keeps_its_axes(tmp_path):
    """The streaming study (49 groups) drew its legend inside the axes; matplotlib then
    collapsed them ("axes sizes collapsed to zero") and the figure showed no data. Many
    entries go beside the axes in columns."""
    import warnings

    from bench.study.report.figures import bytes_per_step, colors, save

    labels = [f"v{i}" for i in range(49)]
    runs = pd.DataFrame({"status": "ok", "group": labels, "label": labels,
                         "comm_bytes_series": [[[1, 8, 0], [9, 1, 1000 * (i + 1)]]
                                               for i in range(49)]})
    fig = bytes_per_step(runs, colors(labels))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the collapse is only a UserWarning
        save(fig, tmp_path / "b.png")
    ax = fig.axes[0]
    assert fig.legends and ax.get_legend() is None
    assert ax.get_position().width > 0.3  # the axes keep most of the figure


def test_quickstart_runs_two_seeds_and_the_report_flags_small_samples(tmp_path):
    """Defect 11: the quickstart has 2+ seeds, so the report shows an interval, flagged
    n<3 (an interval from 2 seeds rests on one degree of freedom)."""
    spec = yaml.safe_load((Path(__file__).parents[1] / "configs/quickstart.yaml").read_text())
    assert len(spec["seeds"]) >= 2
    md = (build_report(make_results(tmp_path / "r"), tmp_path / "o").parent
          / "report.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("| diloco-H10 |"))
    assert "2.47× [0.93, 6.6] n<3" in line


# ------------------------------------------------------------------ study sections


DELAY_FINALS = {  # optimizer -> setting -> final validation loss per seed 0, 1, 2
    "adamw": {"sync": [2.00, 2.02, 1.98], "delayed": [2.20, 2.25, 2.18],
              "ef": [2.05, 2.08, 2.02]},
    "muon": {"sync": [1.90, 1.91, 1.89], "delayed": [1.91, 1.93, 1.90],
             "ef": [1.90, 1.92, 1.89]},
}


def test_delay_study_section_gaps_to_sync_per_optimizer(tmp_path):
    sweep_dir, sweep = _sweep(tmp_path, "delay")
    settings = {"sync": (0, "none"), "delayed": (1, "none"), "ef": (1, "ef")}
    for name, cells in DELAY_FINALS.items():
        for setting, finals in cells.items():
            delay, correction = settings[setting]
            for seed, final in enumerate(finals):
                write_run(sweep_dir, sweep, f"{name}-{setting}", "ddp", seed,
                          [3.5, 3.0, 2.5, final], 1.0,
                          config={"optim": {"name": name, "delay": delay,
                                            "delay_correction": correction}})
    out = tmp_path / "out"
    build_report(_save(sweep_dir, sweep), out)
    cells = pd.read_csv(out / "delay_study.csv").set_index("label")
    diffs = np.array(DELAY_FINALS["adamw"]["delayed"]) - DELAY_FINALS["adamw"]["sync"]
    adamw = cells.loc["adamw-delayed"]
    assert adamw["gap"] == pytest.approx(0.21) and adamw["gap_n"] == 3
    assert adamw["gap_ci"] == pytest.approx(4.302653 * diffs.std(ddof=1) / math.sqrt(3))
    assert adamw["gap_method"] == "paired" and adamw["sync"] == "adamw-sync"
    assert cells.loc["adamw-ef", "gap"] == pytest.approx(0.05)
    assert cells.loc["adamw-ef", "recovered"] == pytest.approx(1 - 0.05 / 0.21)
    assert set(cells["mechanism"]) == {"emulation"}
    assert cells.loc["muon-delayed", "gap"] == pytest.approx(0.04 / 3)
    assert cells.loc["muon-sync", "final_val_loss"] == pytest.approx(1.90)
    assert math.isnan(cells.loc["muon-sync", "gap"])
    md = (out / "report.md").read_text()
    assert "## One-step delay: optimizers, delay and correction" in md
    assert "figures/delay_gaps.png" in md and (out / "figures/delay_gaps.png").exists()
    caption = next(x for x in md.splitlines() if x.startswith("_Gap of the final"))
    assert "reconstruct" in caption
    line = next(x for x in md.splitlines() if x.startswith("| adamw-ef | adamw |"))
    assert "| emulation | delayed + EF |" in line and "76.2%" in line


def test_delay_study_puts_the_pipeline_beside_the_emulation(tmp_path):
    """PipeDream-2BW's own delay (strategy.delay) is a delayed cell too; its sync reference
    is the same executor with strategy.delay 0, not the emulation's synchronous run."""
    sweep_dir, sweep = _sweep(tmp_path, "delay")
    cells = {  # label: (strategy, config, finals per seed)
        "emu-sync": ("ddp", {"optim": {"delay": 0}}, [2.00, 2.02, 1.98]),
        "emu-delayed": ("ddp", {"optim": {"delay": 1}}, [2.20, 2.25, 2.18]),
        "2bw-sync": ("pipedream-2bw", {"strategy": {"delay": 0},
                                       "optim": {"delay_correction": "none"}},
                     [2.10, 2.12, 2.08]),
        "2bw": ("pipedream-2bw", {"strategy": {"delay": 1},
                                  "optim": {"delay_correction": "none"}}, [2.30, 2.32, 2.28]),
        "2bw-predict": ("pipedream-2bw", {"strategy": {"delay": 1},
                                          "optim": {"delay_correction": "predict"}},
                        [2.15, 2.17, 2.13]),
    }
    for label, (strategy, config, finals) in cells.items():
        for seed, final in enumerate(finals):
            write_run(sweep_dir, sweep, label, strategy, seed, [3.5, 3.0, 2.5, final], 1.0,
                      config=config)
    out = tmp_path / "out"
    build_report(_save(sweep_dir, sweep), out)
    table = pd.read_csv(out / "delay_study.csv").set_index("label")
    assert table.loc["2bw", "mechanism"] == "pipeline" and table.loc["2bw", "delay"] == 1
    assert table.loc["2bw", "sync"] == "2bw-sync"
    assert table.loc["2bw", "gap"] == pytest.approx(0.20)
    assert table.loc["emu-delayed", "sync"] == "emu-sync"
    assert table.loc["emu-delayed", "gap"] == pytest.approx(0.21)
    assert table.loc["2bw-predict", "recovered"] == pytest.approx(1 - 0.05 / 0.20)
    md = (out / "report.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("| 2bw-predict | adamw |"))
    assert "| pipeline | delayed + predict |" in line and "75.0%" in line


def test_records_without_delay_settings_count_as_adamw_sync(tmp_path):
    res = load_results(make_results(tmp_path))
    assert set(res.runs["optim.name"]) == {"adamw"}
    assert set(res.runs["optim.delay"]) == {0}
    assert set(res.runs["optim.delay_correction"]) == {"none"}
    from bench.study.report.studies import delay_study
    assert delay_study(res.runs) is None  # nothing differs by delay: no section


def test_pipeline_section_bubbles_and_speedups_against_1f1b_and_ddp(tmp_path):
    sweep_dir, sweep = _sweep(tmp_path, "pipes")
    for seed in (0, 1):
        write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0)
        write_run(sweep_dir, sweep, "1f1b", "pipeline", seed, DDP_VAL, 0.5,
                  config={"strategy": {"schedule": "1f1b"}},
                  summary_extra={"bubble_fraction_measured": 0.22,
                                 "bubble_fraction_theory": 0.2})
        write_run(sweep_dir, sweep, "2bw", "pipedream-2bw", seed, DDP_VAL, 0.25,
                  summary_extra={"bubble_fraction_measured": 0.05})
    md = (build_report(_save(sweep_dir, sweep), tmp_path / "out").parent
          / "report.md").read_text()
    assert "## Pipelines" in md
    # to DDP's final loss 2.0: DDP 40 s, 1F1B 20 s, 2BW 10 s on every seed
    assert "| 2bw | pipedream-2bw | — | 2 (2) | 5.0% | — | 4 k | 2× [2, 2] n<3 | " \
           "4× [4, 4] n<3 |" in md
    assert "| 1f1b | pipeline | 1f1b | 2 (2) | 22.0% | 20.0% | 2 k | 1× [1, 1] n<3 | " \
           "2× [2, 2] n<3 |" in md


def test_a_baseline_that_misses_voids_the_speedup_but_not_the_groups_time(tmp_path):
    res = load_results(make_results(tmp_path))
    speedup, conv = compare(res.runs, res.steps, res.profiles, target_loss=1.9)
    row = speedup.set_index(["label", "clock"]).loc[("diloco-H10", "measured")]
    assert row["reason"] == "no speedup: baseline 2 of 2 seeds did not reach"
    assert math.isnan(row["speedup"]) and row["misses"] == ""
    # seed 0 reaches 1.9 at step 40 (20 s), seed 1 between 2.2 and 1.8: step 37.5 (18.75 s)
    assert row["time_to_target_s"] == pytest.approx((20 + 18.75) / 2)
    assert conv.set_index("label").loc["diloco-H10", "tokens_to_target"] == pytest.approx(
        38750)


def test_runs_below_the_target_at_their_first_validation_are_counted(tmp_path):
    res = load_results(make_results(tmp_path))
    speedup, _ = compare(res.runs, res.steps, res.profiles, target_loss=3.9)
    rows = speedup[speedup["clock"] == "measured"].set_index("label")
    assert rows.loc["diloco-H10", "at_first_validation"] == 2  # 3.8 at step 10
    assert rows.loc["ddp", "at_first_validation"] == 0  # 4.0, then 3.0: crosses at step 11
    assert rows.loc["ddp", "time_to_target_s"] == pytest.approx(11)


def test_report_says_which_links_each_run_was_measured_on(tmp_path):
    """Own links, sleep-based emulation, or what the user said (network.links: shaped)."""
    sweep_dir, sweep = _sweep(tmp_path)
    for seed in (0, 1):
        write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0)
        write_run(sweep_dir, sweep, "diloco", "diloco", seed, DILOCO_VAL[seed], 0.5,
                  config={"network": {"emulate": "wan-1g"}})
    write_run(sweep_dir, sweep, "gasloc", "gasloc", 0, DILOCO_VAL[0], 0.5,
              config={"network": {"links": "shaped: tbf 100 Mbit/s + 10 ms"}})
    out = tmp_path / "out"
    build_report(_save(sweep_dir, sweep), out)
    md = (out / "report.md").read_text()
    assert "2 on this machine's own links" in md
    assert "2 on sleep-based emulation of wan-1g" in md
    assert "1 on shaped: tbf 100 Mbit/s + 10 ms" in md


# ---------------------------------------------------------------------- validation sets

OTHER_SET = {"id": "fedcba987654", "sequences": 128, "seq_len": 128, "tokens": 128 * 128}
OLD_DDP = {"run": {"val_batches": 8}, "data": {"batch_size": 8}}
"""A config from before run.val_sequences (no summary.json val_set either)."""


def test_runs_on_different_validation_sets_are_never_compared(tmp_path):
    """DDP and `near` on one set, `far` on another: `near` is compared with DDP, `far` has
    no baseline on its set, and the report names both sets and the groups on each."""
    sweep_dir, sweep = _sweep(tmp_path)
    for seed in (0, 1):
        write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0)
        write_run(sweep_dir, sweep, "near", "diloco", seed, DILOCO_VAL[seed], 0.5)
        write_run(sweep_dir, sweep, "far", "diloco", seed, DILOCO_VAL[seed], 0.5,
                  val_set=OTHER_SET)
    res = load_results(_save(sweep_dir, sweep))
    with pytest.raises(ValueError, match="2 validation sets.*0123456789ab.*fedcba987654"):
        compare(res.runs, res.steps, res.profiles)
    out = tmp_path / "out"
    build_report(sweep_dir, out)
    speedup = pd.read_csv(out / "speedup.csv")
    rows = speedup[speedup["clock"] == "measured"].set_index("label")
    assert rows.loc["near", "baseline"] == "ddp" and rows.loc["near", "speedup"] > 1
    assert rows.loc["far", "baseline"].startswith("none") and math.isnan(rows.loc["far",
                                                                                 "speedup"])
    assert rows.loc["far", "val_set"] == "fedcba987654 (128 x 128 tokens)"
    md = (out / "report.md").read_text()
    assert "scored on 2 different validation sets" in md
    assert "**validation set 1**: 0123456789ab (64 x 128 tokens): `ddp`, `near`" in md
    assert "**validation set 2**: fedcba987654 (128 x 128 tokens): `far`" in md
    assert "## Speedup vs DDP (time to target loss) (validation set 2)" in md
    for name in ("loss_vs_tokens-set1", "loss_vs_tokens-set2"):
        assert (out / "figures" / f"{name}.png").exists()


def test_one_validation_set_is_named_once(tmp_path):
    out = tmp_path / "out"
    build_report(make_results(tmp_path / "results"), out)
    md = (out / "report.md").read_text()
    assert "scored on one validation set, 0123456789ab (64 x 128 tokens)" in md
    assert "(validation set" not in md and (out / "figures" / "loss_vs_tokens.png").exists()


def test_records_without_a_validation_set_are_marked_and_kept_apart(tmp_path):
    """Old records (run.val_batches, no val_set) compare with each other only where their
    configs imply the same windows, and never with recorded runs."""
    sweep_dir, sweep = _sweep(tmp_path)
    for seed in (0, 1):
        write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0)
        write_run(sweep_dir, sweep, "old-ddp", "ddp", seed, DDP_VAL, 1.0, val_set=None,
                  config=OLD_DDP)
        write_run(sweep_dir, sweep, "old-diloco", "diloco", seed, DILOCO_VAL[seed], 0.5,
                  val_set=None, config=OLD_DDP)
        write_run(sweep_dir, sweep, "old-pipe", "diloco", seed, DILOCO_VAL[seed], 0.5,
                  val_set=None, config={"run": {"val_batches": 8}, "data": {"batch_size": 16}})
    res = load_results(_save(sweep_dir, sweep))
    sets = {label: name for label, name in zip(res.runs["label"], res.runs["val_set"],
                                               strict=True)}
    assert sets["ddp"] == "0123456789ab (64 x 128 tokens)"
    assert sets["old-ddp"] == sets["old-diloco"] == (
        "not recorded (before run.val_sequences): the first 8 x 8 windows of the held-out "
        "split of 'embedded' (byte, val_fraction 0.05, seq_len 128)")
    assert sets["old-pipe"].startswith("not recorded") and "8 x 16 windows" in sets["old-pipe"]
    out = tmp_path / "out"
    build_report(sweep_dir, out)
    speedup = pd.read_csv(out / "speedup.csv")
    rows = speedup[speedup["clock"] == "measured"].set_index("label")
    assert rows.loc["old-diloco", "baseline"] == "old-ddp"  # same implied set: compared
    assert rows.loc["old-pipe", "baseline"].startswith("none")  # 128 first windows, not 64
    assert "scored on 3 different validation sets" in (out / "report.md").read_text()


def test_a_run_killed_before_recording_its_set_counts_with_its_group(tmp_path):
    """A partial run (no summary.json) is on the set its config asks for, so it still voids
    its group's speedup; a group whose runs recorded two sets is split."""
    sweep_dir, sweep = _sweep(tmp_path)
    for seed in (0, 1):
        write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0)
    write_run(sweep_dir, sweep, "dil", "diloco", 0, DILOCO_VAL[0], 0.5)
    write_run(sweep_dir, sweep, "dil", "diloco", 1, DILOCO_VAL[1][:2], 0.5, status=None)
    write_run(sweep_dir, sweep, "mixed", "diloco", 0, DILOCO_VAL[0], 0.5)
    write_run(sweep_dir, sweep, "mixed", "diloco", 1, DILOCO_VAL[1], 0.5, val_set={
        **VAL_SET, "id": "aaaaaaaaaaaa"})
    res = load_results(_save(sweep_dir, sweep))
    dil = res.runs[res.runs["variant"] == "dil"]
    assert list(dil["status"]) == ["ok", "partial"] and dil["val_set"].nunique() == 1
    speedup, _ = compare(*_one_set(res, "0123456789ab"), res.profiles)
    row = speedup[speedup["clock"] == "measured"].set_index("label").loc["dil"]
    assert row["reason"] == "no speedup: 1 partial"
    assert sorted(res.runs.loc[res.runs["variant"] == "mixed", "label"]) == [
        "mixed [val 0123456789ab]", "mixed [val aaaaaaaaaaaa]"]


def _one_set(res, set_id: str):
    from bench.study.report.load import by_validation_set
    ((_, part),) = [(n, p) for n, p in by_validation_set(res) if n.startswith(set_id)]
    return part.runs, part.steps


def test_memory_table_puts_the_measured_peak_beside_the_plan(tmp_path):
    sweep_dir = tmp_path / "results" / "mem"
    sweep = {"name": "mem", "runs": {}}
    memory = {"memory_estimate_bytes_per_rank": [200e6, 250e6],
              "peak_memory_above_start_bytes_per_rank": [210e6, 275e6],
              "peak_memory_bytes_per_rank": [900e6, 960e6], "peak_memory_bytes": 960e6}
    write_run(sweep_dir, sweep, "ddp", "ddp", 0, DDP_VAL, 1.0, summary_extra=memory)
    write_run(sweep_dir, sweep, "old", "diloco", 0, DDP_VAL, 1.0)  # a record from before
    (sweep_dir / "sweep.json").write_text(json.dumps(sweep))
    md = (build_report(sweep_dir, tmp_path / "out").parent / "report.md").read_text()
    assert "## Memory per rank" in md
    row = next(x for x in md.splitlines() if x.startswith("| ") and "250 MB" in x)
    assert "| 275 MB | 1.1 | 960 MB |" in row
    assert not any(x.startswith("| ") and "| old |" in x and "MB" in x
                   for x in md.split("## Memory per rank")[1].splitlines())
