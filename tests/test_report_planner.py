"""The planner in the sweep report (issue 48): each run's bandwidth for 90% utilisation and
a sweep spec's what-if section.

    pytest tests/test_report_planner.py

A fake DDP run of 2 ranks (one per node) with a measured compute per step of 50 ms
(summary.json `compute_per_step`) on a profile file without TCP: its column is the
bisection of its own what-if over the profile's inter-node bandwidth, checked by pricing
the run's what-if (`measured_whatif`) on profile files at that bandwidth (>= 90%) and at
0.99 of it (< 90%).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import yaml

from bench.config import from_dict
from bench.study.report import build_report
from bench.study.report.planner import COLUMN
from bench.study.whatif.report import (
    MEASURED_RANGE,
    format_bandwidth,
    measured_bandwidth_for,
    measured_whatif,
)
from tests.fakes import make_summary, write_fake_run

COMPUTE_S = 0.05


def profile_file(folder: Path, bandwidth_Bps: float, name: str = "lan") -> str:
    """A user's profile: a fast intra tier, the inter tier at `bandwidth_Bps`, 50 us, no
    TCP (so no price depends on idle time)."""
    path = folder / f"{name}-{bandwidth_Bps:.6g}.yaml"
    path.write_text(yaml.safe_dump({
        "tiers": {"fast": {"latency": "5us", "bandwidth": "450GB/s"},
                  "link": {"latency": "50us", "bandwidth": float(bandwidth_Bps)}},
        "profiles": {name: {"description": "test", "intra": "fast", "inter": "link"}}}))
    return str(path)


def run_config(profile: str) -> dict:
    return {"run": {"name": "ddp", "seed": 0, "steps": 6, "log_every": 3, "val_every": 6,
                    "val_sequences": 8},
            "model": {"preset": "tiny", "seq_len": 32},
            "data": {"corpus": "embedded", "batch_size": 4},
            "parallel": {"world_size": 2},
            "strategy": {"name": "ddp", "backend": "torch"},
            "network": {"ranks_per_node": 1, "profiles": [profile]}}


def measured_summary(compute_per_step: bool = True) -> dict:
    stats = {"steps": [6, 6], "median_s": [COMPUTE_S, COMPUTE_S],
             "p10_s": [COMPUTE_S] * 2, "p90_s": [COMPUTE_S] * 2, "mean_s": [COMPUTE_S] * 2}
    return make_summary(
        status="ok", run_name="ddp", strategy="ddp", world_size=2, steps=6,
        total_tokens=6 * 2 * 4 * 32, wall_s=1.0, final_val_loss=4.0,
        projection_model="gloo collectives, overlap-aware", ranks_per_node=1,
        compute_clock="thread_cpu",
        compute_per_step={"train:all_reduce": stats} if compute_per_step else None)


def test_the_column_is_where_the_runs_own_whatif_crosses_90_percent(tmp_path):
    """bandwidth_for's answer B: the run's what-if on a profile whose inter tier is B
    reaches 90%, at 0.99 B it does not; B lies inside the swept range."""
    cfg = from_dict(run_config(profile_file(tmp_path, 1.25e9)))
    summary = measured_summary()
    found = measured_bandwidth_for(cfg, summary)
    assert found.profile == cfg.network.profiles[0]
    assert found.low_Bps < found.bandwidth_Bps < found.high_Bps
    at = {}
    for factor in (1.0, 0.99):
        other = from_dict(run_config(profile_file(tmp_path, factor * found.bandwidth_Bps)))
        (row,) = measured_whatif(other, summary).values()
        at[factor] = row["utilisation"]
    assert at[1.0] >= 0.9 > at[0.99], at
    assert found.utilisation_at_high >= 0.9
    # DDP's gradients (the tiny model's, in fp32) over about 1 ms of exposed time: between
    # 0.1 and 100 Gbit/s
    assert 0.1e9 / 8 < found.bandwidth_Bps < 100e9 / 8


def test_the_ends_of_the_range_and_refusals(tmp_path):
    cfg = from_dict(run_config(profile_file(tmp_path, 1.25e9)))
    summary = measured_summary()
    low = measured_bandwidth_for(cfg, summary, bandwidths=("50Gbit/s", "100Gbit/s"))
    assert low.bandwidth_Bps == low.low_Bps and low.text() == "≤ 50 Gbit/s"
    high = measured_bandwidth_for(cfg, summary, bandwidths=("1Mbit/s", "2Mbit/s"))
    assert math.isinf(high.bandwidth_Bps) and high.text() == "> 0.002 Gbit/s"
    assert high.utilisation_at_high < 0.9
    assert format_bandwidth(1.25e9, 1e6, 1e12) == "10 Gbit/s"
    assert format_bandwidth(math.inf, 1e6, 1.25e11) == "> 1,000 Gbit/s"
    one_node = {**summary, "ranks_per_node": 2}
    with pytest.raises(ValueError, match="share one node"):
        measured_bandwidth_for(cfg, one_node)


def write_sweep(root: Path, with_measure: bool = True) -> tuple[Path, str]:
    """A sweep of the measured DDP run and one recorded without compute_per_step."""
    sweep_dir = root / "s"
    profile = profile_file(root, 1.25e9)
    sweep = {"name": "s", "runs": {}}
    for run_id, seed, measured in (("aaaaaaaaaaaa", 0, True), ("bbbbbbbbbbbb", 1, False)):
        config = run_config(profile)
        config["run"]["seed"] = seed
        summary = measured_summary(measured and with_measure) | {"config_hash": run_id}
        write_fake_run(sweep_dir / f"ddp-{run_id}", config, [], summary)
        sweep["runs"][run_id] = {"dir": f"ddp-{run_id}", "variant": "ddp", "seed": seed,
                                 "label": "ddp", "point": {}, "strategy": "ddp"}
    (sweep_dir / "sweep.json").write_text(json.dumps(sweep))
    return sweep_dir, profile


def test_the_report_shows_each_runs_value_and_why_one_has_none(tmp_path):
    sweep_dir, profile = write_sweep(tmp_path)
    found = measured_bandwidth_for(from_dict(run_config(profile)), measured_summary())
    build_report(sweep_dir, tmp_path / "report")
    runs = pd.read_csv(tmp_path / "report" / "runs.csv").set_index("run_id")
    assert runs.loc["ddp-aaaaaaaaaaaa", f"{COLUMN}_Bps"] == pytest.approx(
        found.bandwidth_Bps, rel=1e-12)
    assert runs.loc["ddp-aaaaaaaaaaaa", f"{COLUMN}_profile"] == profile
    assert math.isnan(runs.loc["ddp-bbbbbbbbbbbb", f"{COLUMN}_Bps"])
    assert "no measured compute per step" in runs.loc["ddp-bbbbbbbbbbbb", f"{COLUMN}_note"]
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## Bandwidth for 90% utilisation" in md
    assert "*this* compute would stay 90% busy" in md
    assert f"swept from {MEASURED_RANGE[0]} to {MEASURED_RANGE[1]}" in md
    # the group's median over its one seed with a value, and the run's own in All runs
    assert f"| 1 of 2 | {found.text()} |" in md
    assert md.count(f"| {found.text()} |") >= 2
    assert "`ddp-bbbbbbbbbbbb`): has no measured compute per step" in md


def test_a_sweep_without_measured_compute_says_so_and_does_not_fail(tmp_path):
    sweep_dir, _ = write_sweep(tmp_path, with_measure=False)
    build_report(sweep_dir, tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| 0 of 2 | — |" in md and "2 run(s)" in md


SCENARIO = {
    "name": "tiny-plan",
    "base": {"model": {"preset": "tiny", "seq_len": 32},
             "data": {"tokenizer": "byte", "batch_size": 4}},
    "hardware": {"compute_s_per_step": 0.05},
    "world": {"replicas": 2, "gpus_per_replica": 1, "gpus_per_node": 1},
    "network": {"profile": "eth-10g", "model": "gloo", "bandwidth": ["0.01Gbit/s",
                                                                     "100Gbit/s"],
                "points": 5, "at": "1Gbit/s"},
    "tokens": 1.0e+5, "targets": [0.5, 0.9],
    "methods": {"ddp": {"strategy": {"name": "ddp"}},
                "diloco": {"strategy": {"name": "diloco", "inner_steps": 5}}},
}


def test_a_sweep_specs_whatif_becomes_a_report_section(tmp_path):
    """build_report(whatif=...) (what `commbench sweep` passes from the spec's `whatif:`):
    the scenario's table, its assumptions and figure, equal to `commbench whatif`'s."""
    from bench.study.whatif.report import evaluate, table_rows
    from bench.study.whatif.scenario import load_scenario

    sweep_dir, _ = write_sweep(tmp_path)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    build_report(sweep_dir, tmp_path / "report", whatif=path)
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## What-if: tiny-plan (at 1 Gbit/s)" in md
    assert "- collectives priced with the gloo model" in md
    assert (tmp_path / "report" / "figures" / "whatif.png").is_file()
    rows = table_rows(*(lambda s: (s, evaluate(s)))(load_scenario(str(path))))
    for row in rows.itertuples(index=False):
        assert "| " + " | ".join(row) + " |" in md
    html = (tmp_path / "report" / "report.html").read_text()
    assert "What-if: tiny-plan" in html and "<li>collectives priced with the gloo" in html


def test_a_whatif_that_cannot_be_evaluated_is_said_not_raised(tmp_path):
    sweep_dir, _ = write_sweep(tmp_path)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({**SCENARIO, "world": {"replicas": 0}}))
    build_report(sweep_dir, tmp_path / "report", whatif=path)
    md = (tmp_path / "report" / "report.md").read_text()
    assert "was not evaluated: world.replicas" in md
