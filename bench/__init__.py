"""The commbench harness, one floor per folder, top first: cli.py (the command line),
node/ (doctor, netprobe), study/ (sweeps, claims, report, compare, what-if, tracking),
launch/ (one run: the launcher, torchrun, executors, Slurm jobs), run/ (one rank: the
loop, checkpoints, records), and the parts the loop is built from: config/, data/,
model/, network/, optim.py, memory.py, env.py. A module imports its own floor and those
below, never one above (tests/test_layers.py); docs/architecture.md draws the map."""
