"""`commbench claims`: the statistics, the claim-file checks, and a whole page from fake runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import yaml

from bench.config import config_hash, to_yaml
from bench.run.summary import val_row
from bench.study.claims import run_claims
from bench.study.claims.decide import (
    FAILS,
    HOLDS,
    INCONCLUSIVE,
    NOT_REPRODUCED,
    NOT_RUN,
    NOT_RUNNABLE,
    REPRODUCED,
    decide,
    decide_rule,
    seeds_to_decide,
    t_interval,
)
from bench.study.claims.spec import Rule, find_claims, load_claim
from bench.study.report.stats import t_quantile
from tests.fakes import make_summary, write_fake_run

REPO = Path(__file__).resolve().parent.parent


def rule(**kw) -> Rule:
    base = dict(name="r", metric="final_val_loss", contrast={"a": 1.0, "b": -1.0}, below=0.0)
    return Rule(**{**base, **kw})


def runs_table(values: dict[str, list], statuses: dict[str, list] | None = None,
               val_sets: dict[str, str] | None = None) -> pd.DataFrame:
    """Runs of variants over seeds 0, 1, ...; `val_sets`: variant -> its validation set."""
    rows = []
    for variant, per_seed in values.items():
        for seed, value in enumerate(per_seed):
            status = (statuses or {}).get(variant, ["ok"] * len(per_seed))[seed]
            rows.append({"variant": variant, "seed": seed, "status": status,
                         "final_val_loss": value, "throughput_tokens_per_s": value,
                         "run_id": f"{variant}-{seed}",
                         "val_set": (val_sets or {}).get(variant, "0123456789ab (64 x 128)")})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- statistics


def test_t_interval_of_known_data():
    iv = t_interval([1.0, 2.0, 3.0])  # mean 2, sd 1, t(0.975, 2) = 4.3027
    assert iv.mean == 2.0 and iv.n == 3
    assert iv.low == pytest.approx(2 - 4.3027 / math.sqrt(3), abs=1e-4)
    assert iv.high == pytest.approx(2 + 4.3027 / math.sqrt(3), abs=1e-4)
    assert math.isnan(t_interval([5.0]).low)


def test_paired_contrast_removes_shared_seed_variation():
    # Each seed shifts both variants by a lot; the paired difference is always -0.1.
    table = runs_table({"a": [2.0, 3.0, 4.0], "b": [2.1, 3.1, 4.1]})
    result = decide_rule(table, rule(below=0.0))
    assert result.per_seed == pytest.approx({0: -0.1, 1: -0.1, 2: -0.1})
    assert result.interval.high == pytest.approx(-0.1)
    assert result.verdict == HOLDS


def test_verdicts_hold_fail_and_straddle():
    table = runs_table({"a": [2.0, 2.1, 2.05], "b": [2.3, 2.35, 2.4]})  # a - b ~ -0.3
    assert decide_rule(table, rule(below=0.0)).verdict == HOLDS
    assert decide_rule(table, rule(below=None, above=0.0)).verdict == FAILS
    noisy = runs_table({"a": [2.0, 2.5, 1.6], "b": [2.1, 2.0, 2.0]})  # -0.1, +0.5, -0.4
    straddle = decide_rule(noisy, rule(below=0.0))
    assert straddle.verdict == INCONCLUSIVE
    assert straddle.interval.low < 0 < straddle.interval.high
    assert "straddles" in straddle.reason


def test_a_straddling_interval_names_the_seeds_that_would_decide_it():
    noisy = runs_table({"a": [2.0, 2.05, 1.8], "b": [2.1, 2.0, 2.0]})  # -0.1, +0.05, -0.2
    result = decide_rule(noisy, rule(below=0.0))
    assert result.verdict == INCONCLUSIVE
    values = list(result.per_seed.values())
    n = seeds_to_decide(values, 0.0)
    assert result.seeds_needed == n and f"about {n} seeds would decide it" in result.reason
    assert result.reason.endswith("the rule would then hold)")  # the mean is below 0
    sd, distance = pd.Series(values).std(), abs(sum(values) / 3)

    def clears(k):  # the interval's half-width plus the 80% margin fits in the distance
        return (t_quantile(0.975, k - 1) + t_quantile(0.8, k - 1)) * sd / k ** 0.5 <= distance

    assert clears(n) and not clears(n - 1)
    # mean 0.1 above the threshold, sd 0.1: about 10 seeds (z-approximation 7.8, t more)
    assert seeds_to_decide([0.0, 0.1, 0.2], -0.0) == next(k for k in range(3, 101) if (
        t_quantile(0.975, k - 1) + t_quantile(0.8, k - 1)) * 0.1 / k ** 0.5 <= 0.1)
    assert seeds_to_decide([0.5, -0.5, 0.0], 0.0) == 101  # no distance: no seed count
    assert seeds_to_decide([0.3], 0.0) is None
    # a decided rule names none
    assert decide_rule(runs_table({"a": [2.0, 2.1, 2.05], "b": [2.3, 2.35, 2.4]}),
                       rule(below=0.0)).seeds_needed is None


def test_runs_of_two_scales_are_not_compared_in_one_rule():
    table = runs_table({"a": [2.0, 2.1, 2.05], "b": [2.3, 2.35, 2.4]})
    table["sweep"] = ["toy-cpu"] * 3 + ["toy-tiny"] * 3
    for metric in ("final_val_loss", "throughput_tokens_per_s"):  # bytes or time as well
        result = decide_rule(table, rule(metric=metric))
        assert result.verdict == INCONCLUSIVE and result.interval.n == 0
        assert result.reason == (
            "runs of 2 sweeps (scales) are not compared in one rule: toy-cpu: a seed 0 "
            "(a-0), a seed 1 (a-1), a seed 2 (a-2); toy-tiny: b seed 0 (b-0), b seed 1 "
            "(b-1), b seed 2 (b-2)")
    table["sweep"] = "toy-cpu"
    assert decide_rule(table, rule()).verdict == HOLDS


def test_two_runs_of_one_variant_and_seed_are_not_compared():
    table = runs_table({"a": [2.0, 2.1, 2.05], "b": [2.3, 2.35, 2.4]})
    extra = table.iloc[[0]].assign(run_id="a-0-older", final_val_loss=1.0)
    result = decide_rule(pd.concat([table, extra]), rule())
    assert result.verdict == INCONCLUSIVE and result.interval.n == 0
    assert result.reason.endswith("a seed 0: a-0, a-0-older")


def test_fewer_than_three_complete_seeds_gives_no_verdict():
    table = runs_table({"a": [2.0, 2.0, 2.0], "b": [3.0, 3.0, 3.0]},
                       statuses={"b": ["ok", "failed", "ok"]})
    result = decide_rule(table, rule(below=0.0))
    assert result.verdict == INCONCLUSIVE and result.interval.n == 2
    assert any("seed 1 left out (b: failed)" in note for note in result.notes)


def test_diverged_runs_are_dropped_or_counted_worst():
    table = runs_table({"a": [2.0, 2.0, 2.0, 2.0], "b": [3.0, math.nan, 3.0, 3.0]},
                       statuses={"b": ["ok", "diverged", "ok", "ok"]})
    dropped = decide_rule(table, rule(below=0.0))
    assert sorted(dropped.per_seed) == [0, 2, 3] and dropped.verdict == HOLDS
    worst = decide_rule(table, rule(below=0.0, diverged="worst"))
    assert worst.per_seed[1] == -math.inf and worst.interval.method == "range"
    assert worst.verdict == HOLDS  # a - inf is below 0 too; the range is [-inf, -1]
    # when the variant that should be lower diverges, the claim fails
    flipped = decide_rule(table, rule(below=0.0, contrast={"b": 1.0, "a": -1.0},
                                      diverged="worst"))
    assert flipped.interval.low == 1.0 and flipped.interval.high == math.inf
    assert flipped.verdict == FAILS


def test_validation_losses_on_different_sets_are_not_compared():
    table = runs_table({"a": [2.0, 2.1, 2.05], "b": [2.3, 2.35, 2.4]},
                       val_sets={"b": "fedcba987654 (128 x 128)"})
    result = decide_rule(table, rule(below=0.0))
    assert result.verdict == INCONCLUSIVE and result.interval.n == 0
    assert result.reason == (
        "final_val_loss is not compared across validation sets, and these runs were scored "
        "on 2: 0123456789ab (64 x 128): a seed 0 (a-0), a seed 1 (a-1), a seed 2 (a-2); "
        "fedcba987654 (128 x 128): b seed 0 (b-0), b seed 1 (b-1), b seed 2 (b-2)")
    # throughput does not depend on the validation set: still decided
    assert decide_rule(table, rule(metric="throughput_tokens_per_s")).verdict == HOLDS


def test_unrecorded_validation_sets_compare_only_when_the_same_and_say_so():
    old = "not recorded (before run.val_sequences): the first 8 x 8 windows of ..."
    table = runs_table({"a": [2.0, 2.1, 2.05], "b": [2.3, 2.35, 2.4]},
                       val_sets={"a": old, "b": old})
    result = decide_rule(table, rule(below=0.0))
    assert result.verdict == HOLDS and f"validation set {old}" in result.notes
    mixed = runs_table({"a": [2.0, 2.1, 2.05], "b": [2.3, 2.35, 2.4]}, val_sets={"a": old})
    assert decide_rule(mixed, rule(below=0.0)).verdict == INCONCLUSIVE


def test_ratio_scale_uses_log_and_reports_ratios():
    table = runs_table({"a": [4.0, 8.0, 2.0], "b": [2.0, 4.0, 1.0]})  # a / b = 2 exactly
    r = decide_rule(table, rule(scale="ratio", below=None, above=1.5))
    assert r.per_seed[0] == pytest.approx(math.log(2))
    assert r.shown(r.interval.mean) == pytest.approx(2.0)
    assert r.verdict == HOLDS


def test_claim_verdict_combines_rules(tmp_path):
    claim = load_claim(write_claim(tmp_path, {}))
    table = runs_table({"ddp": [2.0, 2.1, 2.2], "diloco": [1.9, 2.0, 2.1]})
    assert decide(claim, table).verdict == REPRODUCED
    worse = runs_table({"ddp": [2.0, 2.1, 2.2], "diloco": [2.5, 2.6, 2.7]})
    assert decide(claim, worse).verdict == NOT_REPRODUCED
    few = runs_table({"ddp": [2.0, 2.1], "diloco": [1.9, 2.0]})
    result = decide(claim, few)
    assert result.verdict == INCONCLUSIVE and "fewer than 3" in result.reason


# ------------------------------------------------------------------------ claim files


def claim_data(**changes) -> dict:
    data = {
        "name": "toy",
        "statement": "diloco beats ddp",
        "paper": {"source": "a paper", "where": "Table 1", "numbers": "1 vs 2"},
        "sweep": {"base": "../base.yaml", "variants": {"ddp": {"strategy.name": "ddp"},
                                                    "diloco": {"strategy.name": "diloco"}}},
        "scales": {"tiny": {"seeds": 3}},
        "rules": [{"name": "lower loss", "metric": "final_val_loss",
                   "contrast": {"diloco": 1, "ddp": -1}, "holds_if": {"below": 0.0}}],
    }
    data.update(changes)
    return data


def write_claim(folder: Path, changes: dict) -> Path:
    path = folder / "toy.yaml"
    path.write_text(yaml.safe_dump(claim_data(**changes)))
    return path


BAD_CLAIMS = [
    ({"rules": [{"metric": "final_val_los", "contrast": {"diloco": 1, "ddp": -1},
                 "holds_if": {"below": 0}}]}, "rules[0].metric"),
    ({"rules": [{"metric": "final_val_loss", "contrast": {"diloco": 1, "ddp": -1},
                 "holds_if": {"below": 0, "above": 1}}]}, "exactly one of"),
    ({"rules": [{"metric": "final_val_loss", "contrast": {"diloco": 1, "ddp": -2},
                 "holds_if": {"below": 0}}]}, "must sum to 0"),
    ({"rules": [{"metric": "final_val_loss", "contrast": {"diloko": 1, "ddp": -1},
                 "holds_if": {"below": 0}}]}, "variants of this claim's sweep"),
    ({"rules": [{"metric": "wall_s", "scale": "ratio", "contrast": {"diloco": 1, "ddp": -1},
                 "holds_if": {"below": -1}}]}, "> 0 for scale ratio"),
    ({"scales": {"tiny": {"seeds": 2}}}, "scales.tiny.seeds"),
    ({"scales": {"huge": {"seeds": 3}}}, "one of tiny, cpu, small, paper"),
    ({"rule": []}, "did you mean 'rules'"),
    ({"scales": {"cpu": {"seeds": 3, "resolves": {"lower los": "0.01 nats"}}}},
     "did you mean 'lower loss'"),
    ({"scales": {"cpu": {"seeds": 3, "resolves": {"lower loss": ""}}}},
     "scales.cpu.resolves.lower loss"),
    ({"scales": {"cpu": {"seeds": 3, "resolves": ["0.01 nats"]}}}, "scales.cpu.resolves"),
    ({"paper": {"source": "a paper", "rows": [{"what": "ppl"}]}}, "paper.rows[0]"),
    ({"paper": {"source": "a paper", "rows": "15.02"}}, "paper.rows"),
    ({"rules": [{"metric": "final_val_loss", "contrast": {"diloco": 1, "ddp": -1},
                 "holds_if": {"below": 0}, "paper": 0.98}]}, "rules[0].paper"),
]


@pytest.mark.parametrize("changes,message", BAD_CLAIMS)
def test_bad_claim_files_name_the_key(tmp_path, changes, message):
    path = write_claim(tmp_path, changes)
    with pytest.raises(ValueError, match="toy.yaml") as err:
        load_claim(path)
    assert message in str(err.value)


def test_shipped_claim_files_load():
    claims = find_claims(REPO / "configs" / "claims")
    assert len(claims) == 12
    assert [c.path.name.split("-")[0] for c in claims] == [str(i) for i in range(1, 13)]
    assert all(c.rules and "tiny" in c.scales for c in claims)


def test_every_shipped_claim_has_a_cpu_scale_stating_what_its_seeds_resolve():
    """Issue 45: each rule's smallest resolvable effect is written down before the runs,
    and each claim carries the paper's own numbers to set ours beside."""
    for claim in find_claims(REPO / "configs" / "claims"):
        assert 3 <= claim.scales["cpu"]["seeds"] <= 5, claim.name
        assert claim.paper.get("rows"), claim.name
        for r in claim.rules:
            assert claim.resolution("cpu", r.name), (claim.name, r.name)
            assert r.paper, (claim.name, r.name)


