"""Deciding a claim: paired contrasts per seed, a t-interval, and a three-way verdict.

Exercised by `pytest tests/test_claims.py`. For each rule, every seed that has a usable run
of every variant in the contrast gives one number, `sum(coef * metric)` (or of `log metric`
for ratio rules): pairing by seed removes the variation the variants share (same data
order, same initialisation). Over those numbers: the mean and the two-sided 95% Student-t
interval, `mean ± t(0.975, n-1) · sd / sqrt(n)`.

- holds: the whole interval is on the claimed side of the threshold;
- fails: the whole interval is on the other side (touching the threshold counts as failing);
- inconclusive: the interval straddles the threshold, or fewer than MIN_SEEDS seeds are
  complete (failed, partial or missing runs drop their seed and are listed). A straddling
  interval names the seeds a power estimate says would decide it (`seeds_to_decide`).

A rule compares runs of one sweep only, and a claim's sweep is one scale (`NAME-SCALE`):
runs of the rule's variants from several sweeps (records of two scales gathered in one
folder) make it inconclusive, naming each sweep with its runs; so does a variant with two
runs of one seed (two configs under one name: `commbench claims` keeps only the records
of the configs the claim file asks for now, bench/study/claims/__init__.py).

A rule on a validation loss (`VALIDATION_METRICS`) compares only runs scored on one
validation set (the `val_set` column, bench/study/report/load.py): when the runs of its
variants name several, the rule is inconclusive and its reason lists each set with its
runs; runs whose set was not recorded (records from before run.val_sequences) are
compared only with runs whose configs imply the same set, and the rule says so.

A diverged run drops its seed, unless the rule says `diverged: worst`: then its metric is
+infinity, and since a t-interval of infinite values means nothing, the interval becomes
the range [min, max] of the per-seed contrasts (said in the output). A claim is reproduced
when every rule holds, not reproduced when any rule fails, inconclusive otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from bench.study.claims.spec import MAX_SEEDS, MIN_SEEDS, VALIDATION_METRICS, Claim, Rule
from bench.study.report.stats import mean_interval, t_quantile

HOLDS, FAILS, INCONCLUSIVE = "holds", "fails", "inconclusive"
POWER = 0.8
"""The chance a repeat at `seeds_to_decide` seeds decides the rule, if the observed mean and
spread were the truth."""
REPRODUCED, NOT_REPRODUCED = "reproduced", "not reproduced"
NOT_RUNNABLE = "not yet runnable"
NOT_RUN = "not run"
"""A report over records (`commbench claims --report-only`) that finds none at this scale."""


@dataclass
class Interval:
    mean: float
    low: float
    high: float
    n: int
    method: str = "t"
    """t (Student-t 95%), range (min..max, when a diverged run counts as infinite), none."""


@dataclass
class RuleResult:
    rule: Rule
    verdict: str
    interval: Interval
    per_seed: dict[int, float]
    notes: list[str] = field(default_factory=list)
    reason: str = ""
    """Why the rule is inconclusive (too few seeds, or the interval straddles)."""
    seeds_needed: int | None = None
    """For a straddling interval: the seeds that would decide it (`seeds_to_decide`);
    None when decided, or when no spread or distance is known."""

    def shown(self, value: float) -> float:
        """A contrast value on the scale the reader expects (ratios, not log-ratios)."""
        return math.exp(value) if self.rule.scale == "ratio" else value


@dataclass
class ClaimResult:
    claim: Claim
    verdict: str
    rules: list[RuleResult] = field(default_factory=list)
    reason: str = ""
    """Why the claim is inconclusive or not runnable, in one line."""
    seeds: int = 0
    runs: pd.DataFrame | None = None
    notes: list[str] = field(default_factory=list)
    """What the reader should know about the records (e.g. older records left out)."""


def t_interval(values: list[float]) -> Interval:
    """Mean and 95% interval; a range when a value is infinite; NaN bounds when n < 2."""
    x = np.asarray(values, dtype=float)
    n = len(x)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, "none")
    if not np.all(np.isfinite(x)):
        return Interval(float(np.mean(x)) if np.all(x == x[0]) else math.nan,
                        float(x.min()), float(x.max()), n, "range")
    shared = mean_interval(x)
    return Interval(shared.estimate, shared.low, shared.high, n, "t" if n > 1 else "none")


def verdict_of(interval: Interval, rule: Rule) -> str:
    """holds / fails / inconclusive for one rule's interval (n checked by the caller)."""
    if math.isnan(interval.low) or math.isnan(interval.high):
        return INCONCLUSIVE
    threshold = rule.threshold
    if rule.below is not None:
        if interval.high < threshold:
            return HOLDS
        return FAILS if interval.low >= threshold else INCONCLUSIVE
    if interval.low > threshold:
        return HOLDS
    return FAILS if interval.high <= threshold else INCONCLUSIVE


