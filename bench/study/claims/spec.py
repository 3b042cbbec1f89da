"""Claim files: a published claim, the sweep that tests it, and the rule that decides it.

`commbench claims --dry-run` lists the claims in configs/claims/ and the runs each needs.
A claim file is YAML, written BEFORE its runs:

    name: diloco-matches-ddp
    statement: DiLoCo reaches DDP's validation loss within 0.15 at about H x fewer bytes.
    paper: {source: "Douillard et al. 2023 (arXiv 2311.08105)", where: Table 2,
            numbers: "150M, 8 replicas, H=500: ppl 15.02 (DiLoCo) vs 15.30 (DDP, 8x batch)",
            rows: [{what: "DDP, 8x batch", value: "ppl 15.30"}]}   # the page's paper table
    reconstruction: null          # what of the method is our reconstruction, if anything
    sweep:                        # a sweep spec (bench/study/sweep/); base relative to this file
      base: ../ddp-tiny.yaml
      variants: {ddp: {strategy.name: ddp}, diloco: {strategy.name: diloco}}
    scales:                       # --scale picks one; its `set` is merged into the sweep's
      tiny: {seeds: 3}
      cpu:
        seeds: 5
        set: {model.preset: cpu, data.corpus: shakespeare}
        resolves:                 # per rule, before the runs: the smallest effect these
          loss within margin: "+-0.46% at 5 seeds (paired sd 0.37%)"   # seeds resolve
      small: {seeds: 3, set: {model.preset: small}}
    rules:                        # every rule must hold for "reproduced"
      - name: loss within margin
        metric: final_val_loss    # a run-summary number (see METRICS) or proj.PROFILE.KEY
        contrast: {diloco: 1, ddp: -1}   # per seed: sum of coefficient x metric
        holds_if: {below: 0.15}   # the claim holds if the whole 95% interval is below 0.15
        paper: "0.98 (ppl)"       # optional: the paper's value of this contrast, as text
      - name: bytes
        metric: comm_bytes_total
        scale: ratio              # contrast of log(metric); thresholds given as ratios
        contrast: {diloco: 1, ddp: -1}
        holds_if: {below: 0.2}

The statistics and the verdicts are in bench/study/claims/decide.py.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.config.typed import NAME_RULE, is_name

SCALES = ("tiny", "cpu", "small", "paper")
"""tiny: seconds, for the tests; cpu: a 2-core laptop (docs/cpu-scale.md); small: one GPU
box; paper: the paper's size (a cluster)."""
MIN_SEEDS = 3
"""No verdict is given from fewer seeds than this."""
MAX_SEEDS = 100
"""Seeds per variant at most (a claim file's or --seeds): beyond, a typo that would list
or train hundreds of thousands of runs."""

METRICS = (
    "final_val_loss", "best_val_loss", "wall_s", "throughput_tokens_per_s", "total_tokens",
    "comm_bytes_total", "comm_s_total", "compute_s_total", "comm_peak_sync_bytes",
)
"""Run-summary numbers a rule may use, besides `proj.PROFILE.KEY` and `eval.TASK/METRIC`."""
VALIDATION_METRICS = ("final_val_loss", "best_val_loss")
"""Metrics that are validation losses: compared only between runs on one validation set."""
_PROJECTED = re.compile(r"^proj\.[A-Za-z0-9_-]+\.(step_s|total_s|comm_s|throughput_tokens_per_s)$")
_EVAL = re.compile(r"^eval\.[^\s]+$")
_CLAIM_KEYS = ("name", "statement", "paper", "reconstruction", "sweep", "scales", "rules")
_RULE_KEYS = ("name", "metric", "contrast", "scale", "holds_if", "diverged", "paper")
_SCALE_KEYS = ("seeds", "set", "executor", "resolves")
_ROW_KEYS = ("what", "value")


