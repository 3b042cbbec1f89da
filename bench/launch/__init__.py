"""bench/launch: starting one run and waiting for it. The launcher of one run (run.py:
run directory checks and lock, config.yaml, torchrun, the record), torchrun's command
line and bounded wait (torchrun.py), the failed run's headline (failure.py), where runs
train (executors.py: threads here, or Slurm jobs through submitit) and a Slurm job's entry
(jobentry.py). It imports run, the parts (config, data, ...) and algorithms; never study,
node or cli (tests/test_layers.py)."""
