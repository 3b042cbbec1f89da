"""`commbench doctor`: the table and skip logic (fast), and the whole CPU subset (slow)."""

from pathlib import Path

import pytest

from bench.node import doctor
from bench.node.doctor import FAIL, PASS, SKIP, Check, Context, Skip


def passes(ctx):
    return "fine"


def skips(ctx):
    raise Skip("not here")


def fails(ctx):
    raise RuntimeError("the NCCL error\nwith a second line")


def test_checks_run_in_order_and_gpu_checks_skip_without_a_gpu(tmp_path):
    checks = [Check("a", passes), Check("gpu", passes, needs_gpu="CUDA events"),
              Check("b", skips), Check("c", fails)]
    cpu = doctor.run_checks(checks, Context(2, 0, tmp_path))
    assert [(r.check, r.status) for r in cpu] == [("a", PASS), ("gpu", SKIP), ("b", SKIP),
                                                  ("c", FAIL)]
    assert cpu[1].detail == "needs a GPU: CUDA events"
    assert cpu[3].detail == "RuntimeError: the NCCL error"  # the error line
    gpu = doctor.run_checks(checks, Context(2, 8, tmp_path))
    assert gpu[1].status == PASS  # the same check runs where there is a GPU
    report = doctor.format_report(cpu, Context(2, 0, tmp_path))
    assert "| c | FAIL |" in report and "1 passed, 1 failed, 2 skipped." in report
    assert "Skipped: gpu (needs a GPU: CUDA events); b (not here)" in report
    assert "Attach this file to a bug report" in report


def test_the_shipped_checks_name_their_gpu_needs():
    gpu_only = {c.name for c in doctor.CHECKS if c.needs_gpu}
    assert gpu_only == {"one GPU per rank", "CUDA events vs host timing", "compile with DDP"}
    names = [c.name for c in doctor.CHECKS]
    for family in ("run ddp", "run diloco", "run gasloc", "run pipeline 1f1b (2 stages)",
                   "run pipedream-2bw (2 stages)", "run deepspeed zero-1",
                   "checkpoint and resume", "collectives and p2p", "bf16 autocast"):
        assert family in names


def test_too_many_ranks_for_the_gpus_fails(tmp_path):
    (result,) = doctor.run_checks([c for c in doctor.CHECKS if c.name == "one GPU per rank"],
                                  Context(8, 4, tmp_path))
    assert result.status == FAIL and "8 ranks on this node" in result.detail


def test_one_rank_skips_what_needs_two_and_names_why(tmp_path):
    """A node with one GPU (or --world-size 1): the checks that need a peer or two stages
    are skipped with the reason; the others still run."""
    two = [c for c in doctor.CHECKS if c.min_ranks == 2]
    assert {c.name for c in two} == {"run gasloc", "run pipeline 1f1b (2 stages)",
                                     "run pipedream-2bw (2 stages)"}
    results = doctor.run_checks([*two, Check("one", passes)], Context(1, 1, tmp_path))
    assert [r.status for r in results] == [SKIP, SKIP, SKIP, PASS]
    assert results[0].detail == "needs 2 ranks (one GPU each), --world-size is 1"
    (pair,) = doctor.run_checks([Check("pair", passes, min_ranks=2)], Context(2, 2, tmp_path))
    assert pair.status == PASS  # the same check runs on two ranks


@pytest.mark.timeout(240)
def test_one_rank_collectives_and_run_on_this_machine(tmp_path, monkeypatch):
    """World size 1, for real: the collectives worker under torchrun (no peer for p2p, and
    it says so) and a short DDP run of one replica through the launcher."""
    monkeypatch.setenv("HOME", str(tmp_path))  # the short run's corpus cache
    ctx = Context(1, 0, tmp_path)
    detail = doctor.check_collectives(ctx)
    assert detail == ("gloo, 1 rank: all_reduce, broadcast, all_gather correct; send/recv "
                      "not checked (needs 2 ranks)")
    run = doctor.short_run(ctx, "run ddp", "configs/ddp-tiny.yaml", [])
    assert run.startswith("3 steps, val loss ")
    summary = next((tmp_path / "runs").glob("doctor-run-ddp*/summary.json")).read_text()
    assert '"world_size": 1' in summary


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_commbench_doctor_on_this_machine(tmp_path, monkeypatch, capsys):
    """The CPU subset passes here and lists what it skipped for lack of a GPU."""
    from bench.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))  # the short runs' corpus cache
    out = tmp_path / "doctor-report.md"
    code = main(["doctor", "--out", str(out), "--keep", str(tmp_path / "work")])
    report = out.read_text()
    assert code == 0, report
    assert "0 failed" in report and "| run pipedream-2bw (2 stages) | pass |" in report
    assert "Skipped: one GPU per rank (needs a GPU" in report
    assert Path(tmp_path / "work" / "runs").is_dir()
