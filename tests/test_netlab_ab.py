"""The netlab's in-run A/B (tests/netlab/traced.py, tests/netlab/experiment.py): which
windows are shaped and compared, when the links are switched, and how a run's phases are
read from its train rows. No namespaces, no root: hand-written rows, a recording switch.

    pytest tests/test_netlab_ab.py
"""

from __future__ import annotations

import json

import pytest

from tests.netlab import traced
from tests.netlab.experiment import read_phases
from tests.netlab.traced import counted_window, shaped_window


def test_phases_alternate_after_an_unshaped_warm_up_and_count_their_last_window():
    assert traced.PHASE_WINDOWS == 2
    assert [shaped_window(w) for w in range(1, 14)] == [
        False, True, True, False, False, True, True, False, False, True, True, False, False]
    assert [w for w in range(1, 14) if counted_window(w)] == [3, 5, 7, 9, 11, 13]


def _rows(every=10, windows=13, skip=()):
    """Train rows at every window's end: window w took w seconds on the clock, w / 2 of
    compute and 0.9 w priced on profile p; a validation row in between (no step_s)."""
    rows, elapsed, compute, priced = [], 0.0, 0.0, 0.0
    for w in range(1, windows + 1):
        elapsed, compute, priced = elapsed + w, compute + w / 2, priced + 0.9 * w
        if w * every not in skip:
            rows.append(dict(step=w * every, step_s=0.1, elapsed_s=elapsed,
                             projected_elapsed_s={"zero": compute, "p": priced}))
        if w == 4:
            rows.append(dict(step=w * every, val_loss=3.0, elapsed_s=elapsed))
    return rows


def _write(run_dir, rows):
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "comm.jsonl").write_text(json.dumps({"rank": 0, "phase": "grad"}) + "\n")


def test_each_phase_sums_its_compared_windows_only(tmp_path):
    _write(tmp_path, _rows())
    phases = read_phases(tmp_path, 10)
    shaped, fast = (3, 7, 11), (5, 9, 13)  # windows 2, 4, 6, ... settle, not compared
    assert phases.step_s[True] == pytest.approx(sum(shaped) / 30)
    assert phases.step_s[False] == pytest.approx(sum(fast) / 30)
    assert phases.projected_step_s[False] == pytest.approx(
        {"zero": sum(fast) / 2 / 30, "p": 0.9 * sum(fast) / 30})
    assert phases.projected_step_s[True]["p"] == pytest.approx(0.9 * sum(shaped) / 30)
    assert phases.steps[True] == [*range(20, 30), *range(60, 70), *range(100, 110)]
    assert phases.comm_rows == [{"rank": 0, "phase": "grad"}]


def test_a_missing_row_is_refused_not_spanned(tmp_path):
    """Without the row that opens window 7, its difference would span two windows of
    both phases."""
    _write(tmp_path, _rows(skip={60}))
    with pytest.raises(ValueError, match="no train row at step 60, the start of window 7"):
        read_phases(tmp_path, 10)


def test_a_run_without_a_compared_window_of_each_phase_is_refused(tmp_path):
    _write(tmp_path, _rows(windows=4))  # window 3 shaped; no unshaped one compared
    with pytest.raises(ValueError, match="no compared unshaped window"):
        read_phases(tmp_path, 10)


def _hooked(monkeypatch, rank: int) -> list:
    """The A/B hook around a stub train_row, on `rank`, with a recording switch and
    barrier; returns what they record."""
    import torch.distributed as dist

    import bench.run.train
    import tests.netlab.lab

    calls = []
    monkeypatch.setattr(bench.run.train, "train_row", lambda step, *a, **k: ("row", step))
    monkeypatch.setattr(tests.netlab.lab, "switch", lambda lab, on: calls.append((lab, on)))
    monkeypatch.setattr(dist, "get_rank", lambda: rank)
    monkeypatch.setattr(dist, "barrier", lambda: calls.append("barrier"))
    traced._switch_at_rows({"lab": "L", "log_every": 10, "steps": 70})
    return calls


def test_the_links_switch_at_the_rows_that_end_a_phase(monkeypatch):
    """Rank 0 switches at the row ending each phase (and the warm-up) and every rank waits
    at a barrier; the row itself is written as before."""
    import bench.run.train

    calls = _hooked(monkeypatch, 0)
    rows = [bench.run.train.train_row(s, 0, 0.0) for s in (10, 20, 25, 30, 40, 50, 60, 70)]
    assert rows == [("row", s) for s in (10, 20, 25, 30, 40, 50, 60, 70)]
    # after window 1 (warm-up) on, after 3 off, after 5 on; 25 is not a window's end, and
    # the last row (70, window 7's end) switches nothing: no window follows
    assert calls == [("L", True), "barrier", ("L", False), "barrier", ("L", True), "barrier"]


def test_other_ranks_wait_for_the_switch_without_making_it(monkeypatch):
    import bench.run.train

    calls = _hooked(monkeypatch, 1)
    for s in (10, 20, 30):
        bench.run.train.train_row(s, 0, 0.0)
    assert calls == ["barrier", "barrier"]
