"""The `commbench` command line: run, sweep, eval, report, export, data, config.

    commbench run configs/ddp-tiny.yaml --set run.steps=50
    commbench sweep configs/quickstart.yaml [--dry-run] [--output-dir DIR] [--set K=V]
    commbench sweep configs/quickstart.yaml --status    # each run's state; starts nothing
    commbench eval RUN_DIR --suite smoke
    commbench report results/quickstart -o reports/quickstart
    commbench compare results/before results/after --tolerance 0
    commbench track results/quickstart --to tensorboard --set dir=tb
    commbench claims [NAME ...] [--scale tiny|cpu|small|paper] [--dry-run] [--report-only]
                     [--study SPEC ...]
    commbench config show configs/ddp-tiny.yaml
    commbench data prepare embedded
    commbench doctor                    # first thing on a new GPU node: a pass/fail report

Heavy imports (torch, lm-eval, pandas) happen inside the command that needs them, so
`--help` and input errors are fast. Any ValueError from validation exits with status 2
and its message, before anything is launched; an OSError (a full disk, a read-only
target) exits with status 1 and names the file (every file is written atomically, so
what was written is whole).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def run_and_evaluate(cfg, run_dir=None, progress: bool = True, resume: bool = False) -> dict:
    """bench.launch.run.run_config, then lm-eval on the final model when `cfg.eval.suite` is set
    and the run ended ok, both followed by the `tracking:` sinks (bench/study/tracking/). The
    runner of `commbench run` and `commbench sweep`; here because only the command line
    imports `eval` (module level: Slurm jobs pickle it by name)."""
    from bench.launch.run import new_run_dir, run_config
    from bench.study.tracking.sync import follow

    run_dir = Path(run_dir) if run_dir is not None else new_run_dir(cfg)
    with follow(cfg.tracking, run_dir):
        summary = run_config(cfg, run_dir, progress=progress, resume=resume)
        if summary["status"] == "ok" and cfg.eval.suite:
            from eval.runner import self_evaluate

            summary = {**self_evaluate(cfg, summary["run_dir"]), "run_dir": summary["run_dir"]}
    return summary


def _check_eval_tasks(cfg) -> None:
    """An unknown eval.tasks entry fails before training, not after it."""
    if cfg.eval.suite is not None:
        from eval.suites import get_suite, select_tasks

        select_tasks(get_suite(cfg.eval.suite), cfg.eval.tasks)


def _cmd_run(args) -> int:
    """`commbench run`: a new run, `--run-dir DIR`, or `--resume DIR` (what each promises:
    bench/launch/run.py's docstring and the README's "Resume and run directories")."""
    from bench.config import load_config
    from bench.config.preflight import check_output_dir, preflight
    from bench.run.records import RunDir

    if args.resume:
        run_dir = Path(args.resume)
        if args.run_dir:
            raise ValueError(f"--resume {args.resume!r} and --run-dir {args.run_dir!r}: give "
                             "one (--resume continues the run in its own directory)")
        recorded = RunDir(run_dir).config
        if not recorded.exists():
            raise ValueError(f"--resume {args.resume!r}: not a run directory (no config.yaml; "
                             "give a directory written by `commbench run`)")
        # the recorded config, or the one given, which must match it (launch.check_resume)
        cfg = load_config(args.config or recorded, args.set)
    else:
        cfg = load_config(args.config, args.set)
        run_dir = Path(args.run_dir) if args.run_dir else None
    _check_eval_tasks(cfg)
    preflight(cfg)
    if run_dir is None:
        check_output_dir(cfg.run.output_dir)
    summary = run_and_evaluate(cfg, run_dir, progress=not args.quiet, resume=bool(args.resume))
    _print_summary(summary)
    return 0 if summary["status"] == "ok" else 1


def _print_summary(summary: dict) -> None:
    status = summary["status"]
    if status == "failed":
        print(f"run FAILED: {summary.get('error', '')}", file=sys.stderr)
    else:
        val = summary.get("final_val_loss")
        tps = summary.get("throughput_tokens_per_s") or 0
        print(f"status {status}  val_loss {val if val is None else round(val, 4)}  "
              f"tokens/s {tps:,.0f}  comm {summary.get('comm_bytes_per_rank', 0) / 1e6:.2f} "
              f"MB/rank  comm share {summary.get('comm_share') or 0:.1%}")
    if summary.get("eval_error"):
        print(f"evaluation failed: {summary['eval_error']}", file=sys.stderr)
    if "run_dir" in summary:
        print(summary["run_dir"])


def _cmd_config_show(args) -> int:
    from bench.config import describe, load_config
    from bench.memory import describe as describe_memory

    cfg = load_config(args.config, args.set)
    print(describe(cfg), end="")
    print(describe_memory(cfg), end="")
    return 0


def _cmd_sweep(args) -> int:
    from bench.study.sweep import run_sweep, sweep_status

    if args.status:
        sweep_status(args.spec, executor=args.executor, output_dir=args.output_dir,
                     overrides=args.set)
        return 0
    result = run_sweep(args.spec, dry_run=args.dry_run, retry_failed=args.retry_failed,
                       executor=args.executor, max_parallel=args.max_parallel,
                       report=not args.no_report, output_dir=args.output_dir,
                       overrides=args.set, check_run=_check_eval_tasks,
                       runner=run_and_evaluate)
    return 0 if result.ok else 1


def _cmd_claims(args) -> int:
    from bench.study.claims import run_claims
    from bench.study.claims.spec import MAX_SEEDS

    if args.seeds is not None and not 1 <= args.seeds <= MAX_SEEDS:
        raise ValueError(f"--seeds must be from 1 to {MAX_SEEDS}, got {args.seeds}")
    command = " ".join(["commbench claims", *args.names, f"--scale {args.scale}",
                        *(["--report-only"] if args.report_only else []),
                        *([f"--report-dir {args.report_dir}"]
                          if args.report_dir != "reports/claims" else []),
                        *([f"--results-page {args.results_page}"] if args.results_page
                          else []),
                        *(f"--study {path}" for path in args.study)])
    page = run_claims(args.names or None, scale=args.scale, seeds=args.seeds,
                      claims_dir=args.claims_dir, output_dir=args.output_dir,
                      report_dir=args.report_dir, executor=args.executor,
                      max_parallel=args.max_parallel, dry_run=args.dry_run,
                      runner=run_and_evaluate,  # eval.* metrics need the self-evaluation
                      train=not args.report_only, results_page=args.results_page,
                      command=command, studies=args.study)
    return 0 if page is not None or args.dry_run else 1


def _cmd_eval(args) -> int:
    from eval.runner import evaluate_run

    results = evaluate_run(args.run_dir, suite=args.suite, tasks=args.tasks or None,
                           limit=args.limit, batch_size=args.batch_size, device=args.device)
    print(json.dumps(results.get("summary", results), indent=2, default=str)[:4000])
    return 0


def _cmd_export(args) -> int:
    from eval.export import export_hf

    print(export_hf(args.run_dir, args.hf))
    return 0


def _cmd_report(args) -> int:
    from bench.run.records import check_report_dir

    check_report_dir(args.output, "report -o")
    from bench.study.report import build_report

    print(build_report(args.results_dir, args.output, target_loss=args.target_loss))
    return 0


def _cmd_compare(args) -> int:
    from bench.run.records import check_report_dir

    check_report_dir(args.output, "compare -o")
    from bench.study.compare import compare

    return compare(args.runs, args.output, tolerance=args.tolerance)


def _cmd_whatif(args) -> int:
    from bench.study.whatif.report import evaluate, run_whatif, table, write
    from bench.study.whatif.scenario import load_scenario

    if args.run:
        for name, row in run_whatif(args.run).items():
            recorded = row["recorded_s"]
            print(f"{name}: what-if {row['whatif_s']:.6g} s, run's projected_robust "
                  f"{'n/a' if recorded is None else f'{recorded:.6g} s'}, "
                  f"utilisation {row['utilisation']:.1%}")
        return 0
    from bench.run.records import check_report_dir

    check_report_dir(args.output, "whatif -o")
    scenario = load_scenario(args.scenario, args.set)
    out = check_report_dir(Path(args.output) / scenario.name, "whatif -o")  # name: checked
    results = evaluate(scenario)
    print(table(scenario, results))
    out = write(scenario, results, out)
    print(f"\nwrote {out}/whatif.md, whatif.json, whatif.png")
    return 0


def _cmd_track(args) -> int:
    from bench.study.tracking.sync import track

    return 1 if track(args.results_dir, args.to, args.set) else 0


def _cmd_data_prepare(args) -> int:
    from bench.config.schema import DataConfig
    from bench.data import prepare

    cache_dir = args.cache_dir or DataConfig().cache_dir  # where runs look by default
    print(prepare(args.name, args.output, args.tokenizer, cache_dir=cache_dir))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commbench",
        description="Benchmark communication-efficient LLM pretraining against DDP.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train one run (torchrun under the hood)",
                         description="Train one run. See `commbench config show CONFIG` for "
                         "every field with its documentation.")
    run.add_argument("config", nargs="?", help="run config YAML (defaults when omitted)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config field, e.g. --set run.steps=50 (repeatable)")
    run.add_argument("--run-dir", help="write the run here instead of OUTPUT_DIR/NAME-HASH "
                     "(a new directory, or one holding this config unfinished)")
    run.add_argument("--resume", metavar="RUN_DIR",
                     help="continue a stopped run from its last checkpoint (only run.steps "
                     "may change: grow it to extend a finished run)")
    run.add_argument("--quiet", action="store_true", help="no progress line")
    run.set_defaults(func=_cmd_run)

    config = sub.add_parser("config", help="inspect configs")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved config with field docs "
                                 "and each rank's memory plan")
    show.add_argument("config", nargs="?")
    show.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    show.set_defaults(func=_cmd_config_show)

    sweep = sub.add_parser("sweep", help="run a sweep of runs, then report")
    sweep.add_argument("spec", help="sweep spec YAML")
    sweep.add_argument("--resume", action="store_true",
                       help="skip runs already recorded ok and continue stopped ones from "
                       "their checkpoints (always on; kept for clarity)")
    sweep.add_argument("--retry-failed", action="store_true",
                       help="re-run failed runs: from their checkpoint, else from step 0 "
                       "(their old records kept aside)")
    sweep.add_argument("--status", action="store_true",
                       help="list every run's state (recorded, running, queued with its "
                       "Slurm job id, stopped, not started), attempts and last step; "
                       "starts nothing")
    sweep.add_argument("--executor", choices=["local", "slurm"], help="override the spec")
    sweep.add_argument("--max-parallel", type=int, help="concurrent local runs")
    sweep.add_argument("--output-dir", metavar="DIR",
                       help="write the sweep under DIR instead of the spec's output_dir")
    sweep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a run config field in every run (repeatable)")
    sweep.add_argument("--dry-run", action="store_true", help="list the runs, launch nothing")
    sweep.add_argument("--no-report", action="store_true", help="skip the report at the end")
    sweep.set_defaults(func=_cmd_sweep)

    claims = sub.add_parser("claims", help="re-check the papers' claims: runs, statistics, "
                            "verdicts (configs/claims/)")
    claims.add_argument("names", nargs="*", help="claims to run (default: all)")
    claims.add_argument("--scale", choices=["tiny", "cpu", "small", "paper"], default="tiny",
                        help="tiny: seconds a claim (tests); cpu: a 2-core laptop, chosen to "
                        "decide (docs/cpu-scale.md); small: GPT-2 124M on a GPU box; "
                        "paper: the papers' sizes (Slurm)")
    claims.add_argument("--seeds", type=int, help="seeds per variant (default: the file's; "
                        "no verdict from fewer than 3)")
    claims.add_argument("--claims-dir", default="configs/claims")
    claims.add_argument("--output-dir", default="results/claims", help="run records")
    claims.add_argument("--report-dir", default="reports/claims", help="the claims page")
    claims.add_argument("--executor", choices=["local", "slurm"], help="override the sweeps'")
    claims.add_argument("--max-parallel", type=int, help="concurrent local runs")
    claims.add_argument("--dry-run", action="store_true", help="list the runs, launch nothing")
    claims.add_argument("--report-only", action="store_true",
                        help="train nothing: decide each claim from the records it has "
                        "(none at this scale: 'not run')")
    claims.add_argument("--results-page", metavar="PATH",
                        help="also write the page, without figures, to PATH (.md, and "
                        ".html beside it), e.g. docs/results.md")
    claims.add_argument("--study", action="append", default=[], metavar="SPEC",
                        help="a study sweep to run after the claims, its report's study "
                             "sections added to the page (repeatable), e.g. "
                             "configs/sweeps/delay-study-cpu.yaml")
    claims.set_defaults(func=_cmd_claims)

    ev = sub.add_parser("eval", help="evaluate a finished run with lm-eval")
    ev.add_argument("run_dir")
    ev.add_argument("--suite", default="smoke", help="smoke (offline) or paper")
    ev.add_argument("--tasks", nargs="*", help="restrict to these tasks")
    ev.add_argument("--limit", type=int, help="examples per task")
    ev.add_argument("--batch-size", type=int, default=16)
    ev.add_argument("--device", default="cpu")
    ev.set_defaults(func=_cmd_eval)

    export = sub.add_parser("export", help="export a run's model")
    export.add_argument("run_dir")
    export.add_argument("--hf", required=True, metavar="OUT",
                        help="write a Hugging Face GPT-2 checkpoint here")
    export.set_defaults(func=_cmd_export)

    report = sub.add_parser("report", help="tables, figures, markdown and HTML from results")
    report.add_argument("results_dir")
    report.add_argument("-o", "--output", required=True, help="report directory")
    report.add_argument("--target-loss", type=float,
                        help="target validation loss (default: DDP's final)")
    report.set_defaults(func=_cmd_report)

    compare = sub.add_parser(
        "compare", help="compare runs, groups or sweeps: differences, curves, a gate",
        description="Compare runs, groups (DIR:LABEL) or whole sweeps with the first: the "
        "config and validation-set differences first, then per group the matched steps' max "
        "|Δloss| and final Δ (training and validation), throughput and bytes ratios; writes "
        "compare.png (curves) and compare.json (bench/study/compare.py).")
    compare.add_argument("runs", nargs="+", metavar="RUN_OR_DIR",
                         help="a run directory, a results directory, or DIR:LABEL")
    compare.add_argument("-o", "--output", default="reports/compare",
                         help="where compare.png and compare.json go")
    compare.add_argument("--tolerance", type=float, metavar="NATS",
                         help="exit 1 when any pair's max |Δloss| over matched steps "
                         "(training or validation loss, absolute) exceeds this, or a pair has "
                         "no step in common (0 = bit-exact)")
    compare.set_defaults(func=_cmd_compare)

    whatif = sub.add_parser(
        "whatif", help="project methods onto a planned model, world and network",
        description="Price each method of a scenario (YAML, or --set on the defaults) with "
        "its strategy's own traffic description on the network model, over a bandwidth "
        "range: step time, exposed communication, compute utilisation, time for the token "
        "budget, the bandwidth needed for each target utilisation, and a figure "
        "(bench/study/whatif/; docs/network-model.md).")
    whatif.add_argument("scenario", nargs="?", help="a what-if scenario YAML (default: the "
                        "defaults of bench/study/whatif/scenario.py)")
    whatif.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a scenario field (repeatable)")
    whatif.add_argument("-o", "--output", default="results/whatif",
                        help="where SCENARIO_NAME/whatif.{md,json,png} go")
    whatif.add_argument("--run", metavar="RUN_DIR", help="instead: a measured run's own "
                        "what-if beside its recorded projected_robust")
    whatif.set_defaults(func=_cmd_whatif)

    track = sub.add_parser(
        "track", help="send recorded runs to TensorBoard, W&B or MLflow (idempotent)",
        description="Backfill: send every run under RESULTS_DIR to a tracking sink; what it "
        "already holds is not sent again (bench/study/tracking/). The sink's settings are the "
        "run's own tracking.SINK section, then --set.")
    track.add_argument("results_dir")
    track.add_argument("--to", required=True, choices=["tensorboard", "wandb", "mlflow"])
    track.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                       help="a sink setting: tensorboard: dir; wandb: project, entity, mode, "
                       "group, tags, dir; mlflow: tracking_uri, experiment (e.g. --set dir=tb)")
    track.set_defaults(func=_cmd_track)

    data = sub.add_parser("data", help="corpora")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser("prepare", help="tokenise a corpus into uint16 shards")
    prep.add_argument("name", help="embedded, shakespeare, openwebtext, or a text path")
    prep.add_argument("-o", "--output", help="shard directory (default: the cache, where a "
                      "run with data.corpus NAME and this tokenizer finds it)")
    prep.add_argument("--cache-dir", help="the cache, without -o (default: data.cache_dir's "
                      "default, ~/.cache/commbench)")
    prep.add_argument("--tokenizer", default="gpt2", choices=["byte", "gpt2"])
    prep.set_defaults(func=_cmd_data_prepare)

    # doctor: the first command on a new GPU node (bench/node/doctor.py)
    from bench.node import doctor

    check = sub.add_parser("doctor", help="check this node: GPUs, NCCL, timing, bf16, short "
                           "runs of each strategy; a pass/fail report to attach to a bug",
                           description=doctor.__doc__.split("\n\n")[0])
    doctor.add_arguments(check)
    check.set_defaults(func=doctor.run_cli)

    # netprobe: measure this machine's / cluster's links, fit a profile (bench/node/netprobe.py)
    from bench.node import netprobe

    probe = sub.add_parser("netprobe", help="measure the network, write a profile YAML",
                           description=netprobe.__doc__.split("\n\n")[0])
    netprobe.add_arguments(probe)
    probe.set_defaults(func=netprobe.run_cli)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"commbench: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk, a read-only or vanished target: what and where
        where = f"{err.filename}: " if err.filename else ""
        print(f"commbench: error: {where}{err.strerror or err} (nothing more was written; "
              "what was written is whole)", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:  # recorded so far is on disk; no traceback
        # the conventional status of the signal: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP
        # (bench.run.stop.Stopped)
        return 128 + getattr(stop, "signum", 2)


if __name__ == "__main__":
    sys.exit(main())