@dataclass
class Rule:
    name: str
    metric: str
    contrast: dict[str, float]
    """Variant -> coefficient; per seed the contrast is sum(coef * metric) (or of log metric)."""
    below: float | None = None
    above: float | None = None
    scale: str = "difference"
    """difference (metric as is) or ratio (log metric; thresholds are ratios)."""
    diverged: str = "exclude"
    """exclude (a diverged run drops its seed) or worst (it counts as +infinity)."""
    paper: str | None = None
    """The paper's own value of this contrast (or why there is none), as text."""

    @property
    def threshold(self) -> float:
        """The threshold on the contrast's own scale (log for ratios)."""
        value = self.below if self.below is not None else self.above
        return math.log(value) if self.scale == "ratio" else value

    def describe(self) -> str:
        ordered = sorted(self.contrast.items(), key=lambda item: item[1] < 0)  # + terms first
        terms = " ".join(f"{'+' if c > 0 else '-'} {_coef(c)}{v}" for v, c in ordered)
        terms = terms.removeprefix("+ ")
        what = f"log {self.metric}" if self.scale == "ratio" else self.metric
        side = f"< {self.below:g}" if self.below is not None else f"> {self.above:g}"
        unit = " (as a ratio)" if self.scale == "ratio" else ""
        return (f"95% interval of [{terms}] on {what}, paired by seed, entirely {side}{unit}"
                + ("; a diverged run counts as the worst value" if self.diverged == "worst"
                   else ""))


def _coef(c: float) -> str:
    return "" if abs(c) == 1 else f"{abs(c):g}·"


@dataclass
class Claim:
    name: str
    statement: str
    path: Path
    paper: dict[str, Any]
    reconstruction: str | None
    sweep: dict[str, Any]
    scales: dict[str, dict[str, Any]]
    rules: list[Rule] = field(default_factory=list)

    def resolution(self, scale: str, rule: str) -> str | None:
        """The smallest effect `scale`'s seeds resolve for `rule`, as stated before its runs."""
        text = (self.scales.get(scale) or {}).get("resolves", {}).get(rule)
        return " ".join(str(text).split()) if text else None

    def sweep_spec(self, scale: str, seeds: int | None, output_dir: str) -> dict[str, Any]:
        """The sweep spec for `scale`, with the base config made absolute."""
        if scale not in self.scales:
            raise ValueError(f"claim {self.name}: scale {scale!r} is not defined in {self.path} "
                             f"(defined: {', '.join(self.scales)})")
        chosen = self.scales[scale] or {}
        spec = copy.deepcopy(self.sweep)
        spec["name"] = f"{self.name}-{scale}"
        spec["set"] = {**spec.get("set", {}), **chosen.get("set", {})}
        count = seeds if seeds is not None else chosen.get("seeds", MIN_SEEDS)
        if not 1 <= count <= MAX_SEEDS:
            raise ValueError(f"--seeds must be from 1 to {MAX_SEEDS}, got {count}")
        spec["seeds"] = list(range(count))
        if "executor" in chosen:
            spec["executor"] = chosen["executor"]
        spec["output_dir"] = output_dir
        base = spec.get("base")
        if isinstance(base, str):
            spec["base"] = str((self.path.parent / base).resolve())
        return spec


def _fail(path: Path, key: str, value: Any, valid: str) -> ValueError:
    return ValueError(f"{path}: {key} = {value!r} is not valid; {valid}")


def _known(path: Path, where: str, data: dict, keys: tuple[str, ...]) -> None:
    for key in data:
        if key not in keys:
            close = difflib.get_close_matches(str(key), keys, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{path}: unknown key {where}{key!r}{hint}; valid keys: "
                             f"{', '.join(keys)}")