def test_a_resolution_and_the_papers_rows_are_read(tmp_path):
    paper = {"source": "a paper", "rows": [{"what": "DDP", "value": "ppl 15.30"}]}
    claim = load_claim(write_claim(tmp_path, {
        "paper": paper, "scales": {"cpu": {"seeds": 5, "resolves": {
            "lower loss": "+-0.46%\n  at 5 seeds"}}}}))
    assert claim.resolution("cpu", "lower loss") == "+-0.46% at 5 seeds"
    assert claim.resolution("tiny", "lower loss") is None
    assert claim.paper["rows"] == paper["rows"]
    assert "cpu" in claim.sweep_spec("cpu", None, "out")["name"]


# ------------------------------------------------------------------- a page from fake runs


def fake_runner(cfg, run_dir, progress=True) -> dict:
    """A run in milliseconds: DiLoCo's loss is 0.1 below DDP's for every seed; the
    validation set's id stands for its size (a real run hashes the tokens)."""
    loss = 2.0 + 0.05 * cfg.run.seed + (0.0 if cfg.strategy.name == "diloco" else 0.1)
    return fake_run(cfg, run_dir, loss, [val_row(5, 100, 1.0, {}, loss + 0.5)])


def fake_run(cfg, run_dir, loss: float, earlier_rows=()) -> dict:
    """A recorded ok run of `cfg` ending at validation loss `loss` (after `earlier_rows`)."""
    rows = [*earlier_rows, val_row(10, 200, 2.0, {}, loss)]
    n, seq_len = cfg.run.val_sequences, cfg.model.seq_len
    summary = make_summary(status="ok", run_name=cfg.run.name, config_hash=config_hash(cfg),
                           strategy=cfg.strategy.name, world_size=cfg.parallel.world_size,
                           steps=10, total_tokens=200, wall_s=2.0, final_val_loss=loss,
                           val_set={"id": f"{n:06d}{seq_len:06d}", "sequences": n,
                                    "seq_len": seq_len, "tokens": n * seq_len})
    write_fake_run(run_dir, to_yaml(cfg), rows, summary)
    return {**summary, "run_dir": str(run_dir)}


