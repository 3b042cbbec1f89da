"""bench/run: one rank's training run, the process torchrun starts (`python -m
bench.run.train RUN_DIR`): the loop (train.py), its checkpoints (checkpoint.py; the
torch.distributed.checkpoint format: dcp_state.py), its clock and metrics window
(meter.py), the record schema (summary.py), the run directory, its lock and status
(records.py) and the atomic writes under it (files.py), the stop signals and the rank's
start announcement (stop.py). It imports the parts the loop is built from (config, data,
model, network, optim, memory, env) and algorithms; never launch, study, node or cli
(tests/test_layers.py)."""
