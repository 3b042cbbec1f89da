"""The claims page: reports/claims/claims.{md,html,json} and one figure per claim.

Written by `commbench claims`. Per claim: the statement, the paper's numbers and source,
each rule as written before the runs, ours as mean and 95% interval over n paired seeds,
the verdict with its reason, per-variant values, and the validation-loss curves.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from bench.run import files
from bench.study.claims.decide import NOT_RUNNABLE, ClaimResult, RuleResult
from bench.study.report import figures, render
from bench.study.report.analysis import mean_ci


def _num(value: float) -> str:
    return render.num(value, 4)


def _interval_text(result: RuleResult) -> str:
    iv = result.interval
    if iv.n == 0:
        return "—"
    mean = "—" if math.isnan(iv.mean) else _num(result.shown(iv.mean))
    if math.isnan(iv.low):
        return f"{mean} (n={iv.n}, no interval)"
    low, high = _num(result.shown(iv.low)), _num(result.shown(iv.high))
    label = "range" if iv.method == "range" else "95% CI"
    return f"{mean} [{low}, {high}] ({label}, n={iv.n})"


def _rules_table(result: ClaimResult) -> pd.DataFrame:
    rows = []
    for r in result.rules:
        rows.append({
            "rule": r.rule.name,
            "as written before the runs": r.rule.describe(),
            "ours": _interval_text(r),
            "verdict": r.verdict,
            "notes": "; ".join([*([r.reason] if r.reason else []), *r.notes]) or "",
        })
    return pd.DataFrame(rows)


def _variants_table(result: ClaimResult) -> pd.DataFrame:
    runs = result.runs
    metrics = list(dict.fromkeys(r.rule.metric for r in result.rules))
    rows = []
    for variant in result.claim.sweep["variants"]:
        mine = runs[runs["variant"] == variant] if runs is not None else pd.DataFrame()
        counts = mine["status"].value_counts() if len(mine) else {}
        row = {"variant": variant,
               "runs": ", ".join(f"{counts[s]} {s}" for s in counts.index) if len(mine)
               else "none"}
        if runs is not None and "val_set" in runs:
            row["validation set"] = ", ".join(dict.fromkeys(mine["val_set"])) or "—"
        for metric in metrics:
            values = mine.loc[mine["status"] == "ok", metric] if metric in mine else []
            mean, half, n = mean_ci(values)
            row[metric] = render.with_ci(mean, half) + (f" (n={n})" if n else "")
        rows.append(row)
    return pd.DataFrame(rows)


def _curve_figure(result: ClaimResult, steps: pd.DataFrame, path: Path) -> Path | None:
    if steps is None or steps.empty or "val_loss" not in steps:
        return None
    val = steps[steps["val_loss"].notna()]
    if val.empty:
        return None
    fig = figures._figure(6.0, 3.6)
    ax = fig.add_subplot()
    palette = figures.colors(list(result.claim.sweep["variants"]))
    for variant, color in palette.items():
        mine = val[val["variant"] == variant]
        if mine.empty:
            continue
        by_step = mine.groupby("step")["val_loss"]
        mean = by_step.mean()
        ax.plot(mean.index, mean.values, color=color, label=variant, marker="o", ms=3)
        if mine["seed"].nunique() > 1:
            ax.fill_between(mean.index, by_step.min().values, by_step.max().values,
                            color=color, alpha=0.15, lw=0)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return figures.save(fig, path)


def _blocks(results: list[ClaimResult], steps: dict[str, pd.DataFrame], scale: str,
            out_dir: Path) -> list[tuple]:
    summary = pd.DataFrame([{
        "claim": r.claim.name, "verdict": r.verdict, "seeds": r.seeds or "—",
        "why": r.reason or "",
    } for r in results])
    blocks: list[tuple] = [
        ("h1", f"commbench claims ({scale} scale)"),
        ("p", "Each claim's rule was written in its file (configs/claims/) before its runs. "
              "Ours: mean and 95% Student-t interval of the per-seed contrast, paired by seed. "
              "A rule holds when its whole interval is on the claimed side of the threshold, "
              "fails when it is wholly on the other side, and is inconclusive otherwise or "
              "with fewer than 3 complete seeds. Results at this scale say nothing certain "
              "about the papers' scale."),
        ("table", summary),
    ]
    for r in results:
        claim = r.claim
        blocks.append(("h2", f"{claim.name}: {r.verdict}"))
        paper = claim.paper
        text = f"**Claim.** {claim.statement}"
        if paper:
            text += (f"\n\n**Paper.** {paper.get('source', '?')}"
                     f"{', ' + str(paper['where']) if paper.get('where') else ''}: "
                     f"{paper.get('numbers', '')}")
        if claim.reconstruction:
            text += f"\n\n**Reconstruction.** {' '.join(str(claim.reconstruction).split())}"
        if r.reason:
            text += f"\n\n**Why {r.verdict}.** {r.reason}"
        blocks.append(("p", text))
        if r.verdict == NOT_RUNNABLE:
            continue
        blocks.append(("table", _rules_table(r)))
        blocks.append(("table", _variants_table(r)))
        figure = _curve_figure(r, steps.get(claim.name), out_dir / "figures" /
                               f"{claim.name}.png")
        if figure is not None:
            blocks.append(("figure", figure, f"{claim.name}: validation loss, mean over seeds "
                                             "(band: min-max)"))
    return blocks


def _json(results: list[ClaimResult], scale: str) -> dict:
    def rule_json(r: RuleResult) -> dict:
        iv = r.interval
        return {"name": r.rule.name, "rule": r.rule.describe(), "metric": r.rule.metric,
                "contrast": r.rule.contrast, "scale": r.rule.scale,
                "below": r.rule.below, "above": r.rule.above, "verdict": r.verdict,
                "mean": r.shown(iv.mean), "low": r.shown(iv.low), "high": r.shown(iv.high),
                "n": iv.n, "interval": iv.method,
                "per_seed": {str(s): r.shown(v) for s, v in r.per_seed.items()},
                "reason": r.reason, "notes": r.notes}

    return {"scale": scale, "claims": [{
        "name": r.claim.name, "statement": r.claim.statement, "file": str(r.claim.path),
        "paper": r.claim.paper, "reconstruction": r.claim.reconstruction,
        "verdict": r.verdict, "reason": r.reason, "seeds": r.seeds,
        "rules": [rule_json(x) for x in r.rules],
    } for r in results]}


def write_page(results: list[ClaimResult], steps: dict[str, pd.DataFrame], scale: str,
               out_dir: str | Path) -> Path:
    """Write claims.md, claims.html and claims.json into `out_dir`; returns the HTML path."""
    out_dir = Path(out_dir)
    (out_dir / "figures").mkdir(parents=True, exist_ok=True)
    blocks = _blocks(results, steps, scale, out_dir)
    files.write_text(out_dir / "claims.md", render.to_markdown(blocks, out_dir))
    files.write_text(out_dir / "claims.json",
                       json.dumps(_json(results, scale), indent=2, default=str) + "\n")
    html_path = out_dir / "claims.html"
    files.write_text(html_path, render.to_html(blocks, f"commbench claims ({scale})"))
    return html_path