def test_claims_page_from_fake_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    claims_dir = tmp_path / "claims"
    base = {"run": {"name": "base", "steps": 10}, "model": {"preset": "tiny", "seq_len": 32},
            "data": {"corpus": "embedded", "batch_size": 4}, "parallel": {"world_size": 2},
            "strategy": {"name": "ddp"}}
    claims_dir.mkdir()
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    write_claim(claims_dir, {})
    unbuilt = claim_data(name="unbuilt")
    unbuilt["sweep"]["variants"]["diloco"] = {"strategy.name": "no-such-strategy"}
    (claims_dir / "unbuilt.yaml").write_text(yaml.safe_dump(unbuilt))

    page = run_claims(claims_dir=claims_dir, output_dir="results", report_dir="report",
                      runner=fake_runner)
    data = json.loads((tmp_path / "report" / "claims.json").read_text())
    verdicts = {c["name"]: c for c in data["claims"]}
    assert verdicts["toy"]["verdict"] == REPRODUCED
    assert verdicts["toy"]["rules"][0]["mean"] == pytest.approx(-0.1)
    assert verdicts["toy"]["rules"][0]["n"] == 3
    assert verdicts["unbuilt"]["verdict"] == NOT_RUNNABLE
    assert "no-such-strategy" in verdicts["unbuilt"]["reason"]
    html = page.read_text()
    assert "toy: reproduced" in html and "unbuilt: not yet runnable" in html
    assert (tmp_path / "report" / "figures" / "toy.png").exists()
    # a second call trains nothing again (the sweeps resume)
    calls = []
    run_claims(claims_dir=claims_dir, output_dir="results", report_dir="report",
               runner=lambda *a, **k: calls.append(a) or fake_runner(*a, **k))
    assert calls == []


