"""`python -m tests.netlab.traced RUN_DIR`: bench.train, each ledger record also written to
RUN_DIR/trace-rank{RANK}.jsonl with `end`, the host's monotonic clock when it was added
(right after the op: algorithms/comm.py `_timed`), the same clock in every namespace.

The netlab reads GASLoC's exchanges from it one by one (tests/netlab/experiment.py
`exchange_per_op`): which rank arrived last at each, and how long its connection had been
idle. The product's ledger keeps only the current step's records and the run's
aggregates (comm.jsonl), which mix every exchange's wait for the slower rank into its
seconds.

The in-run A/B: with $NETLAB_AB naming a JSON file {"lab": `Lab.description()`,
"log_every": L}, the run's links are switched between unshaped and shaped at metrics
rows, as `shaped_window` lays out, so that the compute measured on the fast links and the
step measured on the slow ones come from the same run, minutes of this machine's drift
apart no more (tests/netlab/experiment.py `read_phases`). The switch happens after the
row's clock is settled and before the next timed step (outside the run's clock: bench/train.py),
by rank 0, and every rank waits for it at a barrier.
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
RTT_ROUNDS = 24
"""Barriers on every process group right after the links are shaped: each a round trip
that moves TCP's smoothed RTT 1/8 of the way to the shaped link's (24: within 5%). A
connection whose estimate is still the unshaped link's (0.1 ms) fires its tail-loss
probe (at least 10 ms) before the shaped round trip (2-20 ms) is over: a spurious
retransmission that cuts the slow-start threshold, which then held the next shaped phase
below the path's window (DDP, 1 Gbit/s + 10 ms: 126-133 ms steps against 86-93, 2 of 4
probe runs; docs/network-model.md, "How the comparison is made")."""


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

    import bench.train
    from tests.netlab.lab import switch

    row, every = bench.train.train_row, ab["log_every"]

    def train_row(step, *args, **kw):
        done = step // every  # windows finished with this row
        if step % every == 0 and shaped_window(done + 1) != shaped_window(done):
            if dist.get_rank() == 0:
                switch(ab["lab"], shaped_window(done + 1))
            dist.barrier()
            if shaped_window(done + 1):
                _settle_rtt(dist)
        return row(step, *args, **kw)

    bench.train.train_row = train_row


def _settle_rtt(dist) -> None:
    """`RTT_ROUNDS` barriers on every process group this rank is in, in creation order (the
    same on every rank), the world's last: every gloo connection's RTT estimate brought
    to the link it now runs on."""
    from torch.distributed import distributed_c10d

    me = dist.get_rank()
    for pg, ranks in list(distributed_c10d._world.pg_group_ranks.items()):
        if me in ranks and len(ranks) > 1 and pg is not distributed_c10d._get_default_group():
            for _ in range(RTT_ROUNDS):
                dist.barrier(group=pg)
    for _ in range(RTT_ROUNDS):
        dist.barrier()


def main(run_dir: str) -> int:
    from bench import train

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
