"""Small-sample statistics for benchmark claims: t-intervals, paired differences, ratios.

    commbench report results/quickstart -o reports/quickstart   # uses these for every interval

Everything is two-sided with a 95% level unless told otherwise, and returns an `Interval`
(estimate, low, high, n, method). Runs are few (2-5 seeds), so the helpers are explicit
about what they can say: with one value there is no interval (low = high = NaN), and
`Interval.flag` reads "n<3" when fewer than 3 values (or pairs) went into it, since an
interval from 2 seeds rests on one degree of freedom.

- `mean_interval(x)`: mean ± t(n-1) s/√n.
- `paired_interval(a, b)`: mean of a_s - b_s over the keys (seeds) both share.
- `welch_interval(a, b)`: mean(a) - mean(b), two-sample with unequal variances
  (Welch-Satterthwaite degrees of freedom).
- `ratio_interval(num, den)`: the geometric mean of num/den with the interval computed on
  log-ratios, then exponentiated (asymmetric around the estimate). Paired by key when both
  hold the same keys (seeds), else Welch on the logs, so the baseline's own spread counts
  (no value is dropped to make pairs).
  The arithmetic mean of per-seed ratios is biased upward (Jensen), the geometric mean is not.

Student's t quantiles come from scipy (also for the non-integer degrees of freedom of
Welch's interval).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import scipy.stats

LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """An estimate with its confidence interval [low, high] from `n` values (or pairs)."""

    estimate: float
    low: float
    high: float
    n: int
    method: str
    """How it was computed: "mean", "paired", "welch", "paired log-ratio", "welch log-ratio"."""

    @property
    def half_width(self) -> float:
        """(high - low) / 2: the ± of a symmetric interval."""
        return (self.high - self.low) / 2

    @property
    def flag(self) -> str:
        """"n<3" when the interval rests on fewer than 3 values, else ""."""
        return "n<3" if self.n < 3 else ""

    def contains(self, value: float) -> bool:
        """True when `value` lies inside [low, high] (False when there is no interval)."""
        return math.isfinite(self.low) and self.low <= value <= self.high

    def excludes(self, value: float) -> bool:
        """True when `value` lies outside [low, high] (False when there is no interval)."""
        return math.isfinite(self.low) and (value < self.low or value > self.high)


def _finite(values: Iterable) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


# ------------------------------------------------------------------ Student's t quantile


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with `df` > 0 (not necessarily integer) degrees of freedom."""
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if not 0.0 < p < 1.0:
        raise ValueError(f"probability must be in (0, 1), got {p}")
    return float(scipy.stats.t.ppf(p, df))


def t_quantile_975(df: float) -> float:
    """The 0.975 quantile of Student's t (the factor of a two-sided 95% interval)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return t_quantile(0.975, df)


# ------------------------------------------------------------------------- intervals


def _none(estimate: float, n: int, method: str) -> Interval:
    return Interval(estimate, math.nan, math.nan, n, method)


def mean_interval(values: Iterable, level: float = LEVEL) -> Interval:
    """Mean ± t(n-1) · s/√n over the finite values; no interval below 2 values."""
    x = _finite(values)
    n = len(x)
    if n == 0:
        return _none(math.nan, 0, "mean")
    mean = sum(x) / n
    if n == 1:
        return _none(mean, 1, "mean")
    sd = math.sqrt(sum((v - mean) ** 2 for v in x) / (n - 1))
    half = t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, "mean")


def mean_ci(values: Iterable) -> tuple[float, float, int]:
    """(mean, 95% half-width, n) over the finite values; half-width NaN when n < 2."""
    ci = mean_interval(values)
    return ci.estimate, ci.half_width, ci.n


def paired_differences(a: Mapping, b: Mapping) -> dict:
    """{key: a[key] - b[key]} over the keys both hold with finite values (keys: seeds)."""
    out = {}
    for key, value in a.items():
        other = b.get(key)
        if _finite([value]) and _finite([other]):
            out[key] = float(value) - float(other)
    return out


def paired_interval(a: Mapping, b: Mapping, level: float = LEVEL) -> Interval:
    """Mean of the paired differences a[s] - b[s] with its t-interval (n = pairs)."""
    ci = mean_interval(paired_differences(a, b).values(), level)
    return Interval(ci.estimate, ci.low, ci.high, ci.n, "paired")


def welch_interval(a: Iterable, b: Iterable, level: float = LEVEL) -> Interval:
    """mean(a) - mean(b) with Welch's two-sample interval; n = the smaller sample size.

    Both variances count (SE² = s_a²/n_a + s_b²/n_b) with the Welch-Satterthwaite degrees
    of freedom. No interval unless both samples hold 2+ values (a variance needs two)."""
    x, y = _finite(a), _finite(b)
    if not x or not y:
        return _none(math.nan, min(len(x), len(y)), "welch")
    mx, my = sum(x) / len(x), sum(y) / len(y)
    n = min(len(x), len(y))
    if n < 2:
        return _none(mx - my, n, "welch")
    vx = sum((v - mx) ** 2 for v in x) / (len(x) - 1) / len(x)
    vy = sum((v - my) ** 2 for v in y) / (len(y) - 1) / len(y)
    se2 = vx + vy
    if se2 == 0:
        return Interval(mx - my, mx - my, mx - my, n, "welch")
    df = se2**2 / (vx**2 / (len(x) - 1) + vy**2 / (len(y) - 1))
    half = t_quantile(0.5 + level / 2, df) * math.sqrt(se2)
    return Interval(mx - my, mx - my - half, mx - my + half, n, "welch")


def ratio_interval(num: Mapping, den: Mapping, level: float = LEVEL) -> Interval:
    """Geometric mean of num/den with the interval on log-ratios, exponentiated.

    `num` and `den` map a key (seed) to a positive value. Paired (log num[s] - log den[s])
    when both hold the same keys with positive values; otherwise unpaired (Welch on log num
    vs log den, so the spread of both groups counts)."""
    logs_num = {k: math.log(v) for k, v in num.items() if _positive(v)}
    logs_den = {k: math.log(v) for k, v in den.items() if _positive(v)}
    if logs_num and set(logs_num) == set(logs_den):
        ci, method = paired_interval(logs_num, logs_den, level), "paired log-ratio"
    else:
        ci = welch_interval(logs_num.values(), logs_den.values(), level)
        method = "welch log-ratio"
    return Interval(_exp(ci.estimate), _exp(ci.low), _exp(ci.high), ci.n, method)


def _positive(value) -> bool:
    return bool(_finite([value])) and float(value) > 0


def _exp(value: float) -> float:
    return math.exp(value) if math.isfinite(value) else math.nan
