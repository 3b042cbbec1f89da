"""Results -> pandas tables -> matplotlib figures -> markdown and a self-contained HTML report.

    commbench report results/quickstart -o reports/quickstart [--target-loss 3.2]

`build_report(results_dir, out_dir)` reads every run record under `results_dir` (a sweep
directory, a folder of sweeps, or single runs) and writes to `out_dir`:

    report.html         everything in one file (figures embedded as PNG, tables as HTML)
    report.md           the same as markdown, figures linked from figures/
    runs.csv            one row per run (status, totals, projections, eval numbers)
    steps.csv           one row per logged step of every run
    speedup.csv         time to target and speedup vs DDP, per group and clock, with the
                        group's tallies (reached, did not reach, diverged, failed, partial)
    convergence.csv     tokens to target, final validation loss and its gap to DDP
    performance_profile.csv   method, tau, fraction: the performance profile (AlgoPerf)
    communication.csv   throughput, bytes, seconds and share of the step, per group
    downstream.csv      lm-eval metrics per group (when runs were evaluated)
    delay_study.csv     final loss and gap to sync per optimizer/delay cell (delay studies)
    figures/*.png

Each ok run's bandwidth for 90% utilisation (its own what-if, its first profile's
inter-node link swept) is a column of the runs and a section per group; a sweep whose spec
names a what-if scenario (`whatif:`) gets that scenario's table (build_report's `whatif`):
bench/study/report/planner.py.

The report opens with the answer (bench/study/report/verdict.py): per method, one sentence per
clock (measured here, then each network profile) with its speedup and final-loss gap to
DDP in words, what the seeds resolve, and which runs shared cores
(bench/study/report/contention.py: projections priced on compute that held waits for a core are
marked ‡, measured figures of ranks sharing cores †). Time to target is also scored
AlgoPerf's way, with a performance profile over workloads and network profiles
(bench/study/report/algoperf.py). Downstream scores at chance level say so
(bench/study/report/chance.py). The methodology follows.

Sections for particular studies (one-step delay, pipelines) appear when such runs are
present: bench/study/report/studies.py.

Validation losses compare only between runs scored on the same validation set
(summary.json `val_set`; bench/study/report/load.py says how records without one are named).
The runs are split by set first (`load.by_validation_set`): speedups, convergence, loss
curves and study sections are computed within each set, under headings that name it
when there are several (files suffixed -setK), and a group whose baseline ran on another
set has none. The report's head names every set and the groups on it. Throughput,
communication and downstream numbers do not depend on the set and cover every run.

Failed, diverged and partial (killed) runs are listed with their error, never dropped
silently: they count in their group's tallies (a group gets a speedup interval only when
every seed reached the target; else AlgoPerf's median, a miss counted as never), while
only ok runs contribute numbers. How times to target, speedups
and confidence intervals are computed: see bench/study/report/analysis.py and stats.py.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from bench.run import files
from bench.study.report import (
    algoperf,
    analysis,
    contention,
    figures,
    load,
    planner,
    render,
    studies,
    tables,
    verdict,
)
from bench.study.report.load import Results, load_results

__all__ = ["build_report", "load_results", "Results"]

_METHOD = (
    "Time to target = first crossing of the validation curve, linearly interpolated "
    "between the two validation points around it; seconds and tokens at that step are "
    "interpolated linearly between the logged rows around it. Projected time to target on "
    "a profile: the cumulative projected clock the run logged (`projected_elapsed_s`), "
    "interpolated the same way (\"step-wise\"); records without it use the projected "
    "total × the fraction of tokens at the crossing, which assumes uniform steps "
    "(\"uniform-step estimate\", marked per group). Only ok runs can reach the target; "
    "a group (or its baseline) with a seed that did not reach it, diverged or failed gets "
    "no speedup interval, and the cell says why; it is scored AlgoPerf's way instead: the "
    "median time over its seeds with a miss counted as never (\"median\", no interval; "
    "none when half its seeds or more missed). Speedup = DDP time / run time: geometric mean over "
    "seeds [95% interval on the log-ratios, t-distribution], paired by seed when both "
    "groups ran the same seeds, else Welch's two-sample interval on the logs; \"n<3\" "
    "marks an interval from fewer than 3 seeds. Times to target here INCLUDE one-off "
    "costs (each process's warm-up steps and communicator creation: compile, NCCL set-up; "
    "summary.json `warmup_s`), as a user waits for them; summary.json's "
    "`time_to_target_steady_s` leaves them out. Throughput is steady state (warm-up left "
    "out)."
)


def _how_measured(runs: pd.DataFrame) -> str:
    """Which clock each number comes from: the links the runs ran on, the projection model."""
    links = "; ".join(f"{n} on {what}" for what, n in runs["links"].value_counts().items())
    models = "; ".join(dict.fromkeys(runs["projection_model"]))
    return (f"**Measured** times: {links} (runs, by where their communication ran). "
            f"**Projected** times: measured compute plus modelled communication per network "
            f"profile ({models}; docs/network-model.md). On shaped TCP links (gloo, "
            "100 Mbit/s-1 Gbit/s, 1-10 ms, CUBIC; 2 ranks, one per core) "
            "the step projected from the fast phase of a run onto its slow phase (the "
            "links' rate switched inside one run) came within 10% of the measured step "
            "for DDP, DiLoCo, GASLoC and a 2-stage 1F1B pipeline in 16 of 16 cases in "
            "each of the last two runs (-7.3% to +6.8%, medians of 3), within 6.4% given "
            "the slow phase's own compute; GASLoC's exchange op by op came within 7.4% of "
            "its formula at every setting. It is not validated for NCCL, more ranks, or "
            "lossy links.")


def build_report(results_dir: str | os.PathLike, out_dir: str | os.PathLike,
                 target_loss: float | None = None,
                 whatif: str | os.PathLike | None = None) -> Path:
    """Write the report of every run under `results_dir` into `out_dir`; returns report.html.

    `target_loss` overrides the target validation loss (default: the sweep spec's, else the
    DDP baseline's final validation loss, the highest over its seeds). `whatif`: a what-if
    scenario whose table the report shows (a sweep spec's `whatif:`). Raises ValueError
    when `results_dir` does not exist or holds no run records."""
    if target_loss is not None and not math.isfinite(target_loss):
        raise ValueError(f"--target-loss must be a finite validation loss, got {target_loss}")
    results_dir, out_dir = Path(results_dir), Path(out_dir)
    res = load_results(results_dir)
    res.runs = planner.with_bandwidth(results_dir, res.runs)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "figures").mkdir(exist_ok=True)

    runs, profiles = res.runs, res.profiles
    palette = figures.colors(list(dict.fromkeys(runs["label"])))
    parts = load.by_validation_set(res)
    sets = []
    for k, (name, part) in enumerate(parts, 1):
        suffix = f"-set{k}" if len(parts) > 1 else ""
        sets.append(_compare_on_one_set(name, part, out_dir, target_loss, palette, suffix))
    speedup = pd.concat([s.speedup.assign(val_set=s.name) for s in sets], ignore_index=True)
    convergence = pd.concat([s.convergence.assign(val_set=s.name) for s in sets],
                            ignore_index=True)
    comm = analysis.communication(runs, profiles)
    evals = analysis.downstream(runs)
    cases = algoperf.cases(speedup)
    # a profile of one method (DDP alone) compares nothing: none then
    profile = algoperf.performance_profile(
        cases if cases["method"].nunique() > 1 else cases.iloc[:0])

    figures.write_csv(runs.drop(columns=["comm_bytes_series"], errors="ignore"),
                      out_dir / "runs.csv")
    figures.write_csv(res.steps, out_dir / "steps.csv")
    figures.write_csv(speedup, out_dir / "speedup.csv")
    figures.write_csv(convergence, out_dir / "convergence.csv")
    figures.write_csv(comm, out_dir / "communication.csv")
    if not evals.empty:
        figures.write_csv(evals, out_dir / "downstream.csv")
    if not profile.empty:
        figures.write_csv(profile, out_dir / "performance_profile.csv")

    drawn = {}
    for name, fig in (("throughput", figures.throughput(comm, profiles)),
                      ("communication", figures.communication(comm, profiles, palette)),
                      ("bytes_per_step", figures.bytes_per_step(runs, palette)),
                      ("performance_profile", figures.performance_profile(
                          profile, figures.colors(list(dict.fromkeys(profile["method"])))
                          if not profile.empty else {}))):
        if fig is not None:
            drawn[name] = _save(fig, out_dir, name)

    profile_text = algoperf.summary_text(profile, cases)
    planned = planner.whatif_blocks(whatif, out_dir) if whatif is not None else []
    blocks = _blocks(results_dir, res, sets, comm, evals, drawn, profiles, profile_text,
                     planned)
    title = f"commbench report: {results_dir.resolve().name}"
    files.write_text(out_dir / "report.md", render.to_markdown(blocks, out_dir))
    html_path = out_dir / "report.html"
    files.write_text(html_path, render.to_html(blocks, title))
    return html_path


@dataclass
class _OneSet:
    """What compares validation losses, computed over the runs of one validation set."""

    name: str
    runs: pd.DataFrame
    speedup: pd.DataFrame
    convergence: pd.DataFrame
    drawn: dict
    studies: list[tuple]
    tag: str
    """Appended to the section headings when the report holds several sets."""


def _save(fig, out_dir: Path, name: str) -> Path:
    return figures.save(fig, out_dir / "figures" / f"{name}.png")


def _compare_on_one_set(name: str, part: Results, out_dir: Path, target_loss: float | None,
                        palette: dict, suffix: str) -> _OneSet:
    """Speedups, convergence, loss curves and study sections of the runs of one set."""
    speedup, convergence = analysis.compare(part.runs, part.steps, part.profiles, target_loss,
                                            part.sweep_targets)
    targets = speedup["target_loss"].dropna().unique() if not speedup.empty else []
    target_line = float(targets[0]) if len(targets) == 1 else None
    drawn = {}
    for figure, fig in (
        ("loss_vs_tokens", figures.loss_vs_tokens(part.runs, part.steps, palette, target_line)),
        ("loss_vs_time", figures.loss_vs_time(part.runs, part.steps, palette, target_line,
                                              part.profiles)),
    ):
        if fig is not None:
            drawn[figure] = _save(fig, out_dir, figure + suffix)
    tag = f" (validation set {suffix.removeprefix('-set')})" if suffix else ""
    extra = studies.blocks(part, out_dir, target_loss, speedup, suffix, tag)
    return _OneSet(name, part.runs, speedup, convergence, drawn, extra, tag)


def _validation_text(sets: list[_OneSet]) -> str:
    if len(sets) == 1:
        return (f"Every run was scored on one validation set, {sets[0].name} (its validation "
                "losses compare).")
    lines = [f"- **validation set {k}**: {s.name}: "
             + ", ".join(f"`{label}`" for label in dict.fromkeys(s.runs["label"]))
             for k, s in enumerate(sets, 1)]
    return (f"**These runs were scored on {len(sets)} different validation sets, whose "
            "losses do not compare.** Speedups, convergence, loss curves and studies are "
            "computed within each set only, each under its own headings below; a group "
            "whose baseline ran on another set has no baseline there. Sets (\"not "
            "recorded\": a record from before summary.json `val_set`, told apart by what "
            "its config implies):\n\n" + "\n".join(lines))


def _first_screen(sets: list[_OneSet], runs: pd.DataFrame, profiles: list[str],
                  drawn: dict, profile_text: str) -> list[tuple]:
    """The answer first: per method, one sentence per clock; what shared cores; the
    performance profile's gist. Methodology follows."""
    blocks: list[tuple] = [("h2", "Verdict")]
    for text in contention.first_screen(runs):
        blocks.append(("p", text))
    said = 0
    for one in sets:
        lines = verdict.verdicts(one.speedup, one.convergence, profiles,
                                 contention.group_marks(one.runs, one.speedup))
        if one.tag and lines:
            blocks.append(("p", f"On validation set {one.tag.strip(' ()')}:"))
        blocks += [("p", line) for line in lines]
        said += len(lines)
    if not said:
        blocks.append(("p", "Nothing to compare: no group beside an ok DDP baseline on "
                            "one validation set."))
    if profile_text:
        blocks.append(("p", "**Performance profile** (AlgoPerf: median time to target over "
                            "seeds, a missed trial counted as never; figure and "
                            "`performance_profile.csv` under \"Performance profile\" "
                            "below): " + profile_text))
    blocks.append(("p", "Speed: time to the target validation loss, DDP's time over the "
                        "method's (geometric mean over seeds [95% interval]); loss: final "
                        "validation loss minus DDP's (paired by seed) [95% interval]. "
                        "\"Resolve\": the interval's half-width, the smallest difference "
                        "these seeds can tell from none. How each number is made: below."))
    return blocks


def _profile_blocks(drawn: dict, profile_text: str) -> list[tuple]:
    if "performance_profile" not in drawn:
        return []
    return [("h2", "Performance profile"),
            ("p", algoperf.DESCRIPTION),
            ("p", profile_text),
            ("figure", drawn["performance_profile"],
             "Fraction of cases (workload × network profile) in which a method's median "
             "time to target is within τ of the best method's (log τ); "
             "`performance_profile.csv` holds it as method, tau, fraction.")]


def _comparison_blocks(one: _OneSet, profiles: list[str]) -> list[tuple]:
    speedup, convergence, runs, tag = one.speedup, one.convergence, one.runs, one.tag
    marks = contention.group_marks(runs, speedup)
    blocks: list[tuple] = [("h2", "Speedup vs DDP (time to target loss)" + tag)]
    if not (runs["status"] == "ok").any():
        blocks.append(("p", "No run finished ok: nothing to compare."))
    if not speedup.empty:
        blocks.append(("p", tables.target_text(speedup) + " " + _METHOD))
        blocks.append(("p", _how_measured(runs)))
        blocks.append(("table", tables.wide_by_clock(speedup, profiles, "speedup", marks)))
        early = speedup[(speedup["clock"] == "measured")
                        & (speedup["at_first_validation"].fillna(0) > 0)]
        if not early.empty:
            names = ", ".join(f"`{g}` ({int(n)} of {int(r)} runs)" for g, n, r in
                              zip(early["label"], early["at_first_validation"],
                                  early["runs"], strict=True))
            blocks.append(("p", "**Upper bounds:** already below the target at the first "
                                f"validation: {names}. Their time to target is at most the "
                                "time of that validation (the crossing happened earlier); "
                                "validate more often or lower the target to resolve it."))
        blocks.append(("p", "Time to target, seconds (measured here, then projected; mean "
                            "± 95% half-width over seeds; where some seed missed, AlgoPerf's "
                            "median over seeds with a miss counted as never):"))
        blocks.append(("table", tables.wide_by_clock(speedup, profiles, "time", marks)))
        blocks.append(("h2", "Convergence" + tag))
        blocks.append(("p", "Tokens to target and its ratio to DDP (geometric mean [95% "
                            "interval]); final validation loss over the ok runs and its "
                            "difference from DDP (paired by seed when both ran the same "
                            "seeds, else Welch)."))
        blocks.append(("table", tables.convergence_table(convergence)))
    blocks += one.studies

    blocks.append(("h2", "Loss curves" + tag))
    for name, caption in (
        ("loss_vs_tokens", "Loss vs tokens (mean over seeds; band: min-max over seeds; "
                           "dashed: target)."),
        ("loss_vs_time", "Loss vs time: measured on this machine, and projected onto each "
                         "network profile (the run's cumulative projected clock where it "
                         "logged one, else projected run time × fraction of tokens)."
                         + contention.caption(runs)),
    ):
        if name in one.drawn:
            blocks.append(("figure", one.drawn[name], caption))
    return blocks


def _blocks(results_dir: Path, res: Results, sets: list[_OneSet], comm: pd.DataFrame,
            evals: pd.DataFrame, drawn: dict, profiles: list[str],
            profile_text: str = "", whatif: list[tuple] = ()) -> list:
    runs = res.runs
    counts = runs["status"].value_counts()
    status_text = ", ".join(f"{counts.get(s, 0)} {s}" for s in ("ok", "failed", "diverged",
                                                                 "partial") if counts.get(s, 0))
    blocks: list[tuple] = [
        ("h1", f"commbench report: {results_dir.resolve().name}"),
        *_first_screen(sets, runs, profiles, drawn, profile_text),
        ("h2", "Methodology and runs"),
        ("p", f"Generated {time.strftime('%Y-%m-%d %H:%M')} from `{results_dir}`: "
              f"{tables.plural(len(runs), 'run')} in "
              f"{tables.plural(runs['group'].nunique(), 'group')} ({status_text}). "
              "A group is one config minus its seed."),
        ("p", _validation_text(sets)),
    ]
    if res.warnings:
        blocks.append(("p", "Warnings:\n\n" + "\n".join(f"- {w}" for w in res.warnings)))
    for one in sets:
        blocks += _comparison_blocks(one, profiles)
    blocks += _profile_blocks(drawn, profile_text)

    blocks.append(("h2", "Throughput and communication"))
    if comm.empty:
        blocks.append(("p", "No run finished ok."))
    else:
        for name, caption in (
            ("throughput", "Throughput in tokens/s, steady state: the run without its "
                           "warm-up steps and communicator creation (log scale)."
                           + contention.caption(runs)),
            ("communication", "Bytes per rank over the run: logical payload (tensor bytes "
                              "handed to collectives and sends) beside modelled wire bytes "
                              "(what the algorithm puts on the link, e.g. 2(n−1)/n × payload "
                              "for a ring all-reduce; absent in older records); "
                              "communication seconds (measured = exposed, not overlapped "
                              "with compute; projected = modelled per profile) and "
                              "communication share of the step."),
            ("bytes_per_step", "Bytes per step over the run (one run per group, the largest "
                               "logical payload any rank sent in each step): DDP is flat, "
                               "DiLoCo spikes every H steps, Streaming DiLoCo has P smaller "
                               "spikes per H. The peak per sync is in the table below (the "
                               "last step's closing sync left out)."),
        ):
            if name in drawn:
                blocks.append(("figure", drawn[name], caption))
        blocks.append(("table", tables.throughput_table(comm, profiles,
                                                        contention.own_marks(runs))))
        blocks.append(("p", "Logical payload bytes = the tensor bytes each rank hands to "
                            "collectives and sends; modelled wire bytes = the bytes each "
                            "rank puts on the link under the network model (ring "
                            "all-reduce: 2(n−1)/n × payload); n/a: not recorded (older "
                            "records). Averages over the group's ok runs."))
        blocks.append(("table", tables.comm_table(comm, profiles)))
    blocks += planner.bandwidth_blocks(runs)
    blocks += whatif
    planned = runs[runs["memory_estimate_bytes"].notna()] if "memory_estimate_bytes" in runs \
        else runs.iloc[:0]
    if not planned.empty:
        blocks.append(("h2", "Memory per rank"))
        blocks.append(("p", "Estimate: the plan made before launch (bench/memory.py: "
                            "parameters, gradients, optimizer state, activations, the "
                            "strategy's own copies), of the largest rank. Measured: each "
                            "rank's peak since the model's build began minus what it held "
                            "before (CPU: resident set, so the interpreter and torch are "
                            "left out; CUDA: allocated bytes), the largest rank's. Peak "
                            "memory: the largest rank's peak with everything it holds."))
        blocks.append(("table", tables.memory_table(planned)))

    if not evals.empty:
        blocks.append(("h2", "Downstream evaluation"))
        blocks.append(("p", "Mean ± 95% half-width over the ok seeds. \"at chance\": the "
                            "score is what guessing scores (the chance level beside the "
                            "metric's name: 1/choices, within the 95% binomial band for the "
                            "items scored; ≥ 256 byte perplexity or 8 bits per byte; word "
                            "perplexity ≥ 10,000): the number in parentheses is not a "
                            "result (bench/study/report/chance.py)."))
        blocks.append(("table", tables.downstream_table(evals)))

    blocks.append(("h2", "Runs that did not finish ok"))
    bad = runs[runs["status"] != "ok"]
    if bad.empty:
        blocks.append(("p", "None: every run finished ok."))
    else:
        blocks.append(("p", "Failed, diverged and partial runs (killed midway, or still "
                            "running). They count in their group's tallies above (and void "
                            "its speedup); they contribute no numbers."))
        blocks.append(("table", tables.problem_table(bad)))

    blocks.append(("h2", "All runs"))
    numbers = {one.name: k for k, one in enumerate(sets, 1)} if len(sets) > 1 else None
    blocks.append(("table", tables.runs_table(runs, numbers)))
    files = ["runs.csv", "steps.csv", "speedup.csv", "convergence.csv", "communication.csv"]
    if not evals.empty:
        files.append("downstream.csv")
    if "performance_profile" in drawn:
        files.append("performance_profile.csv")
    blocks.append(("p", "Tables as CSV beside this report: " + ", ".join(f"`{f}`" for f in files)
                   + "."))
    return blocks
