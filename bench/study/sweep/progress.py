"""Sweep progress: the sweep-level bar above one line per running run.

    commbench sweep configs/quickstart.yaml    # on a terminal: the bars; in logs: one line a run

Executors (bench/launch/executors.py) call `start(task)` and `finish(task, summary)`.
"""

from __future__ import annotations

import json
import sys
import threading

from tqdm import tqdm

from bench.launch.executors import Task
from bench.run.records import RunDir


class _RunLine:
    """One running run's line: steps done, loss and tokens/s, read from its metrics.jsonl."""

    def __init__(self, task: Task):
        self.path = RunDir(task.run_dir).metrics
        self.offset = 0
        self.bar = tqdm(total=task.config.run.steps, desc=f"  {task.label}",
                        unit="step", leave=False, dynamic_ncols=True)

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written waits
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            step, loss = row.get("step"), row.get("loss")
            if not isinstance(step, int) or not isinstance(loss, float) or step <= self.bar.n:
                continue
            self.bar.update(step - self.bar.n)
            elapsed = row.get("elapsed_s") or 0
            speed = f"  {row.get('tokens', 0) / elapsed:,.0f} tok/s" if elapsed else ""
            self.bar.set_postfix_str(f"loss {loss:.4f}{speed}", refresh=False)
        self.bar.refresh()


class Progress:
    """The sweep-level bar (done / failed / remaining, ETA) above one line per running run.

    On a terminal, tqdm draws both and each run's line follows its metrics.jsonl (so runs
    train with their own progress printing off). Elsewhere (logs, CI, batch jobs) there
    are no bars: one line per run start and end, and the runs print their own progress."""

    def __init__(self, name: str, total: int, num_done: int, num_failed: int, num_todo: int):
        """`total` runs, of which `num_done` are recorded done and `num_failed` failed (kept,
        not trained now), and `num_todo` to train."""
        self.total, self.ok, self.failed = total, num_done, num_failed
        self.started = 0
        self.num_todo = num_todo
        self.lock = threading.RLock()
        self.bar = tqdm(total=self.total, initial=self.total - num_todo, unit="run",
                        desc=f"sweep {name}", position=0, dynamic_ncols=True, disable=None)
        self.live = not self.bar.disable
        """Bars are drawn: runs should not print their own progress."""
        self.lines: dict[str, _RunLine] = {}
        self.stop = threading.Event()
        self._postfix()
        if self.live:
            self.poller = threading.Thread(target=self._poll, daemon=True)
            self.poller.start()

    def _postfix(self) -> None:
        left = self.total - self.ok - self.failed
        self.bar.set_postfix_str(f"done={self.ok} failed={self.failed} remaining={left}")

    def _poll(self) -> None:
        while not self.stop.wait(0.5):
            with self.lock:
                for line in self.lines.values():
                    line.poll()

    def start(self, task: Task, note: str = "") -> None:
        with self.lock:
            self.started += 1
            what = "resuming" if task.resume else "training"
            tqdm.write(f"[{self.started}/{self.num_todo}] {task.label}: {what} -> "
                       f"{task.run_dir}{f' ({note})' if note else ''}", file=sys.stderr)
            if self.live:
                self.lines[task.run_id] = _RunLine(task)

    def finish(self, task: Task, summary: dict) -> None:
        status = summary.get("status", "failed")
        with self.lock:
            line = self.lines.pop(task.run_id, None)
            if line is not None:
                line.bar.close()
            if status == "failed":
                self.failed += 1
            else:
                self.ok += 1
            val = summary.get("final_val_loss")
            detail = f"final val loss {val:.4f}" if isinstance(val, float) else ""
            if status == "failed":
                detail = (summary.get("error") or "").strip().splitlines()[:1]
                detail = detail[0] if detail else "no error text"
            tqdm.write(f"  {task.label}: {status} {detail}".rstrip(), file=sys.stderr)
            self._postfix()
            self.bar.update(1)

    def close(self) -> None:
        self.stop.set()
        with self.lock:
            for line in self.lines.values():
                line.bar.close()
            self.lines.clear()
        self.bar.close()
