"""The benchmark regression gate: run tests/benchmarks, save the results, compare, fail on regression.

    tox -e bench                                   # the same as:
    python tests/benchmarks/gate.py [pytest args]
    COMMBENCH_BENCH_BASELINE=0003 tox -e bench     # compare against saved run 0003
    COMMBENCH_BENCH_FAIL=median:10% tox -e bench   # another threshold (default min:15%)

Results are saved per machine under .benchmarks/<hostname>/ (ignored by git), one
numbered file per run (pytest-benchmark's --benchmark-autosave). The baseline is this
machine's first saved run, or the one COMMBENCH_BENCH_BASELINE names: a fixed baseline,
so that a slow drift cannot pass 20% at a time, and a failing run never becomes the
reference. To re-baseline (new hardware, new torch), name a newer run or delete the
machine's folder. The first run on a machine only saves. Each hot path is timed inside
its processes (tests/benchmarks/replay.py), and the gate compares minima (the least disturbed by other load on the machine).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def gate_args(storage: Path, baseline: str | None, fail: str) -> list[str]:
    args = ["tests/benchmarks", "-m", "bench", f"--benchmark-storage=file://{storage}",
            "--benchmark-autosave", "--benchmark-columns=min,median,max,rounds",
            "--benchmark-sort=name"]
    saved = sorted(storage.glob("*/[0-9][0-9][0-9][0-9]_*.json"))
    if baseline is None and saved:
        baseline = saved[0].name[:4]
    if baseline is not None:
        args += [f"--benchmark-compare={baseline}", f"--benchmark-compare-fail={fail}"]
        print(f"benchmark gate: comparing with run {baseline} in {storage} ({fail})")
    else:
        print(f"benchmark gate: no baseline in {storage} yet; this run becomes it")
    return args


def print_extra_info(storage: Path) -> None:
    """The figures benchmarks record beside their times (ratios), from the run just saved."""
    saved = sorted(storage.glob("*/[0-9][0-9][0-9][0-9]_*.json"), key=lambda p: p.name)
    if not saved:
        return
    for bench in json.loads(saved[-1].read_text())["benchmarks"]:
        for key, value in bench.get("extra_info", {}).items():
            print(f"{bench['name']}: {key} = {value:.4g}")


def main(argv: list[str]) -> int:
    from pytest_benchmark.session import PerformanceRegression

    os.chdir(REPO)
    storage = REPO / ".benchmarks" / socket.gethostname()
    args = gate_args(storage, os.environ.get("COMMBENCH_BENCH_BASELINE"),
                     os.environ.get("COMMBENCH_BENCH_FAIL", "min:15%"))
    try:
        code = int(pytest.main(args + argv))
    except PerformanceRegression:  # raised after the table and the failed checks are printed
        code = 1
        print("benchmark gate: FAILED, a hot path is slower than the baseline (see above)")
    print_extra_info(storage)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