def test_claims_page_refuses_a_loss_rule_across_validation_sets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = {"run": {"name": "base", "steps": 10}, "model": {"preset": "tiny", "seq_len": 32},
            "data": {"corpus": "embedded", "batch_size": 4}, "parallel": {"world_size": 2},
            "strategy": {"name": "ddp"}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    data = claim_data()
    data["sweep"]["variants"]["diloco"]["run.val_sequences"] = 32
    (tmp_path / "claims").mkdir()
    (tmp_path / "claims" / "toy.yaml").write_text(yaml.safe_dump(data))
    run_claims(claims_dir=tmp_path / "claims", output_dir="results", report_dir="report",
               runner=fake_runner)
    (claim,) = json.loads((tmp_path / "report" / "claims.json").read_text())["claims"]
    assert claim["verdict"] == INCONCLUSIVE
    reason = claim["rules"][0]["reason"]
    assert reason.startswith("final_val_loss is not compared across validation sets")
    assert "000064000032 (64 x 32 tokens): ddp seed 0" in reason
    assert "000032000032 (32 x 32 tokens): diloco seed 0" in reason
    md = (tmp_path / "report" / "claims.md").read_text()
    assert "validation set" in md and "000032000032 (32 x 32 tokens)" in md


def _toy_base(tmp_path: Path) -> None:
    base = {"run": {"name": "base", "steps": 10}, "model": {"preset": "tiny", "seq_len": 32},
            "data": {"corpus": "embedded", "batch_size": 4}, "parallel": {"world_size": 2},
            "strategy": {"name": "ddp"}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))