def _parse_rule(path: Path, i: int, data: Any, variants: set[str]) -> Rule:
    where = f"rules[{i}]"
    if not isinstance(data, dict):
        raise _fail(path, where, data, "each rule is a mapping with metric, contrast, holds_if")
    _known(path, f"{where}.", data, _RULE_KEYS)
    metric = data.get("metric")
    if not (metric in METRICS or _PROJECTED.match(str(metric)) or _EVAL.match(str(metric))):
        raise _fail(path, f"{where}.metric", metric,
                    f"valid: {', '.join(METRICS)}, proj.PROFILE.(step_s|total_s|comm_s|"
                    "throughput_tokens_per_s), eval.TASK/METRIC")
    contrast = data.get("contrast")
    if not isinstance(contrast, dict) or len(contrast) < 2:
        raise _fail(path, f"{where}.contrast", contrast,
                    "a mapping of at least two sweep variants to coefficients")
    for variant, coef in contrast.items():
        if variant not in variants:
            raise _fail(path, f"{where}.contrast", variant,
                        f"variants of this claim's sweep: {', '.join(sorted(variants))}")
        if not isinstance(coef, int | float) or isinstance(coef, bool) or coef == 0 \
                or not math.isfinite(coef):
            raise _fail(path, f"{where}.contrast.{variant}", coef, "a finite non-zero number")
    if abs(sum(contrast.values())) > 1e-9:
        raise _fail(path, f"{where}.contrast", contrast,
                    "coefficients must sum to 0 (a contrast compares like with like)")
    holds = data.get("holds_if")
    if not isinstance(holds, dict) or len(holds) != 1 or next(iter(holds)) not in ("below",
                                                                                   "above"):
        raise _fail(path, f"{where}.holds_if", holds, "exactly one of {below: X} or {above: X}")
    side, value = next(iter(holds.items()))
    scale = data.get("scale", "difference")
    if scale not in ("difference", "ratio"):
        raise _fail(path, f"{where}.scale", scale, "difference or ratio")
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) \
            or (scale == "ratio" and value <= 0):
        raise _fail(path, f"{where}.holds_if.{side}", value,
                    "a finite number (> 0 for scale ratio)")
    diverged = data.get("diverged", "exclude")
    if diverged not in ("exclude", "worst"):
        raise _fail(path, f"{where}.diverged", diverged, "exclude or worst")
    paper = data.get("paper")
    if paper is not None and not (isinstance(paper, str) and paper.strip()):
        raise _fail(path, f"{where}.paper", paper, "the paper's value of this contrast, as text")
    return Rule(name=str(data.get("name") or f"rule {i + 1}"), metric=str(metric),
                contrast={str(k): float(v) for k, v in contrast.items()},
                below=float(value) if side == "below" else None,
                above=float(value) if side == "above" else None, scale=scale,
                diverged=diverged, paper=" ".join(paper.split()) if paper else None)


