"""`commbench compare` (bench/study/compare.py): differences listed first, the table at matched
steps, the figure, and the exit status of `--tolerance`."""

import json

from bench.cli import main
from bench.run.files import write_json
from bench.run.summary import train_row
from tests.fakes import write_fake_run
from tests.test_tracking import fake_run, fake_sweep


def compare(capsys, *args) -> tuple[int, str, str]:
    rc = main(["compare", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def groups(out_dir) -> list[dict]:
    report = json.loads((out_dir / "compare.json").read_text())
    return [g for c in report["comparisons"] for g in c["groups"]]


def test_the_same_run_twice_is_within_tolerance_0_with_every_delta_0(tmp_path, capsys):
    run = fake_run(tmp_path / "r")
    rc, out, _ = compare(capsys, run.path, run.path, "--tolerance", "0", "-o", tmp_path / "cmp")
    assert rc == 0, out
    assert "same config" in out and "within" in out
    (row,) = groups(tmp_path / "cmp")
    assert row["train_steps"] == 4 and row["val_steps"] == 2
    for key in ("train_max_abs_delta", "train_final_delta", "val_max_abs_delta",
                "val_final_delta"):
        assert row[key] == 0, key
    assert row["throughput_ratio"] == 1 and row["bytes_ratio"] == 1
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 10_000


def test_two_seeds_list_their_difference_first_then_the_table_and_gate_on_tolerance(
        tmp_path, capsys):
    a, b = fake_run(tmp_path / "a", seed=0), fake_run(tmp_path / "b", seed=1)
    rc, out, _ = compare(capsys, a.path, b.path, "-o", tmp_path / "cmp")
    assert rc == 0
    assert out.index("run.seed: 0 -> 1") < out.index("max |Δloss|")  # differences first
    (row,) = groups(tmp_path / "cmp")
    assert abs(row["train_max_abs_delta"] - 0.01) < 1e-12
    assert abs(row["train_final_delta"] - 0.01) < 1e-12
    assert abs(row["val_final_delta"] - 0.01) < 1e-12
    assert (tmp_path / "cmp" / "compare.png").exists()

    rc, out, _ = compare(capsys, a.path, b.path, "--tolerance", "0.005", "-o", tmp_path / "c2")
    assert rc == 1 and "EXCEEDED" in out and "max |Δtrain| 0.01 > tolerance 0.005" in out
    rc, out, _ = compare(capsys, a.path, b.path, "--tolerance", "0.02", "-o", tmp_path / "c3")
    assert rc == 0 and "EXCEEDED" not in out


def test_sweeps_pair_by_seed_and_groups_are_picked_by_label(tmp_path, capsys):
    fake_sweep(tmp_path / "before")
    fake_sweep(tmp_path / "after", seeds=(0, 1, 2))
    rc, out, _ = compare(capsys, tmp_path / "before", tmp_path / "after", "--tolerance", "0",
                         "-o", tmp_path / "cmp")
    assert rc == 0, out
    assert "B vs A: 2 pairs" in out and "without a partner: B seed 2" in out
    (row,) = groups(tmp_path / "cmp")
    assert row["pairs"] == 2 and row["train_max_abs_delta"] == 0
    rc, out, _ = compare(capsys, f"{tmp_path / 'before'}:ddp", f"{tmp_path / 'after'}:ddp",
                         "-o", tmp_path / "cmp")
    assert rc == 0 and "2 pairs" in out
    rc, _, err = compare(capsys, f"{tmp_path / 'before'}:diloco", tmp_path / "after")
    assert rc == 2 and "no group 'diloco'" in err and "['ddp']" in err


def test_validation_sets_that_differ_or_are_not_recorded_are_listed(tmp_path, capsys):
    a, b, c = (fake_run(tmp_path / n) for n in "abc")
    val_set = {"id": "v1", "sequences": 16, "seq_len": 128, "tokens": 2048}
    a.update_summary({"val_set": val_set})
    b.update_summary({"val_set": {**val_set, "id": "v2"}})
    rc, out, _ = compare(capsys, a.path, b.path, c.path, "-o", tmp_path / "cmp")
    assert rc == 0
    assert "validation set: v1 (16 x 128 tokens) -> v2 (16 x 128 tokens)" in out
    assert "validation set: v1 (16 x 128 tokens) -> not recorded (before run.val_sequences)" \
        in out
    assert out.index("validation set: v1") < out.index("max |Δloss|")
    rc, out, _ = compare(capsys, c.path, c.path, "-o", tmp_path / "cmp")
    assert "note: validation set not recorded (before run.val_sequences)" in out
    assert "differences" not in out


def test_runs_without_a_step_in_common_fail_the_gate(tmp_path, capsys):
    a = fake_run(tmp_path / "a")
    b = write_fake_run(tmp_path / "b", a.config.read_text(), [
        train_row(s, s * 100, s * 0.1, {}, lr=1e-3, loss=4.0, step_s=0.1, compute_s=0.1,
                  comm_s=0.0, comm_bytes=0.0) for s in (3, 6, 9)],
        json.loads(a.summary.read_text()))
    write_json(b.env, {})
    rc, out, _ = compare(capsys, a.path, b.path, "--tolerance", "1", "-o", tmp_path / "cmp")
    assert rc == 1 and "no training step in common" in out


def test_bad_arguments_fail_with_status_2(tmp_path, capsys):
    run = fake_run(tmp_path / "a")
    rc, _, err = compare(capsys, run.path)
    assert rc == 2 and "at least two" in err
    rc, _, err = compare(capsys, run.path, tmp_path / "missing")
    assert rc == 2 and "not found" in err
    rc, _, err = compare(capsys, run.path, run.path, "--tolerance", "-1")
    assert rc == 2 and "--tolerance must be a finite number >= 0" in err


def test_a_loss_that_turned_nan_in_one_run_only_exceeds_any_tolerance(tmp_path, capsys):
    a = fake_run(tmp_path / "a")
    rows = a.read_metrics()
    rows[-2]["loss"] = float("nan")  # B diverged at its last training row
    b = write_fake_run(tmp_path / "b", a.config.read_text(), rows,
                       json.loads(a.summary.read_text()))
    rc, out, _ = compare(capsys, a.path, b.path, "--tolerance", "100", "-o", tmp_path / "cmp")
    assert rc == 1 and "max |Δtrain| inf > tolerance 100" in out
    rc, out, _ = compare(capsys, b.path, b.path, "--tolerance", "0", "-o", tmp_path / "cmp")
    assert rc == 0  # NaN at the same step in both: the same result
