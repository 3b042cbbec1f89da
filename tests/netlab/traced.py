"""`python -m tests.netlab.traced RUN_DIR`: bench.train, each ledger record also written to
RUN_DIR/trace-rank{RANK}.jsonl with `end`, the host's monotonic clock when it was added
(right after the op: algorithms/comm.py `_timed`), the same clock in every namespace.

The netlab reads GASLoC's exchanges from it one by one (tests/netlab/experiment.py
`exchange_per_op`): which rank arrived last at each, and how long its connection had been
idle. The product's ledger keeps only the current step's records and the run's
aggregates (comm.jsonl), which mix every exchange's wait for the slower rank into its
seconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from algorithms.comm import CommLedger


def trace_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"trace-rank{rank}.jsonl"


def main(run_dir: str) -> int:
    from bench import train

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
