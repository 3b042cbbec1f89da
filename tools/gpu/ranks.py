"""tools/gpu/check.sh's table of the runs across ranks: one row per strategy family.

    python3 tools/gpu/ranks.py RUN_DIR ...     # the table, rows in the order given

A row per run directory, from its summary.json: the run's name (the directory's), its
ranks, status, steady tokens per second (all ranks), rank 0's exposed communication
seconds and its share of the wall clock, the logical bytes sent (all ranks), and the
final validation loss; a failed run's row carries its error's first line, a run that
left no summary.json says so (its log is RUN_DIR.log), and one check.sh did not start
says why (RUN_DIR.skipped: the time budget spent, deepspeed missing). Tested in
tests/test_gpu_check.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HEADER = ("| run | ranks | status | tok/s steady | comm s | comm share | MiB sent | val loss |\n"
          "|---|---|---|---|---|---|---|---|")


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def row(name: str, summary: dict | None, skipped: str | None = None) -> str:
    """One table row for the run `name`: its summary.json's body, or None if it left none
    (`skipped`: why it was not started)."""
    if skipped is not None:
        return f"| {name} | | skipped: {' '.join(skipped.split())} | | | | | |"
    if summary is None:
        return f"| {name} | | no summary.json (see {name}.log) | | | | | |"
    status = str(summary.get("status"))
    error = summary.get("error")
    if error:
        status += ": " + " ".join(str(error).splitlines()[0].split())[:160].replace("|", "/")
    sent = summary.get("comm_bytes_total")
    return (f"| {name} | {_fmt(summary.get('world_size'), 'd')} | {status} | "
            f"{_fmt(summary.get('throughput_tokens_per_s'), ',.0f')} | "
            f"{_fmt(summary.get('comm_s_total'), '.2f')} | "
            f"{_fmt(summary.get('comm_share'), '.0%')} | "
            f"{_fmt(None if sent is None else sent / 2**20, ',.1f')} | "
            f"{_fmt(summary.get('final_val_loss'), '.3f')} |")


def load(run_dir: Path) -> dict | None:
    """The run's summary.json, or None when it wrote none (or a partial one)."""
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def table(run_dirs: list[Path]) -> str:
    """The header and a row per run directory, in the order given."""
    rows = []
    for d in run_dirs:
        skip = d.with_name(d.name + ".skipped")
        rows.append(row(d.name, load(d), skip.read_text() if skip.exists() else None))
    return "\n".join([HEADER, *rows])


if __name__ == "__main__":
    print(table([Path(a.rstrip("/")) for a in sys.argv[1:]]))
