"""AlgoPerf's time to target (a missed trial counted as infinite time), the performance
profile over workloads x network profiles, and downstream scores at chance level.

Fixtures as in tests/test_report.py: validation every 10 steps, 1000 tokens per step;
DDP takes 1 s per step and reaches loss 2.0 at step 40 (40 s); a DiLoCo seed of
DILOCO_VAL[0] at step 30, of DILOCO_VAL[1] at step 35 (0.5 s per step: 15 s, 17.5 s).
"""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from bench.run.records import RunDir
from bench.study.report import build_report, load_results
from bench.study.report.algoperf import cases, median_time, performance_profile
from bench.study.report.analysis import compare
from bench.study.report.chance import label
from tests.test_report import DDP_VAL, DILOCO_VAL, write_run

MISS = [3.8, 2.8, 2.4, 2.3]
"""A seed that never reaches 2.0."""


def test_median_with_misses_counted_as_infinite_time():
    assert median_time([15.0, 17.5, math.nan]) == 17.5  # the slower one that reached
    assert median_time([15.0, math.nan, math.inf]) == math.inf  # 2 of 3 missed: no score
    assert median_time([15.0, math.nan]) == math.inf  # half missed: no score
    assert median_time([15.0, 17.5, 30.0, math.nan]) == pytest.approx(23.75)
    assert median_time([20.0, 10.0, 30.0]) == 20.0
    assert math.isnan(median_time([]))


def _sweep(tmp_path, groups: dict[str, tuple[str, list]]):
    """groups: label -> (strategy, [validation curve per seed, None = diverged])."""
    sweep_dir, sweep = tmp_path / "s", {"name": "s", "runs": {}}
    for seed in range(3):
        write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0)
    for name, (strategy, curves) in groups.items():
        for seed, val in enumerate(curves):
            if val is None:
                write_run(sweep_dir, sweep, name, strategy, seed, [3.8, 9.0], 0.5,
                          status="diverged", error="loss is nan")
            else:
                write_run(sweep_dir, sweep, name, strategy, seed, val, 0.5)
    (sweep_dir / "sweep.json").write_text(json.dumps(sweep))
    return sweep_dir