def seeds_to_decide(values: list[float], threshold: float, power: float = POWER,
                    limit: int = MAX_SEEDS) -> int | None:
    """Seeds at which a 95% interval would exclude `threshold` with probability `power`,
    if the per-seed contrasts' observed mean and sd were the truth: the least n >= 3 with
    (t(0.975, n-1) + t(power, n-1)) sd / sqrt(n) <= |mean - threshold|; `limit` + 1 when
    even `limit` seeds would not; None with fewer than 2 finite values or no spread."""
    x = np.asarray([v for v in values if math.isfinite(v)], dtype=float)
    if len(x) < 2:
        return None
    sd, distance = float(np.std(x, ddof=1)), abs(float(np.mean(x)) - threshold)
    if sd == 0 or distance == 0:
        return None if sd == 0 else limit + 1
    for n in range(MIN_SEEDS, limit + 1):
        if (t_quantile(0.975, n - 1) + t_quantile(power, n - 1)) * sd / math.sqrt(n) \
                <= distance:
            return n
    return limit + 1


def _seeds_text(n: int | None, verdict: str) -> str:
    if n is None:
        return ""
    if n > MAX_SEEDS:
        return f"; more than {MAX_SEEDS} seeds would be needed at this spread"
    return (f"; about {n} seeds would decide it ({POWER:.0%} power, the observed mean and "
            f"spread taken as true; the rule would then {'hold' if verdict == HOLDS else 'fail'})")


def _run_value(row: pd.Series, rule: Rule) -> tuple[float | None, str | None]:
    """The metric of one run for this rule, or (None, why the seed is dropped)."""
    status = row["status"]
    if status == "diverged":
        if rule.diverged == "worst":
            return math.inf, None
        return None, "diverged"
    if status != "ok":
        return None, status
    value = row.get(rule.metric, math.nan)
    if value is None or not isinstance(value, int | float) or math.isnan(value):
        return None, f"no {rule.metric}"
    if rule.scale == "ratio":
        if value <= 0:
            return None, f"{rule.metric} = {value} (a ratio needs > 0)"
        return math.log(value), None
    return float(value), None


def contrasts(runs: pd.DataFrame, rule: Rule) -> tuple[dict[int, float], list[str]]:
    """Per-seed contrast values, and a note for every seed that had to be dropped."""
    per_seed: dict[int, float] = {}
    notes: list[str] = []
    for seed in sorted(runs["seed"].dropna().unique()):
        total, dropped = 0.0, []
        for variant, coef in rule.contrast.items():
            match = runs[(runs["variant"] == variant) & (runs["seed"] == seed)]
            if match.empty:
                dropped.append(f"{variant}: no run")
                continue
            value, why = _run_value(match.iloc[0], rule)
            if why:
                dropped.append(f"{variant}: {why}")
            else:
                total += coef * value
        if dropped:
            notes.append(f"seed {int(seed)} left out ({'; '.join(dropped)})")
        elif math.isnan(total):
            notes.append(f"seed {int(seed)} left out (diverged on both sides of the contrast)")
        else:
            per_seed[int(seed)] = total
    return per_seed, notes


def validation_sets(runs: pd.DataFrame, rule: Rule) -> dict[str, list[str]]:
    """The validation sets of the runs of the rule's variants: name -> "variant seed N
    (run id)" of each run on it ({} for a metric that is not a validation loss)."""
    if rule.metric not in VALIDATION_METRICS or "val_set" not in runs:
        return {}
    sets: dict[str, list[str]] = {}
    for _, row in runs[runs["variant"].isin(list(rule.contrast))].iterrows():
        where = f" ({row['run_id']})" if "run_id" in row else ""
        sets.setdefault(row["val_set"], []).append(
            f"{row['variant']} seed {row['seed']}{where}")
    return sets