def _check_resolves(path: Path, scale: str, resolves: Any, rules: list[Rule]) -> None:
    """`scales.SCALE.resolves`: rule name -> the smallest effect the scale's seeds resolve."""
    names = [r.name for r in rules]
    if not isinstance(resolves, dict):
        raise _fail(path, f"scales.{scale}.resolves", resolves,
                    "a mapping from rule names to what the seeds resolve, as text")
    for name, text in resolves.items():
        if name not in names:
            close = difflib.get_close_matches(str(name), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise _fail(path, f"scales.{scale}.resolves", name,
                        f"a rule name{hint}; rules: {', '.join(names)}")
        if not isinstance(text, str) or not text.strip():
            raise _fail(path, f"scales.{scale}.resolves.{name}", text,
                        "the smallest effect the seeds resolve, as text")


def _check_paper(path: Path, paper: Any) -> None:
    if not isinstance(paper, dict):
        raise _fail(path, "paper", paper, "a mapping with source, where, numbers (and rows)")
    rows = paper.get("rows", [])
    if not isinstance(rows, list):
        raise _fail(path, "paper.rows", rows, "a list of {what, value} mappings")
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or set(row) != set(_ROW_KEYS) or not all(
                isinstance(row[k], str | int | float) for k in _ROW_KEYS):
            raise _fail(path, f"paper.rows[{i}]", row,
                        "a mapping {what: ..., value: ...} (the paper's own number, as text)")


def load_claim(path: str | os.PathLike) -> Claim:
    """Parse and check one claim file; errors name the file, the key and what is valid."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ValueError(f"{path}: cannot read claim file ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a claim file is a YAML mapping with keys "
                         f"{', '.join(_CLAIM_KEYS)}")
    _known(path, "", data, _CLAIM_KEYS)
    name = data.get("name", path.stem)
    if not is_name(name):
        raise _fail(path, "name", name, f"{NAME_RULE} (it names the claim's sweep directory)")
    for key in ("statement", "sweep", "scales", "rules"):
        if not data.get(key):
            raise ValueError(f"{path}: missing {key!r}")
    sweep = data["sweep"]
    if not isinstance(sweep, dict) or not isinstance(sweep.get("variants"), dict):
        raise _fail(path, "sweep", sweep, "a sweep spec with named variants")
    for key in ("seeds", "name", "output_dir"):
        if key in sweep:
            raise ValueError(f"{path}: sweep.{key} is set by `commbench claims` "
                             "(seeds per scale under scales.SCALE.seeds); remove it")
    scales = data["scales"]
    if not isinstance(scales, dict):
        raise _fail(path, "scales", scales, f"a mapping from {', '.join(SCALES)} to settings")
    for scale, settings in scales.items():
        if scale not in SCALES:
            raise _fail(path, "scales", scale, f"one of {', '.join(SCALES)}")
        settings = settings or {}
        _known(path, f"scales.{scale}.", settings, _SCALE_KEYS)
        seeds = settings.get("seeds", MIN_SEEDS)
        if not isinstance(seeds, int) or isinstance(seeds, bool) or \
                not MIN_SEEDS <= seeds <= MAX_SEEDS:
            raise _fail(path, f"scales.{scale}.seeds", seeds,
                        f"an integer from {MIN_SEEDS} (no verdict from fewer seeds) to "
                        f"{MAX_SEEDS}")
    rules_data = data["rules"]
    if not isinstance(rules_data, list):
        raise _fail(path, "rules", rules_data, "a list of rules")
    variants = set(sweep["variants"])
    rules = [_parse_rule(path, i, r, variants) for i, r in enumerate(rules_data)]
    for scale, settings in scales.items():
        if (settings or {}).get("resolves") is not None:
            _check_resolves(path, scale, settings["resolves"], rules)
    paper = data.get("paper") or {}
    _check_paper(path, paper)
    return Claim(name=name, statement=" ".join(str(data["statement"]).split()), path=path,
                 paper=paper, reconstruction=data.get("reconstruction"), sweep=sweep,
                 scales={k: v or {} for k, v in scales.items()}, rules=rules)


def find_claims(claims_dir: str | os.PathLike, names: list[str] | None = None) -> list[Claim]:
    """The claims in `claims_dir` (all, or those named), in file-name order with numbers
    read as numbers (9-x before 10-y)."""
    claims_dir = Path(claims_dir)
    files = sorted(claims_dir.glob("*.yaml"),
                   key=lambda f: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", f.name)])
    if not files:
        raise ValueError(f"no claim files (*.yaml) in {str(claims_dir)!r}")
    claims = [load_claim(f) for f in files]
    first: dict[str, Claim] = {}
    for claim in claims:  # one name, one sweep directory: two would mix their runs
        if claim.name in first:
            raise ValueError(f"claim name {claim.name!r} is given by two files, "
                             f"{first[claim.name].path} and {claim.path}; their runs would "
                             "share one sweep directory (and one verdict): rename one")
        first[claim.name] = claim
    if not names:
        return claims
    by_name = {c.name: c for c in claims}
    for name in names:
        if name not in by_name:
            raise ValueError(f"unknown claim {name!r}; claims in {claims_dir}: "
                             f"{', '.join(by_name)}")
    return [by_name[n] for n in names]