def test_results_page_sets_the_papers_rows_beside_ours(tmp_path, monkeypatch):
    """`commbench claims --scale cpu --results-page docs/results.md`: per claim the paper's
    rows, each rule's pre-stated resolution and the paper's value beside ours (interval,
    verdict); then a report over the records trains nothing, lists a claim without records
    as not run, and leaves out records of a scale's earlier settings."""
    monkeypatch.chdir(tmp_path)
    _toy_base(tmp_path)
    (tmp_path / "claims").mkdir()
    toy = claim_data(
        paper={"source": "a paper", "where": "Table 2", "numbers": "15.02 vs 15.30",
               "rows": [{"what": "DDP, 8x batch", "value": "perplexity 15.30"}]},
        scales={"tiny": {"seeds": 3}, "cpu": {"seeds": 3, "set": {"run.steps": 12},
                "resolves": {"lower loss": "+-0.023 nats at 3 seeds (paired sd 0.0094)"}}})
    toy["rules"][0]["paper"] = "-0.019 (ln 15.02 - ln 15.30)"
    path = tmp_path / "claims" / "toy.yaml"
    path.write_text(yaml.safe_dump(toy))
    other = claim_data(name="other", scales={"cpu": {"seeds": 3}})
    (tmp_path / "claims" / "other.yaml").write_text(yaml.safe_dump(other))

    run_claims(["toy"], scale="cpu", claims_dir="claims", output_dir="results",
               report_dir="report", runner=fake_runner, results_page="docs/results.md",
               command="commbench claims toy --scale cpu")
    md = (tmp_path / "docs" / "results.md").read_text()
    assert md.startswith("# commbench claims (cpu scale)")
    assert "Generated by `commbench claims toy --scale cpu`" in md
    assert "| DDP, 8x batch | perplexity 15.30 |" in md
    assert "+-0.023 nats at 3 seeds (paired sd 0.0094)" in md
    assert "-0.019 (ln 15.02 - ln 15.30)" in md
    assert "-0.1 [-0.1, -0.1] (95% CI, n=3)" in md and "## toy: reproduced" in md
    assert "`run.steps=12`" in md and "![" not in md  # settings shown; no figures
    assert (tmp_path / "docs" / "results.html").exists()
    assert not (tmp_path / "docs" / "figures").exists()
    data = json.loads((tmp_path / "report" / "claims.json").read_text())
    (toy_json,) = data["claims"]
    assert toy_json["resolves"] == {"lower loss": "+-0.023 nats at 3 seeds (paired sd 0.0094)"}
    assert toy_json["rules"][0]["paper"] == "-0.019 (ln 15.02 - ln 15.30)"

    calls = []
    counting = lambda *a, **k: calls.append(a) or fake_runner(*a, **k)  # noqa: E731
    run_claims(scale="cpu", claims_dir="claims", output_dir="results", report_dir="report",
               runner=counting, train=False, results_page="docs/results.md")
    assert calls == []
    verdicts = {c["name"]: c for c in
                json.loads((tmp_path / "report" / "claims.json").read_text())["claims"]}
    assert verdicts["toy"]["verdict"] == REPRODUCED
    assert verdicts["other"]["verdict"] == NOT_RUN
    assert "`commbench claims other --scale cpu` trains its 6 runs" in verdicts["other"]["reason"]
    assert "## other: not run" in (tmp_path / "docs" / "results.md").read_text()

    # the scale's settings change after its runs: the old records are not this scale's
    toy["scales"]["cpu"]["set"] = {"run.steps": 14}
    path.write_text(yaml.safe_dump(toy))
    run_claims(["toy"], scale="cpu", claims_dir="claims", output_dir="results",
               report_dir="report", runner=counting, train=False)
    (toy_json,) = json.loads((tmp_path / "report" / "claims.json").read_text())["claims"]
    assert calls == [] and toy_json["verdict"] == INCONCLUSIVE
    assert toy_json["rules"][0]["n"] == 0
    assert toy_json["notes"][0].startswith("6 record(s) of configs this claim file no longer")


