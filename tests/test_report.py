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

from bench.report import build_report, load_results
from bench.report.analysis import compare, first_crossing, mean_ci, t_quantile_975

STEPS = [10, 20, 30, 40]
DDP_VAL = [4.0, 3.0, 2.5, 2.0]
DILOCO_VAL = {0: [3.8, 2.8, 2.0, 1.9], 1: [3.8, 2.8, 2.2, 1.8]}
PROJECTED_TOTAL = {"ddp": {"nvlink": 20.0, "wan-1g": 400.0},
                   "diloco": {"nvlink": 10.0, "wan-1g": 40.0}}


def write_run(sweep_dir: Path, sweep: dict, name: str, strategy: str, seed: int,
              val: list[float] | None, seconds_per_step: float, status: str | None = "ok",
              error: str | None = None, point: dict | None = None, torn: bool = False,
              eval_scores: dict | None = None) -> Path:
    run_id = hashlib.sha256(f"{name}{seed}{point}".encode()).hexdigest()[:12]
    run_dir = sweep_dir / f"{name}-{run_id}"
    run_dir.mkdir(parents=True)
    config = {"run": {"name": name, "seed": seed, "steps": 40}, "strategy": {"name": strategy}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    lines = []
    for i, step in enumerate(STEPS[: len(val or [])]):
        row = {"step": step, "tokens": 1000 * step, "elapsed_s": seconds_per_step * step,
               "loss": val[i] + 0.05, "lr": 1e-3, "step_s": seconds_per_step,
               "compute_s": 0.8 * seconds_per_step, "comm_s": 0.2 * seconds_per_step,
               "comm_bytes": 1e6}
        lines.append(json.dumps(row))
        lines.append(json.dumps({k: row[k] for k in ("step", "tokens", "elapsed_s")}
                                | {"val_loss": val[i]}))
    text = "\n".join(lines) + "\n"
    if torn:
        text += '{"step": 50, "tokens": 500'
    (run_dir / "metrics.jsonl").write_text(text)
    sweep["runs"][run_id] = {"dir": run_dir.name, "variant": name, "seed": seed,
                             "label": name, "point": point or {}, "strategy": strategy}
    if status is None:  # killed before it wrote a summary
        return run_dir
    steps = 40
    summary = {"status": status, "run_name": name, "config_hash": run_id, "strategy": strategy,
               "world_size": 4, "num_params": 1000, "steps": steps, "total_tokens": 1000 * steps,
               "wall_s": seconds_per_step * steps,
               "throughput_tokens_per_s": 1000 / seconds_per_step,
               "compute_s_total": 0.8 * seconds_per_step * steps,
               "comm_s_total": 0.2 * seconds_per_step * steps,
               "comm_bytes_total": 4e7 if strategy == "ddp" else 4e6,
               "final_val_loss": val[-1] if val else None, "best_val_loss": min(val or [9]),
               "projected": {p: {"step_s": t / steps, "comm_s": t / steps / 4, "total_s": t,
                                 "throughput_tokens_per_s": 1000 * steps / t}
                             for p, t in PROJECTED_TOTAL.get(strategy, {}).items()}}
    if error:
        summary["error"] = error
    if eval_scores:
        summary["eval"] = eval_scores
    (run_dir / "summary.json").write_text(json.dumps(summary))
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
    assert diloco["speedup"] == pytest.approx(per_seed.mean())
    assert diloco["speedup_ci"] == pytest.approx(12.7062 * per_seed.std(ddof=1) / math.sqrt(2),
                                                 rel=1e-4)
    assert diloco["reached"] == "2/2" and diloco["baseline"] == "ddp"
    # projected: total time on the profile x fraction of tokens at the crossing
    wan = rows.loc[("diloco-H10", "wan-1g")]
    assert wan["time_to_target_s"] == pytest.approx((0.75 * 40 + 0.875 * 40) / 2)
    assert wan["speedup"] == pytest.approx(np.mean([400 / 30, 400 / 35]))
    assert rows.loc[("diloco-H10", "nvlink")]["speedup"] == pytest.approx(per_seed.mean())
    # convergence: tokens to target and the final loss gap to DDP
    c = conv.set_index("label").loc["diloco-H10"]
    assert c["tokens_to_target"] == pytest.approx(32500)
    assert c["token_ratio"] == pytest.approx(0.8125)
    assert c["val_loss_diff"] == pytest.approx(-0.15)
    assert c["final_val_loss"] == pytest.approx(1.85)
    # failed, diverged and partial runs are not in the comparison
    assert set(speedup["label"]) == {"ddp", "diloco-H10"}


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
    assert rows.loc[("ddp", "measured")]["time_to_target_s"] == pytest.approx(30)
    # DiLoCo crosses 2.5 between 2.8 (step 20) and 2.0 / 2.2 (step 30): steps 23.75 and 25
    speeds = [30 / (0.5 * 23.75), 30 / (0.5 * 25)]
    assert rows.loc[("diloco-H10", "measured")]["speedup"] == pytest.approx(np.mean(speeds))
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
        == pytest.approx(np.mean([40 / 15, 40 / 17.5]))


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
    assert html.count("data:image/png;base64,") == 4
    assert "<img" in html and 'src="figures' not in html  # self-contained
    for text in ("RuntimeError: rank 2 exploded", "loss is nan at step 21",
                 "no summary: killed midway, or still running", "Runs not in the comparison",
                 "2.48× ± 2.4", "truncated last line"):
        assert text in html and text in md, text
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
    assert "| ddp | ddp | 40 MB | 1 MB | 8 | 32 | 20.0% | 25.0% | 25.0% |" in md


def test_report_says_when_a_target_is_not_reached(tmp_path):
    results = make_results(tmp_path / "results")
    md = (build_report(results, tmp_path / "out", target_loss=1.85).parent / "report.md")
    line = next(x for x in md.read_text().splitlines() if x.startswith("| ddp |"))
    assert "not reached" in line and "0/2" in line
    assert "1.85 (given" in md.read_text()


def test_report_when_every_run_failed(tmp_path):
    sweep_dir = tmp_path / "bad"
    sweep = {"name": "bad", "runs": {}}
    write_run(sweep_dir, sweep, "ddp", "ddp", 0, [4.0], 1.0, status="failed", error="boom")
    html = build_report(sweep_dir, tmp_path / "out").read_text()
    assert "No run finished ok" in html and "boom" in html


def test_report_input_errors(tmp_path):
    with pytest.raises(ValueError, match="results directory not found"):
        build_report(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no run records"):
        build_report(tmp_path / "empty", tmp_path / "out")
