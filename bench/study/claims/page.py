"""The claims page: reports/claims/claims.{md,html,json} and one figure per claim.

Written by `commbench claims`. Per claim: the statement, the paper's numbers and source
(its own rows), the scale's settings, each rule as written before the runs with the
smallest effect the scale's seeds resolve (also stated before the runs) and the paper's
value of the same contrast, ours as mean and 95% interval over n paired seeds, the
verdict with its reason (an inconclusive rule names the seeds that would decide it),
per-variant values, and the validation-loss curves. `--results-page PATH` writes the same
page, without figures, to PATH (.md and .html), e.g. docs/results.md.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from bench.run import files
from bench.study.claims.decide import NOT_RUN, NOT_RUNNABLE, ClaimResult, RuleResult
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


def _rules_table(result: ClaimResult, scale: str) -> pd.DataFrame:
    rows = []
    for r in result.rules:
        rows.append({
            "rule": r.rule.name,
            "as written before the runs": r.rule.describe(),
            f"what {scale}'s seeds resolve (stated before the runs)":
                result.claim.resolution(scale, r.rule.name) or "not stated",
            "paper": r.rule.paper or "—",
            "ours": _interval_text(r),
            "verdict": r.verdict,
            "notes": "; ".join([*([r.reason] if r.reason else []), *r.notes]) or "",
        })
    return pd.DataFrame(rows)


def _paper_table(result: ClaimResult) -> pd.DataFrame:
    return pd.DataFrame([{"the paper's own numbers": str(row["what"]),
                          "value": str(row["value"])}
                         for row in result.claim.paper.get("rows", [])])


def _scale_text(result: ClaimResult, scale: str) -> str:
    """The scale's settings, and what its runs cost (their recorded wall time)."""
    chosen = result.claim.scales.get(scale, {})
    settings = {**result.claim.sweep.get("set", {}), **chosen.get("set", {})}
    text = (f"**This scale ({scale}).** {chosen.get('seeds', 3)} seeds a variant; "
            f"base `{result.claim.sweep.get('base', '?')}` with "
            + ", ".join(f"`{k}={v}`" for k, v in settings.items()) + ".")
    runs = result.runs
    if runs is not None and len(runs) and "wall_s" in runs:
        ok = runs[runs["status"] == "ok"]
        text += (f" {len(ok)} of {len(runs)} runs ok; their recorded wall time "
                 f"{ok['wall_s'].sum() / 60:.1f} min (training and validation, without "
                 "launch).")
    return text


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
            out_dir: Path | None, preface: str = "") -> list[tuple]:
    """The page's blocks; `out_dir` None: no figures (a page kept in the repository)."""
    summary = pd.DataFrame([{
        "claim": r.claim.name, "verdict": r.verdict, "seeds": r.seeds or "—",
        "why": r.reason or "",
    } for r in results])
    counts = pd.Series([r.verdict for r in results]).value_counts()
    answer = (f"**Of {len(results)} claim{'s' * (len(results) != 1)} at the {scale} scale: "
              + ", ".join(f"{n} {verdict}" for verdict, n in counts.items()) + ".** "
              "Each verdict's seeds are in the table; each rule's smallest resolvable "
              "effect, stated before its runs, is in the claim's section.")
    blocks: list[tuple] = [
        ("h1", f"commbench claims ({scale} scale)"),
        ("p", answer),
        ("table", summary),
        *([("p", preface)] if preface else []),
        ("p", "Each claim's rule was written in its file (configs/claims/) before its runs. "
              "Ours: mean and 95% Student-t interval of the per-seed contrast, paired by seed. "
              "A rule holds when its whole interval is on the claimed side of the threshold, "
              "fails when it is wholly on the other side, and is inconclusive otherwise or "
              "with fewer than 3 complete seeds; then it names the seeds a power estimate "
              "says would decide it. Each rule also states, before its runs, the smallest "
              "effect this scale's seeds resolve, beside the paper's own value of the same "
              "contrast. Results at this scale say nothing certain about the papers' "
              "scale."),
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
        if r.notes:
            text += "\n\n**Records.** " + "; ".join(r.notes)
        if r.verdict != NOT_RUNNABLE:
            text += "\n\n" + _scale_text(r, scale)
        blocks.append(("p", text))
        if claim.paper.get("rows"):
            blocks.append(("table", _paper_table(r)))
        if r.verdict == NOT_RUNNABLE:
            continue
        blocks.append(("table", _rules_table(r, scale)))
        if r.verdict == NOT_RUN:
            continue
        blocks.append(("table", _variants_table(r)))
        if out_dir is None:
            continue
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
                "reason": r.reason, "notes": r.notes, "seeds_needed": r.seeds_needed,
                "paper": r.rule.paper}

    return {"scale": scale, "claims": [{
        "name": r.claim.name, "statement": r.claim.statement, "file": str(r.claim.path),
        "paper": r.claim.paper, "reconstruction": r.claim.reconstruction,
        "verdict": r.verdict, "reason": r.reason, "seeds": r.seeds, "notes": r.notes,
        "resolves": {x.rule.name: r.claim.resolution(scale, x.rule.name) for x in r.rules},
        "rules": [rule_json(x) for x in r.rules],
    } for r in results]}


def _shown(path: Path) -> str:
    """`path` relative to the working directory where it lies below it (a page kept in
    the repository names no one's home directory)."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def write_page(results: list[ClaimResult], steps: dict[str, pd.DataFrame], scale: str,
               out_dir: str | Path, results_page: str | Path | None = None,
               command: str = "", study_blocks: list[tuple] = ()) -> Path:
    """Write claims.md, claims.html and claims.json into `out_dir`; returns the HTML path.
    With `results_page` (a .md path), also that page and its .html twin, without figures,
    saying that `command` wrote it. `study_blocks` (`--study` sections, figures already
    written into `out_dir`) follow the claims."""
    out_dir = Path(out_dir)
    (out_dir / "figures").mkdir(parents=True, exist_ok=True)
    studies = [("h1", "Studies"), *study_blocks] if study_blocks else []
    blocks = _blocks(results, steps, scale, out_dir) + studies
    files.write_text(out_dir / "claims.md", render.to_markdown(blocks, out_dir))
    files.write_text(out_dir / "claims.json",
                     json.dumps(_json(results, scale), indent=2, default=str) + "\n")
    html_path = out_dir / "claims.html"
    files.write_text(html_path, render.to_html(blocks, f"commbench claims ({scale})"))
    if results_page is not None:
        page = Path(results_page)
        preface = (f"Generated by `{command or 'commbench claims'}` from the run records; "
                   "do not edit it by hand: change a claim file (configs/claims/) or its "
                   "records and run the command again (recorded runs are not trained again). "
                   f"Validation-loss curves: {_shown(out_dir)}/claims.html.")
        short = _blocks(results, steps, scale, None, preface) + [
            block for block in studies if block[0] != "figure"]
        files.write_text(page, render.to_markdown(short, page.parent))
        files.write_text(page.with_suffix(".html"),
                         render.to_html(short, f"commbench claims ({scale})"))
    return html_path