def sweeps_of(runs: pd.DataFrame, rule: Rule) -> dict[str, list[str]]:
    """The sweeps (for a claim: its scales) the runs of the rule's variants come from:
    name -> "variant seed N (run id)" of each ({} when the table has no sweep column)."""
    if "sweep" not in runs:
        return {}
    found: dict[str, list[str]] = {}
    for _, row in runs[runs["variant"].isin(list(rule.contrast))].iterrows():
        where = f" ({row['run_id']})" if "run_id" in row else ""
        found.setdefault(str(row["sweep"]), []).append(
            f"{row['variant']} seed {row['seed']}{where}")
    return found


def repeated_runs(runs: pd.DataFrame, rule: Rule) -> list[str]:
    """"variant seed N: run ids" for each variant and seed of the rule with more than one
    run: records of two configs under one name (a scale's settings changed after its runs)."""
    mine = runs[runs["variant"].isin(list(rule.contrast))]
    found = []
    for (variant, seed), group in mine.groupby(["variant", "seed"], sort=True):
        if len(group) > 1:
            ids = ", ".join(map(str, group["run_id"])) if "run_id" in group else len(group)
            found.append(f"{variant} seed {seed}: {ids}")
    return found


def decide_rule(runs: pd.DataFrame, rule: Rule) -> RuleResult:
    sweeps = sweeps_of(runs, rule)
    if len(sweeps) > 1:
        reason = (f"runs of {len(sweeps)} sweeps (scales) are not compared in one rule: "
                  + "; ".join(f"{name or 'no sweep'}: {', '.join(members)}"
                              for name, members in sweeps.items()))
        return RuleResult(rule, INCONCLUSIVE, t_interval([]), {}, [], reason)
    repeated = repeated_runs(runs, rule)
    if repeated:
        reason = ("a variant and seed has several runs (records of different configs are "
                  "not compared; retire the ones that are not this scale's): "
                  + "; ".join(repeated))
        return RuleResult(rule, INCONCLUSIVE, t_interval([]), {}, [], reason)
    sets = validation_sets(runs, rule)
    if len(sets) > 1:
        reason = (f"{rule.metric} is not compared across validation sets, and these runs "
                  "were scored on " + str(len(sets)) + ": " + "; ".join(
                      f"{name}: {', '.join(members)}" for name, members in sets.items()))
        return RuleResult(rule, INCONCLUSIVE, t_interval([]), {}, [], reason)
    per_seed, notes = contrasts(runs, rule)
    notes += [f"validation set {name}" for name in sets if name.startswith("not recorded")]
    interval = t_interval(list(per_seed.values()))
    reason, needed = "", None
    if interval.n < MIN_SEEDS:
        verdict = INCONCLUSIVE
        reason = f"{interval.n} complete seed(s); no verdict from fewer than {MIN_SEEDS}"
    else:
        verdict = verdict_of(interval, rule)
        if verdict == INCONCLUSIVE:
            needed = seeds_to_decide(list(per_seed.values()), rule.threshold)
            leaning = verdict_of(Interval(interval.mean, interval.mean, interval.mean,
                                          interval.n), rule)
            reason = "the interval straddles the threshold" + _seeds_text(needed, leaning)
    return RuleResult(rule, verdict, interval, per_seed, notes, reason, needed)


def decide(claim: Claim, runs: pd.DataFrame) -> ClaimResult:
    """The verdict of `claim` from its sweep's runs (columns variant, seed, status, metrics)."""
    results = [decide_rule(runs, rule) for rule in claim.rules]
    verdicts = [r.verdict for r in results]
    if FAILS in verdicts:
        verdict = NOT_REPRODUCED
        reason = "; ".join(f"{r.rule.name} fails" for r in results if r.verdict == FAILS)
    elif all(v == HOLDS for v in verdicts):
        verdict, reason = REPRODUCED, ""
    else:
        verdict = INCONCLUSIVE
        reason = "; ".join(f"{r.rule.name}: {r.reason}" for r in results
                           if r.verdict == INCONCLUSIVE)
    seeds = max((r.interval.n for r in results), default=0)
    return ClaimResult(claim, verdict, results, reason, seeds, runs)