def test_a_group_that_missed_is_scored_with_its_misses(tmp_path):
    sweep_dir = _sweep(tmp_path, {
        "one-miss": ("diloco", [DILOCO_VAL[0], DILOCO_VAL[1], MISS]),
        "one-diverged": ("pier", [DILOCO_VAL[0], None, DILOCO_VAL[1]]),
        "two-misses": ("gasloc", [DILOCO_VAL[0], MISS, MISS]),
        "all": ("diloco", [DILOCO_VAL[0], DILOCO_VAL[1], DILOCO_VAL[1]]),
    })
    res = load_results(sweep_dir)
    speedup, _ = compare(res.runs, res.steps, res.profiles, target_loss=2.0)
    rows = speedup[speedup["clock"] == "measured"].set_index("label")
    one = rows.loc["one-miss"]
    # the median of 15, 17.5 and a miss is 17.5, never the mean of the two that reached
    assert one["median_time_to_target_s"] == 17.5
    assert one["baseline_median_time_to_target_s"] == 40.0
    assert one["median_speedup"] == pytest.approx(40 / 17.5)
    assert one["reached_fraction"] == pytest.approx(2 / 3)
    # no interval from the lucky seeds alone, and no mean time either
    for column in ("speedup", "speedup_low", "speedup_high", "time_to_target_s"):
        assert math.isnan(one[column]), column
    assert rows.loc["one-diverged", "median_time_to_target_s"] == 17.5  # a diverged trial
    two = rows.loc["two-misses"]
    assert two["median_time_to_target_s"] == math.inf and math.isnan(two["median_speedup"])
    assert two["reached_fraction"] == pytest.approx(1 / 3)
    full = rows.loc["all"]  # every trial reached: the interval as before, and the median
    assert full["median_time_to_target_s"] == 17.5
    assert full["speedup_low"] < full["speedup"] < full["speedup_high"]
    out = tmp_path / "out"
    build_report(sweep_dir, out)
    md = (out / "report.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("| one-miss |"))
    assert "2.29× median, no interval (1 of 3 seeds did not reach)" in line
    assert "median 17.5 (1 of 3 seeds did not reach)" in md
    two_line = next(x for x in md.splitlines() if x.startswith("| two-misses |"))
    assert "no speedup: 2 of 3 seeds did not reach" in two_line and "median" not in two_line
    assert ("`one-miss` reached loss 2 in 2 of 3 trials; scored with its misses (the median "
            "over trials, a miss counted as never), it was 2.29× faster than DDP, with no "
            "interval: missed it in 1 of 3 trials") in md
    assert ("On every clock, `two-misses` reached loss 2 in only 1 of 3 trials (2 of 3 "
            "seeds did not reach): no time to target") in md


def test_performance_profile_by_hand():
    inf = math.inf
    table = pd.DataFrame(
        [("A", "measured", "x", 10), ("A", "measured", "y", 20), ("A", "measured", "z", inf),
         ("A", "measured", "w", 10),  # w ran this case only: the others count as misses
         ("A", "wan", "x", 30), ("A", "wan", "y", 15), ("A", "wan", "z", 45),
         ("B", "measured", "x", 10), ("B", "measured", "y", 10), ("B", "measured", "z", 12),
         ("B", "wan", "x", inf), ("B", "wan", "y", inf), ("B", "wan", "z", inf)],
        columns=["workload", "clock", "method", "time"])
    profile = performance_profile(table, taus=[1, 1.5, 2, 3, 4])
    got = profile.pivot(index="tau", columns="method", values="fraction")
    # ratios to the best per case: A/measured x 1, y 2, z miss, w 1; A/wan x 2, y 1, z 3;
    # B/measured x 1, y 1, z 1.2; B/wan: nobody solved it (a miss for all); 4 cases
    expected = {"x": [2, 2, 3, 3, 3], "y": [2, 2, 3, 3, 3], "z": [0, 1, 1, 2, 2],
                "w": [1, 1, 1, 1, 1]}
    for method, counts in expected.items():
        assert list(got[method]) == pytest.approx([c / 4 for c in counts]), method
    assert list(profile.columns) == ["method", "tau", "fraction"]


def test_report_writes_the_performance_profile(tmp_path):
    from tests.test_report import make_results
    out = tmp_path / "out"
    build_report(make_results(tmp_path / "results"), out)
    profile = pd.read_csv(out / "performance_profile.csv")
    assert list(profile.columns) == ["method", "tau", "fraction"]
    at4 = profile[profile["tau"] == profile["tau"].max()].set_index("method")["fraction"]
    # DDP's median 40 s against DiLoCo's 16.25 (measured), 20 against 8.125 (nvlink):
    # 2.46x, within 4; 400 against 32.5 on wan-1g: 12.3x, not within; 3 cases
    assert at4["ddp"] == pytest.approx(2 / 3) and at4["diloco-H10"] == 1.0
    assert at4["pier"] == 0 and at4["diloco-H50"] == 0  # failed, diverged: misses
    at1 = profile[profile["tau"] == 1.0].set_index("method")["fraction"]
    assert at1["diloco-H10"] == 1.0 and at1["ddp"] == 0
    assert (out / "figures" / "performance_profile.png").stat().st_size > 10_000
    md = (out / "report.md").read_text()
    assert "figures/performance_profile.png" in md and "`performance_profile.csv`" in md
    assert "`diloco-H10` best in 100%, within 2× of the best in 100%" in md
    speedup = pd.read_csv(out / "speedup.csv")
    assert len(cases(speedup)) == 5 * 3  # 5 groups (methods) x 3 clocks, 1 workload


# ----------------------------------------------------------------------- chance level


def test_chance_levels():
    assert label("smoke_choice/acc", 0.26) == "at chance"  # 4 choices, 100 items: ±0.085
    assert label("smoke_choice/acc", 0.34) == ""
    assert label("smoke_choice/acc", 0.30, items=1000) == ""  # ±0.027 with 1000 items
    assert label("smoke_choice/acc_norm", 0.10) == "below chance"
    assert label("hellaswag/acc_norm", 0.255, items=10042) == "at chance"  # ±0.0085
    assert label("hellaswag/acc_norm", 0.27, items=10042) == ""
    assert label("boolq/acc", 0.51, items=3270) == "at chance"  # 2 choices: ±0.017
    assert label("smoke_ppl/word_perplexity", 2.5e6) == "at chance"
    assert label("smoke_ppl/word_perplexity", 350.0) == ""
    assert label("smoke_cloze/perplexity", 4e4) == "at chance"
    assert label("smoke_ppl/bits_per_byte", 8.2) == "at chance"
    assert label("smoke_ppl/byte_perplexity", 3.1) == ""
    assert label("smoke_cloze/acc", 0.0) == "at chance"  # open vocabulary: chance ~0
    assert label("smoke_cloze/acc", 0.03) == ""
    assert label("my_task/f1", 0.0) == ""  # no chance level known: shown as is


def test_downstream_table_says_at_chance(tmp_path):
    sweep_dir, sweep = tmp_path / "s", {"name": "s", "runs": {}}
    scores = {"smoke_choice/acc": 0.26, "smoke_choice/acc_norm": 0.6,
              "smoke_ppl/word_perplexity": 2.5e6, "smoke_gen/exact_match": 0.0}
    for seed in (0, 1):
        write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0, eval_scores=scores)
        run = write_run(sweep_dir, sweep, "big", "diloco", seed, DILOCO_VAL[seed], 0.5,
                        eval_scores={**scores, "smoke_choice/acc": 0.31})
        # scored on 1000 items: 0.31 is outside 0.25's band there (±0.027)
        RunDir(run).eval.write_text(json.dumps(
            {"tasks": {"smoke_choice": {"num_samples": 1000}}}))
    (sweep_dir / "sweep.json").write_text(json.dumps(sweep))
    out = tmp_path / "out"
    build_report(sweep_dir, out)
    md = (out / "report.md").read_text()
    table = md.split("## Downstream evaluation")[1].split("##")[0]
    row = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()
           if line.startswith("| smoke")}
    assert row["smoke_choice/acc (chance 0.25)"] == ("| smoke_choice/acc (chance 0.25) | "
                                                    "at chance (0.26 ± 0) | 0.31 ± 0 |")
    assert "| 0.6 ± 0 | 0.6 ± 0 |" in row["smoke_choice/acc_norm (chance 0.25)"]
    assert "at chance (2,500,000 ± 0) | at chance (2,500,000 ± 0) |" in row[
        "smoke_ppl/word_perplexity (chance: perplexity ≥ 10,000)"]
    assert "at chance (0 ± 0) |" in row["smoke_gen/exact_match (chance 0)"]
    down = pd.read_csv(out / "downstream.csv").set_index("label")
    assert down.loc["ddp", "smoke_choice/acc_chance"] == "at chance"
    assert pd.isna(down.loc["big", "smoke_choice/acc_chance"])  # "" reads back as NaN


def test_no_performance_profile_of_a_single_method(tmp_path):
    sweep_dir, sweep = tmp_path / "s", {"name": "s", "runs": {}}
    for seed in (0, 1):
        write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0)
    (sweep_dir / "sweep.json").write_text(json.dumps(sweep))
    out = tmp_path / "out"
    build_report(sweep_dir, out)
    assert not (out / "performance_profile.csv").exists()
    assert "Performance profile" not in (out / "report.md").read_text()
