"""The report's first screen: verdict sentences in words, and runs whose ranks shared
cores marked (projections priced on compute that held waits for a core: ‡; measured
figures of ranks that shared cores: †).

Fixtures as in tests/test_report.py (DDP 40 s to loss 2.0, DiLoCo 15 and 17.5 s).
"""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from bench.run.records import RunDir
from bench.study.report import build_report, load_results
from bench.study.report.verdict import loss_phrase, sentence, speed_phrase
from tests.test_report import DDP_VAL, DILOCO_VAL, make_results, write_run


def _row(clock="wan-1g", speedup=1.9, low=1.7, high=2.1, **more):
    return pd.Series({"clock": clock, "label": "diloco", "baseline": "ddp", "target_loss": 2.1,
                      "runs": 3, "reason": "", "misses": "", "speedup": speedup,
                      "speedup_low": low, "speedup_high": high, "speedup_n": 3,
                      "reached_fraction": 1.0, "median_time_to_target_s": 10.0,
                      "median_speedup": speedup, **more})


def _conv(diff=0.02, half=0.01, n=3):
    return pd.Series({"val_loss_diff": diff, "val_loss_diff_ci": half, "val_loss_diff_n": n})


def test_verdict_sentence_with_intervals_that_resolve():
    text = sentence(_row(), _conv())
    # ±11%: sqrt(2.1 / 1.7) = 1.111, the half-width of the interval on the log scale
    assert text == ("On wan-1g (projected), `diloco` reached loss 2.1 1.9× [1.7, 2.1] faster "
                    "than DDP, ending 0.02 [0.01, 0.03] nats worse (3 seeds resolve ±11% in "
                    "time and ±0.01 nats in loss).")
    assert sentence(_row("measured"), _conv(-0.05, 0.02)).startswith(
        "Measured here, `diloco` reached loss 2.1 1.9× [1.7, 2.1] faster than DDP, ending "
        "0.05 [0.03, 0.07] nats better")


def test_intervals_crossing_one_or_zero_are_said_in_words():
    speed, resolution = speed_phrase(_row(speedup=0.9, low=0.7, high=1.2))
    assert speed == ("reached loss 2.1 no faster or slower than DDP that these seeds can "
                     "tell: 0.9× [0.7, 1.2]")
    assert resolution == "±31%"  # sqrt(1.2 / 0.7) = 1.309
    loss, loss_resolution = loss_phrase(_conv(0.004, 0.01))
    assert loss == "ending no better or worse than DDP that 3 seeds can resolve: ±0.01 nats"
    assert loss_resolution == ""  # said once, in the phrase
    slower, _ = speed_phrase(_row(speedup=0.5, low=0.4, high=0.625))
    assert slower == "reached loss 2.1 2× [1.6, 2.5] slower than DDP"
    one, _ = speed_phrase(_row(low=math.nan, high=math.nan, speedup_n=1))
    assert one == "reached loss 2.1 1.9× faster than DDP (n=1: no interval)"
    assert loss_phrase(_conv(0.03, math.nan, 1))[0] == ("ending 0.03 nats worse (n=1: no "
                                                        "interval)")


def test_report_opens_with_the_verdict(tmp_path):
    out = tmp_path / "out"
    build_report(make_results(tmp_path / "results"), out)
    md = (out / "report.md").read_text()
    assert md.index("## Verdict") < md.index("## Methodology and runs") < md.index(
        "## Speedup vs DDP")
    first = md.split("## Methodology and runs")[0]
    # per-seed log-ratios ln(400/30), ln(400/35): 12.3x [4.6, 33] (t with 1 df: 12.71);
    # half-width 12.71 x sd(logs) / sqrt 2 = 12.71 x ln(35/30) / 2 = 0.980 -> e^0.980 - 1
    # = 166%. Final losses 1.9 and 1.8 against 2.0 and 2.0: -0.15 ± 12.71 x 0.0707 /
    # sqrt 2 = ±0.64, which holds 0: said in words.
    assert ("On wan-1g (projected), `diloco-H10` reached loss 2 12.3× [4.6, 33] faster "
            "than DDP, ending no better or worse than DDP that 2 seeds can resolve: ±0.64 nats "
            "(2 seeds resolve ±166% in time).") in first
    assert ("Measured here, `diloco-H10` reached loss 2 no faster or slower than DDP that "
            "these seeds can tell: 2.47× [0.93, 6.6]") in first
    assert ("**`pier`** against DDP, 1 trial (seed):\n\n- On every clock, `pier` did not "
            "reach loss 2 in its only trial (1 failed)") in first
    html = (out / "report.html").read_text()
    assert html.index("<h2>Verdict</h2>") < html.index("Methodology and runs")
    assert "12.3× [4.6, 33] faster than DDP" in html


# ------------------------------------------------------------------- shared cores


def _runs(tmp_path, **summary_extra):
    sweep_dir, sweep = tmp_path / "s", {"name": "s", "runs": {}}
    for seed in (0, 1):
        write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0,
                  summary_extra=summary_extra)
        write_run(sweep_dir, sweep, "diloco", "diloco", seed, DILOCO_VAL[seed], 0.5,
                  summary_extra=summary_extra)
    (sweep_dir / "sweep.json").write_text(json.dumps(sweep))
    return sweep_dir


