"""`commbench doctor`: the table and skip logic (fast), the network variables, the
two-node arguments, the bucket-overlap verdict, two doctors on localhost as two nodes, and
the whole CPU subset (slow)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench.node import doctor
from bench.node.doctor import FAIL, PASS, SKIP, Check, Context, Skip
from bench.node.doctor_nodes import interface_report, torchrun_args, validate_nodes
from bench.node.doctor_overlap import first_bucket_overlap

REPO = Path(__file__).resolve().parents[1]


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
    assert gpu_only == {"one GPU per rank", "CUDA events vs host timing",
                        "compile with DDP, bucket overlap"}
    names = [c.name for c in doctor.CHECKS]
    for family in ("run ddp", "run ddp + fsdp", "run diloco", "run diloco int8 exchange",
                   "run streaming diloco (2 fragments, fp4)", "network interfaces",
                   "run gasloc", "run pipeline 1f1b (2 stages)",
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
                                     "run pipedream-2bw (2 stages)", "run ddp + fsdp"}
    results = doctor.run_checks([*two, Check("one", passes)], Context(1, 1, tmp_path))
    assert [r.status for r in results] == [SKIP, SKIP, SKIP, SKIP, PASS]
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


def test_interface_report_names_the_variables_and_warns_about_two_node_hangs():
    ifaces = ["lo", "eth0", "ib0"]
    assert interface_report({}, ifaces) == "no network variables set; interfaces: lo, eth0, ib0"
    fine = interface_report({"NCCL_SOCKET_IFNAME": "eth", "GLOO_SOCKET_IFNAME": "eth0",
                             "MASTER_PORT": "29500", "HOME": "/root"}, ifaces)
    assert fine == ("NCCL_SOCKET_IFNAME=eth; GLOO_SOCKET_IFNAME=eth0; MASTER_PORT=29500; "
                    "interfaces: lo, eth0, ib0")  # a prefix names eth0; HOME is not listed
    alone = interface_report({"NCCL_SOCKET_IFNAME": "ib0"}, ifaces)
    assert alone.count("WARNING") == 1
    assert "NCCL_SOCKET_IFNAME is set but GLOO_SOCKET_IFNAME is not" in alone
    missing = interface_report({"NCCL_SOCKET_IFNAME": "=eth", "GLOO_SOCKET_IFNAME": "ens5"},
                               ifaces)
    assert "WARNING: NCCL_SOCKET_IFNAME names '=eth', which no interface of this host is" in missing
    assert "WARNING: GLOO_SOCKET_IFNAME names 'ens5', not an interface of this host" in missing
    excluded = interface_report({"NCCL_SOCKET_IFNAME": "^docker,lo",
                                 "GLOO_SOCKET_IFNAME": "eth0"}, ifaces)
    assert "WARNING" not in excluded  # an exclusion list names nothing that must exist
    (result,) = doctor.run_checks([c for c in doctor.CHECKS if c.name == "network interfaces"],
                                  Context(1, 0, Path(".")))
    assert result.status == PASS and "lo" in result.detail  # this host's own interfaces


def test_two_node_arguments_are_checked_before_anything_runs():
    assert validate_nodes(1, None, None, {}) == (1, 0, None)
    assert validate_nodes(2, 1, "head:29400", {}) == (2, 1, "head:29400")
    assert validate_nodes(2, None, "head:29400", {"SLURM_NODEID": "1"}) == (2, 1, "head:29400")
    bad = [((0, None, None, {}), "--nnodes must be >= 1, got 0"),
           ((1, 1, None, {}), "--node-rank 1 is for a run across nodes"),
           ((1, None, "h:1", {}), "--rdzv-endpoint h:1 is for a run across nodes"),
           ((2, 0, None, {}), "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
           ((2, 0, "head", {}), "--rdzv-endpoint 'head' is not HOST:PORT"),
           ((2, 0, "head:70000", {}), "a port in 1-65535"),
           ((2, 0, ":29400", {}), "is not HOST:PORT"),
           ((2, None, "head:29400", {}), "needs --node-rank R (0 to 1, one per node)"),
           ((2, 2, "head:29400", {}), "--node-rank 2 must be in 0..1 (--nnodes 2)"),
           ((2, None, "head:29400", {"SLURM_NODEID": "3"}), "--node-rank 3 must be in 0..1")]
    for args, message in bad:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            validate_nodes(*args)
    assert torchrun_args(1, 0, None, 4, {}) == ["--standalone", "--nproc-per-node=4"]
    across = torchrun_args(2, 1, "head:29400", 8, {"SLURM_JOB_ID": "77"})
    assert across[:5] == ["--nnodes=2", "--node-rank=1", "--nproc-per-node=8",
                          "--rdzv-backend=c10d", "--rdzv-endpoint=head:29400"]
    assert "--rdzv-id=commbench-doctor-77" in across  # the same id on every node of the job


def test_only_selects_checks_by_name_or_start_and_refuses_an_unknown_one():
    names = [c.name for c in doctor.select_checks("environment, run diloco", doctor.CHECKS)]
    assert names == ["environment", "run diloco", "run diloco int8 exchange"]
    with pytest.raises(ValueError, match="'colectives' starts no check's name; the checks: "
                                         "environment, network interfaces"):
        doctor.select_checks("colectives", doctor.CHECKS)


def test_cli_refuses_bad_node_arguments_with_the_flag(tmp_path, capsys):
    from bench.cli import main

    assert main(["doctor", "--nnodes", "2", "--node-rank", "5", "--rdzv-endpoint", "h:1",
                 "--out", str(tmp_path / "r.md")]) == 2
    assert capsys.readouterr().err == ("commbench: error: doctor --node-rank 5 must be in "
                                       "0..1 (--nnodes 2)\n")
    assert not (tmp_path / "r.md").exists()  # refused before any check ran


def bucket(step, lead_s):
    return {"step": step, "lead_s": lead_s, "seconds": 0.01, "nbytes": 2**20}


def test_first_bucket_overlap_passes_an_overlapped_backward_and_fails_a_late_one():
    compute = {0: 0.5, 1: 0.1, 2: 0.1, 3: 0.1}
    # overlapped: 3 buckets spread over the backward; step 0 (warm-up: compiling) had none
    spread = [b for s in (1, 2, 3) for b in (bucket(s, 0.04), bucket(s, 0.02), bucket(s, 0.0))]
    late = [bucket(0, 0.0), bucket(0, 0.0), *spread]
    assert first_bucket_overlap(late, compute, skip_steps=1) == (
        "first of 3 buckets launched 40.00 ms (40% of the step's compute) before the "
        "backward ended, median of 3 steps")
    mostly_late = [*(b for s in (1, 2) for b in (bucket(s, 0.0), bucket(s, 0.0))),
                   bucket(3, 0.04), bucket(3, 0.0)]  # the median step's first bucket: late
    with pytest.raises(RuntimeError, match="no overlap: first of 2 buckets launched 0.00 ms "
                                           r"\(0% of the step's compute\)"):
        first_bucket_overlap(mostly_late, compute, skip_steps=1)
    # every bucket launched after the backward: leads of launch overhead only
    bunched = [b for s in (1, 2, 3) for b in (bucket(s, 0.0002), bucket(s, 0.0001),
                                              bucket(s, 0.0))]
    with pytest.raises(RuntimeError, match=r"no overlap: .*\(0% of the step's compute\)"):
        first_bucket_overlap(bunched, compute, skip_steps=1)
    with pytest.raises(RuntimeError, match=r"one DDP bucket in step\(s\) \[1, 2\]"):
        first_bucket_overlap([bucket(1, 0.0), bucket(2, 0.0)], compute, skip_steps=1)
    with pytest.raises(RuntimeError, match="no DDP bucket records after the 4 warm-up steps"):
        first_bucket_overlap(spread, compute, skip_steps=4)


@pytest.mark.timeout(180)
def test_bucket_overlap_of_a_real_ddp_run_on_cpu(tmp_path, monkeypatch):
    """The overlap check's worker on 2 gloo ranks, eager (compiled on a GPU): DDP's hook
    launches the first of its 4 buckets while the backward still runs."""
    monkeypatch.setenv("HOME", str(tmp_path))  # the run's corpus cache
    detail = doctor.check_overlap(Context(2, 0, tmp_path), compile=False)
    assert detail.startswith("first of 4 buckets launched "), detail
    assert "median of 4 steps; 6 steps, " in detail


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(200)
def test_two_doctors_on_localhost_as_two_nodes(tmp_path):
    """`commbench doctor --nnodes 2` twice on this machine, one rank each (gloo): the
    collectives span both "nodes" through torchrun's c10d rendezvous, each node's report
    says so and carries the cross-node all-reduce bandwidth."""
    endpoint = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, HOME=str(tmp_path), PYTHONPATH=str(REPO))
    procs = [subprocess.Popen(
        [sys.executable, "-m", "bench.cli", "doctor", "--nnodes", "2", "--node-rank", str(r),
         "--rdzv-endpoint", endpoint, "--world-size", "1", "--only", "collectives",
         "--out", str(tmp_path / f"node{r}.md")], cwd=REPO, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, output) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, output
        report = (tmp_path / f"node{r}.md").read_text()
        assert f"node {r} of 2 (rendezvous {endpoint})" in report
        assert ("| collectives and p2p | pass |" in report
                and "gloo, 2 ranks on 2 nodes: all_reduce, broadcast, all_gather, send/recv, "
                    "batch_isend_irecv correct; all_reduce bus bandwidth 1 MiB " in report)
        assert "16 MiB " in report and "1 passed, 0 failed, 0 skipped." in report