def delay_runner(cfg, run_dir, progress=True) -> dict:
    """A delay study's run in milliseconds: the delay costs 0.2 nats, EF wins half back."""
    loss = 2.0 + 0.05 * cfg.run.seed + 0.2 * cfg.optim.delay
    if cfg.optim.delay_correction == "ef":
        loss -= 0.1
    return fake_run(cfg, run_dir, loss)


def claims_dir_with_a_toy(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    base = {"run": {"name": "base", "steps": 10}, "model": {"preset": "tiny", "seq_len": 32},
            "data": {"corpus": "embedded", "batch_size": 4}, "parallel": {"world_size": 2},
            "strategy": {"name": "ddp"}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    (tmp_path / "claims").mkdir()
    write_claim(tmp_path / "claims", {})
    return tmp_path / "claims"


def write_study(path: Path, ef: dict | None = None) -> Path:
    spec = {"name": "delay-toy", "description": "A toy delay study.", "output_dir": "results",
            "base": {"run": {"name": "delay", "steps": 10, "val_sequences": 16},
                     "model": {"preset": "tiny", "seq_len": 32},
                     "data": {"corpus": "embedded", "batch_size": 4},
                     "parallel": {"world_size": 1}, "strategy": {"name": "ddp"}},
            "seeds": [0, 1, 2],
            "variants": {"adamw-sync": {"optim.delay": 0}, "adamw-delayed": {"optim.delay": 1},
                         "adamw-ef": {"optim.delay": 1, "optim.delay_correction": "ef",
                                      **(ef or {})}}}
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_study_follows_the_claims_on_the_results_page(tmp_path, monkeypatch):
    """`--study`: the sweep is trained (once), and its delay section, with the gaps and
    what EF recovers computed from the records, is on both pages; the results page has no
    figure."""
    claims = claims_dir_with_a_toy(tmp_path, monkeypatch)
    study = write_study(tmp_path / "study.yaml")
    calls = []

    def runner(*a, **k):
        calls.append(a)
        return delay_runner(*a, **k)

    run_claims(claims_dir=claims, output_dir="results", report_dir="report",
               runner=runner, results_page=tmp_path / "results.md", studies=[str(study)])
    assert sum(a[0].run.name.startswith("adamw") for a in calls) == 9
    page = (tmp_path / "results.md").read_text()
    assert page.index("**Of 1 claim at the tiny scale: 1 not reproduced.**") < page.index(
        "Each claim's rule was written")  # the answer in words before the methodology
    assert "# Studies" in page and "Study delay-toy" in page and "One-step delay" in page
    assert "| delayed + EF | 3 (3) | 2.15 ± 0.12 (n=3) | 0.1 ± 0 (n=3; paired) | 50.0% |" in page
    assert "| 0.2 ± 0 (n=3; paired) |" in page and "9 recorded ok" in page
    assert "png" not in page
    assert "One-step delay" in (tmp_path / "report" / "claims.md").read_text()
    assert (tmp_path / "report" / "figures" / "delay_gaps.png").exists()
    calls.clear()
    run_claims(claims_dir=claims, output_dir="results", report_dir="report",
               runner=runner, train=False, studies=[str(study)])
    assert calls == []


def test_a_study_refuses_runs_of_two_validation_sets(tmp_path, monkeypatch):
    """A cell scored on another validation set is not compared with the others."""
    claims = claims_dir_with_a_toy(tmp_path, monkeypatch)
    study = write_study(tmp_path / "study.yaml", ef={"run.val_sequences": 32})
    with pytest.raises(ValueError, match="validation set"):
        run_claims(claims_dir=claims, output_dir="results", report_dir="report",
                   runner=delay_runner, studies=[str(study)])
