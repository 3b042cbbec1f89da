"""Tracking sinks: a run's records shown live in TensorBoard, Weights & Biases or MLflow.

    commbench run configs/ddp-tiny.yaml --set tracking.tensorboard.dir=tb    # live
    commbench track results/quickstart --to mlflow                            # backfill
    tensorboard --logdir tb

The records stay the source of truth; a sink is a view of them. The `tracking:` section
names the sinks; `bench.cli.run_and_evaluate` follows the run (`follow`): a thread of the
launcher on the node of rank 0, not the training processes, reads each new row of
metrics.jsonl and writes it to every sink, then summary.json's numbers when the run ends
and eval.json's after the self-evaluation. Every sink gets the same series: each row's
numbers as `train/KEY` or `val/KEY` (the comm/compute split, bytes, the strategy's
scalars, `train/comm_share` = comm_s / step_s, each network profile's projected clock as
`KIND/projected_elapsed_s/PROFILE`), the resolved config as hyper-parameters, env.json
as tags/notes, and at the end `summary/KEY` and `eval/TASK/METRIC`. A sweep groups its
runs: a W&B group, an MLflow parent run, TensorBoard sub-directories SWEEP/RUN.

A sink that fails (package missing, unwritable directory, network down) warns once and
is dropped: the run goes on and its records are complete; `commbench track` backfills
them later (idempotent: what a sink already holds is not sent again; bench/study/tracking/sync.py
keeps the account in the run directory's tracking.json).

The `tracking:` section's dataclasses (`TrackingConfig` and each sink's) are
config: bench/config/schema.py; their checks bench/config/checks.py `check_tracking`.

Packages: `pip install 'commbench[tensorboard]'`, `[wandb]`, `[mlflow]` (mlflow-skinny).
"""
