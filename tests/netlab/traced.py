"""`python -m tests.netlab.traced RUN_DIR`: bench.run.train, each ledger record also written to
RUN_DIR/trace-rank{RANK}.jsonl with `end`, the host's monotonic clock when it was added
(right after the op: algorithms/comm.py `_timed`), the same clock in every namespace.

The netlab reads GASLoC's exchanges from it one by one (tests/netlab/experiment.py
`exchange_per_op`): which rank arrived last at each, and how long its connection had been
idle. The product's ledger keeps only the current step's records and the run's
aggregates (comm.jsonl), which mix every exchange's wait for the slower rank into its
seconds.

The in-run A/B: with $NETLAB_AB naming a JSON file {"lab": `Lab.description()`,
"log_every": L, "steps": the run's}, the links' rate limit (tbf) is put on and taken off
at metrics rows, as `shaped_window` lays out, so that the compute measured on the fast
links and the step measured on the slow ones come from the same run, minutes of this
machine's drift apart no more (tests/netlab/experiment.py `read_phases`). The switch happens after the row's
clock is settled and before the next timed step (outside the run's clock:
bench/run/train.py), by rank 0, and every rank waits for it at a barrier.

The delay stays on in both phases: it costs the ranks no CPU, so the compute the fast
phase measures is what it would be on a link without it, and a connection's round trip
must not change under TCP. Switching the delay off and on too (0.1 ms against 2-20 ms
round trips) fired tail-loss probes inside the longer round trip after each switch,
spurious retransmissions that cut the window (DDP at 1 Gbit/s + 10 ms: shaped steps of
126-133 ms in 2 probe runs of 4 against 86-93, the model 87); with barriers settling
the RTT estimate after the switch, GASLoC's 499 kB exchange still took 40-50 ms against
28-33 priced (run v), its window cut at every switch (docs/network-model.md, "How the
comparison is made").
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from algorithms.comm import CommLedger

AB_ENV = "NETLAB_AB"
PHASE_WINDOWS = 2
"""Metrics windows per phase of the A/B; the first of each is not counted: TCP's state
(window, RTT estimate) carried over from the other link settles in it."""


def trace_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"trace-rank{rank}.jsonl"


def shaped_window(window: int) -> bool:
    """Whether metrics window `window` (1: the first, steps 0 to L-1) of an A/B run is on the
    shaped links. Window 1 (connection set-up, warm-up) is unshaped, then phases of
    `PHASE_WINDOWS` windows alternate, shaped first: with 2, U | S S U U S S U U ..."""
    return window > 1 and (window - 2) // PHASE_WINDOWS % 2 == 0


def counted_window(window: int) -> bool:
    """Whether window `window` of an A/B run is compared: every phase's last window."""
    return window > 1 and (window - 2) % PHASE_WINDOWS == PHASE_WINDOWS - 1


def _switch_at_rows(ab: dict) -> None:
    import torch.distributed as dist

    import bench.run.train
    from tests.netlab.lab import switch

    row, every, last = bench.run.train.train_row, ab["log_every"], ab["steps"]

    def train_row(step, *args, **kw):
        done = step // every  # windows finished with this row
        if (step % every == 0 and step < last
                and shaped_window(done + 1) != shaped_window(done)):
            if dist.get_rank() == 0:
                switch(ab["lab"], shaped_window(done + 1))
            dist.barrier()
        return row(step, *args, **kw)

    bench.run.train.train_row = train_row


def main(run_dir: str) -> int:
    from bench.run import train

    ab = os.environ.get(AB_ENV)
    if ab:
        _switch_at_rows(json.loads(Path(ab).read_text()))
    add = CommLedger.add
    with trace_path(Path(run_dir), int(os.environ["RANK"])).open("w") as out:
        def traced(self, record):
            add(self, record)
            out.write(json.dumps({**dataclasses.asdict(record), "end": time.perf_counter()})
                      + "\n")

        CommLedger.add = traced
        return train.main(run_dir)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