def _report(sweep_dir, out):
    build_report(sweep_dir, out)
    md = (out / "report.md").read_text()
    speed = md.split("## Speedup vs DDP")[1]
    line = next(x for x in speed.splitlines() if x.startswith("| diloco |"))
    header = next(x for x in speed.splitlines() if x.startswith("| group |"))
    cells = dict(zip(header.strip("|").split(" | "), line.strip("|").split(" | "),
                     strict=True))
    return md, {k.strip(): v.strip() for k, v in cells.items()}


def test_a_report_over_an_oversubscribed_run_says_so(tmp_path):
    md, cells = _report(_runs(tmp_path, compute_clock="wall", ranks_per_core=2.0),
                        tmp_path / "out")
    first = md.split("## Methodology and runs")[0]
    assert ("**The projections of 4 of 4 runs (`ddp`, `diloco`) are not contention-free:** "
            "they ran 2 ranks per core and measured compute on the wall clock") in first
    assert "The measured clock of 4 of 4 runs (`ddp`, `diloco`) shares cores" in first
    assert "12.3× [4.6, 33] faster than DDP, ending" in first
    assert first.count("‡ not contention-free") == 2  # nvlink and wan-1g
    assert cells["proj. wan-1g"].endswith("‡") and cells["proj. nvlink"].endswith("‡")
    assert cells["measured"].endswith("†")
    assert cells["shares cores"] == ("‡ projections not contention-free; † measured clock "
                                     "shared cores")
    runs = md.split("## All runs")[1]
    row = next(x for x in runs.splitlines() if x.startswith("| diloco-"))
    assert "| 2 | wall |" in row and "‡ projections not contention-free" in row
    assert ("‡ The projected curves or bars of `ddp`, `diloco` are not contention-free"
            in next(x for x in md.splitlines() if x.startswith("_Loss vs time")))
    tokens = md.split("## Throughput and communication")[1]
    assert any(x.startswith("| diloco |") and x.count("‡") == 2 and x.count("†") == 1
               for x in tokens.splitlines())


def test_cpu_time_projections_are_unflagged_but_the_measured_clock_is(tmp_path):
    md, cells = _report(_runs(tmp_path, compute_clock="thread_cpu", ranks_per_core=2.0),
                        tmp_path / "out")
    assert "not contention-free" not in md.split("## Methodology and runs")[0]
    assert "The measured clock of 4 of 4 runs (`ddp`, `diloco`) shares cores" in md
    assert not cells["proj. wan-1g"].endswith("‡") and cells["measured"].endswith("†")
    assert cells["shares cores"] == "† measured clock shared cores"
    assert "‡" not in md


def test_one_rank_per_core_and_gpu_runs_are_not_marked(tmp_path):
    md, cells = _report(_runs(tmp_path, compute_clock="wall", ranks_per_core=1.0),
                        tmp_path / "a")
    assert cells["shares cores"] == "no" and "‡" not in md and "†" not in md
    gpu = _runs(tmp_path / "gpu", compute_clock="wall", ranks_per_core=None, device="cuda:0")
    md, cells = _report(gpu, tmp_path / "b")
    assert cells["shares cores"] == "no" and "unknown" not in md.split("## Methodology")[0]
    assert set(load_results(gpu).runs["ranks_per_core_source"]) == {"GPU"}


def test_older_records_read_as_wall_with_ranks_per_core_from_env_json(tmp_path):
    sweep_dir = _runs(tmp_path)  # no compute_clock, no ranks_per_core
    res = load_results(sweep_dir)
    assert set(res.runs["compute_clock"]) == {"wall"}
    assert not res.runs["compute_clock_recorded"].any()
    assert res.runs["ranks_per_core"].isna().all()
    assert set(res.runs["ranks_per_core_source"]) == {"unknown"}
    md, _ = _report(sweep_dir, tmp_path / "unknown")
    assert "Whether 4 runs (`ddp`, `diloco`) shared cores is unknown" in md
    # env.json of the time: 4 ranks (world_size 4 in the summary) on 2 cores
    for run_dir in sorted(sweep_dir.iterdir()):
        if run_dir.is_dir():
            RunDir(run_dir).env.write_text(json.dumps({"cpu_count": 2, "device": "cpu"}))
    runs = load_results(sweep_dir).runs
    assert list(runs["ranks_per_core"]) == pytest.approx([2.0] * 4)
    assert set(runs["ranks_per_core_source"]) == {"env.json cpu_count"}
    md, cells = _report(sweep_dir, tmp_path / "env")
    assert ("they ran 2 ranks per core (from env.json's cpu_count: at least) and measured "
            "compute on the wall (not recorded: an older record) clock") in md
    assert cells["proj. wan-1g"].endswith("‡")


def test_a_narrow_interval_prints_two_different_ends():
    """Pier's wan-1g speedup in the five-seed quickstart, 1.19x [1.16, 1.23], printed at two
    significant digits read "[1.2, 1.2]": an interval that seems to have no width."""
    from bench.study.report import render

    assert render.bounds(1.16, 1.23) == "[1.16, 1.23]"
    assert render.bounds(0.8, 1.03) == "[0.8, 1]"  # two digits already tell them apart
    assert render.ratio_ci(1.194, 1.158, 1.231, 5) == "1.19× [1.16, 1.23]"
