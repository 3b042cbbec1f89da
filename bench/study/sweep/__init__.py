"""Sweeps: a YAML spec expands into runs, each trained once, resumable, then reported.

    commbench sweep configs/quickstart.yaml --dry-run     # list the runs, launch nothing
    commbench sweep configs/quickstart.yaml               # run the missing ones, then report
    commbench sweep SPEC --output-dir DIR --set run.steps=20   # as for `commbench run`

A spec names a base run config and what varies around it:

    name: h-sweep                  # the sweep directory is OUTPUT_DIR/NAME (default: file stem)
    base: ../ddp-tiny.yaml         # run config, relative to this file; or an inline mapping
    set: {run.steps: 200}          # dotted overrides applied to the base for every run
    grid:                          # cartesian product over dotted keys
      optim.lr: [1.0e-3, 3.0e-3]
    zip:                           # lists advanced together (a list of such mappings allowed)
      data.batch_size: [8, 16]
      optim.warmup_steps: [10, 20]
    seeds: [0, 1, 2]               # run.seed values (default: the base's seed)
    variants:                      # named algorithms; run.name is set to the variant name
      ddp: {strategy.name: ddp}
      diloco-H10: {strategy.name: diloco, strategy.inner_steps: 10}
    target_loss: 3.2               # for the report (default: DDP's final validation loss)
    whatif: ../whatif/x.yaml       # optional: the report adds this scenario's what-if table
    output_dir: results            # relative to the working directory
    report_dir: reports/h-sweep    # default reports/NAME
    executor: {name: local, max_parallel: 1}

Runs = seeds x grid x zip x variants, at most 10,000 (spec.MAX_RUNS: every config is built
and validated up front, so a larger sweep is refused, --dry-run too). Each key is set in
one place only (set, one grid axis, one zip group, the variants, or seeds). When a run's
`strategy.name` differs from the base's, the base's other `strategy.*` knobs are dropped:
they belong to another algorithm.

Identity and resume. A run's id is `config_hash` of its resolved config; its record is
OUTPUT_DIR/NAME/RUN_NAME-ID/ (RUN_NAME = the variant name). Re-running a sweep skips runs
recorded ok or diverged (a diverged run is a result, not an accident), keeps failed runs
with their error unless `--retry-failed`, and continues partial ones (killed, stopped by a
signal, timed out or preempted) from their last checkpoint, in their own directory, as
`commbench run --resume` does: the result is bit-identical to an uninterrupted run. A run
without a usable checkpoint is trained from step 0, and the sweep says why; its old
record is moved to NAME/_retired/ first, never deleted. No record is moved or continued
while another process (a hand `--resume`, `eval`) holds it: the sweep stops first. One
failing run never stops the sweep. One sweep process at a time per sweep directory
(NAME/.sweep.lock, a flock: a killed sweep leaves no stale lock).
`commbench sweep SPEC --status` lists each run's state, attempts and last step.
NAME/sweep.json maps each run id to its variant, seed and grid point; the report reads
it. Renaming a variant changes run.name, hence the id: that run is trained again.

`--output-dir` replaces the spec's output_dir; `--set KEY=VALUE` is set on every run (like
the spec's `set`, which it overrides; a key the spec varies cannot be --set).

Modules: spec.py (the spec and its runs), store.py (records, retire, lock, sweep.json),
orchestrate.py (run_sweep), progress.py (the bars). Executors (`local`, or `slurm` through
submitit) train the runs: see bench/launch/executors.py.
"""

from bench.study.sweep.orchestrate import RunOutcome, SweepResult, run_sweep, sweep_status
from bench.study.sweep.spec import SweepRun, SweepSpec, expand, load_spec

__all__ = ["RunOutcome", "SweepResult", "SweepRun", "SweepSpec", "expand", "load_spec",
           "run_sweep", "sweep_status"]
