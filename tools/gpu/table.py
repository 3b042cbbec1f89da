"""Rows of tools/gpu/check.sh's table: one per run directory given, from its summary.json.

    python3 tools/gpu/table.py [--header] RUN_DIR ...
"""

import json
import sys
from pathlib import Path

HEADER = ("| run | status | steps | tok/s steady | MFU | wall s | peak MiB | plan MiB "
          "| val loss |\n|---|---|---|---|---|---|---|---|---|")


def row(run_dir: Path) -> str:
    f = run_dir / "summary.json"
    if not f.exists():
        return f"| {run_dir.name} | no summary.json | | | | | | | |"
    s = json.loads(f.read_text())

    def fmt(value, spec):
        return "" if value is None else format(value, spec)

    plan = s.get("memory_estimate_bytes_per_rank") or [None]
    mib = [None if v is None else v / 2**20 for v in (s.get("peak_memory_bytes"), max(plan))]
    error = s.get("error")
    return (f"| {run_dir.name} | {s.get('status')} | {s.get('steps')} | "
            f"{fmt(s.get('throughput_tokens_per_s'), ',.0f')} | {fmt(s.get('mfu'), '.1%')} | "
            f"{fmt(s.get('wall_s'), '.1f')} | {fmt(mib[0], ',.0f')} | {fmt(mib[1], ',.0f')} | "
            f"{fmt(s.get('final_val_loss'), '.3f')} |"
            + (f" error: {str(error).splitlines()[0][:200]}" if error else ""))


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--header"]:
        print(HEADER)
        args = args[1:]
    for arg in args:
        print(row(Path(arg)))
