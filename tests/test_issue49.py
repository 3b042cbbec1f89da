"""Issue 49 (the third probe): names, pages, gates and bounds.

Rows of the bad-input matrix (tests/test_bad_input.py: the real command line, the exit
code, each expected part of the message, nothing on disk changed) for the cases the probe
found late, unclear or accepted; then the cases that are not a refusal: markup through
every page writer, compare's gate on an unfinished run, track's check before sending,
the what-if's bound under a timeout.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bench.cli import main
from tests import test_bad_input as matrix
from tests.test_bad_input import SWEEP, Case, recorded_run, run_argv, spec

REPO = Path(__file__).resolve().parent.parent
SCENARIO = "{repo}/configs/whatif/llama1b-8x8.yaml"
WHATIF = ["whatif", SCENARIO, "-o", "{tmp}/wi"]

CASES = [
    # ---- one rule for names (a trailing newline passed `$` with re.match)
    Case("run-name-newline", run_argv('run.name="evil\\n"'),
         ["run.name", "'evil\\n'", "letters, digits", "run directory"]),
    Case("sweep-name-newline", SWEEP + ["--dry-run"], ["name", "'evil\\n'", "letters, digits"],
         files=spec('name: "evil\\n"\n')),
    Case("variant-name-newline", SWEEP + ["--dry-run"],
         ["variant name", "'x\\n'", "letters, digits"],
         files=spec('variants: {"x\\n": {strategy.name: ddp}}\n')),
    Case("whatif-name-escape", WHATIF + ["--set", "name=../x"],
         ["name", "'../x'", "letters, digits", "output folder"]),
    Case("whatif-name-deep-escape", WHATIF + ["--set", "name=../../../../tmp/x"],
         ["name", "'../../../../tmp/x'", "letters, digits"]),
    # ---- whatif -o into a run record (report -o refuses it)
    Case("whatif-into-run-dir", WHATIF[:2] + ["-o", "{tmp}/r"],
         ["whatif -o", "{tmp}/r", "is a run directory", "elsewhere"], files=recorded_run()),
    Case("whatif-out-under-file", WHATIF[:2] + ["-o", "{tmp}/file/wi"],
         ["whatif -o", "{tmp}/file", "is a file"], files={"file": "x"}),
    # ---- the planner's bounds
    Case("whatif-10-6-replicas", WHATIF + ["--set", "world.replicas=1000000"],
         ["world.replicas x world.gpus_per_replica", "8,000,000 GPUs", "at most 1,024"]),
    Case("whatif-10-5-gpus", WHATIF + ["--set", "world.replicas=12500"],
         ["100,000 GPUs", "at most 1,024", "MAX_GPUS"]),
    Case("whatif-points", WHATIF + ["--set", "network.points=100000"],
         ["network.points", "100000", "from 1 to 1000"]),
    Case("whatif-num-params-negative", WHATIF + ["--set", "model_size.num_params=-5"],
         ["model_size.num_params", "-5", "a parameter count >= 1"]),
    # ---- late or unclear: refused before anything starts
    Case("netprobe-one-size", ["netprobe", "--sizes", "4", "--out", "{tmp}/p.yaml"],
         ["netprobe --sizes 4", "at least two different sizes", "latency and bandwidth"]),
    Case("netprobe-out-under-file", ["netprobe", "--out", "{tmp}/file/p.yaml"],
         ["netprobe --out", "{tmp}/file", "is a file"], files={"file": "x"}),
    Case("netprobe-out-a-directory", ["netprobe", "--out", "{tmp}/d"],
         ["netprobe --out", "{tmp}/d", "is a directory", "a file path"], files={"d/x": "x"}),
    Case("sweep-base-is-itself", SWEEP + ["--dry-run"],
         ["base 'spec.yaml' is this sweep spec itself", "a run config"],
         files={"spec.yaml": "base: spec.yaml\nvariants: {a: {run.steps: 2}}\n"}),
    Case("nnodes-without-rendezvous", run_argv("launch.nnodes=2"),
         ["launch.rdzv_endpoint must be host:port", "got None", "launch.nnodes 2"]),
    Case("rendezvous-without-port", run_argv("launch.rdzv_endpoint=node1"),
         ["launch.rdzv_endpoint", "'node1'", "host:port"]),
    Case("rendezvous-bad-port", run_argv("launch.rdzv_endpoint='node1:99999'"),
         ["launch.rdzv_endpoint", "'node1:99999'", "from 1 to 65535"]),
    Case("seed-negative", run_argv("run.seed=-1"), ["run.seed", "-1", "from 0 to"]),
    Case("seed-past-64-bits", run_argv("run.seed=18446744073709551616"),
         ["run.seed", "18446744073709551616", "(2**63 - 1)"]),
    Case("whatif-replica-over-odd-nodes",
         WHATIF + ["--set", "world.gpus_per_replica=8", "--set", "world.gpus_per_node=3"],
         ["world.gpus_per_replica (8)", "world.gpus_per_node (3)", "divide"]),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_issue49_bad_input(case, tmp_path, capsys):
    matrix.test_bad_input_fails_cleanly_and_changes_nothing(case, tmp_path, capsys)


@pytest.mark.timeout(30)
def test_a_whatif_of_10_5_gpus_answers_within_10_s(tmp_path, capsys):
    """A world people plan (10^5 GPUs) is answered (here: refused, naming the bound) in
    seconds, not the minutes it ran for; so is a sweep of 10^5 points."""
    for setting in ("world.replicas=12500", "network.points=100000"):
        start = time.monotonic()
        code = main(["whatif", str(REPO / "configs/whatif/llama1b-8x8.yaml"), "--set",
                     setting, "-o", str(tmp_path / "wi")])
        assert code == 2 and time.monotonic() - start < 10
    assert "at most" in capsys.readouterr().err
    assert not (tmp_path / "wi").exists()


def test_the_plan_refuses_more_rank_steps_than_its_bound():
    from bench.study.whatif.report import method_plan
    from bench.study.whatif.scenario import base_profile, load_scenario

    s = load_scenario(str(REPO / "configs/whatif/llama1b-8x8.yaml"),
                      ["methods={d: {strategy: {name: diloco, inner_steps: 100000}}}"])
    with pytest.raises(ValueError, match=r"methods\.d: .*rank-steps.*MAX_RANK_STEPS"):
        method_plan(s, "d", base_profile(s)[0])



# ------------------------------------------------------------------ compare's gate


def _compare(capsys, *args) -> tuple[int, str]:
    code = main(["compare", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out + out.err


def _unfinished_copy(run, path: Path, status: str):
    """`run`'s records with its summary's status set to `status` (a run that stopped
    halfway keeps the rows both logged: the losses agree where they overlap)."""
    from tests.fakes import write_fake_run

    summary = json.loads(run.summary.read_text())
    summary.update(status="failed" if status == "partial" else status, error="stopped")
    if status == "partial":
        summary["interrupted"] = True  # Ctrl-C: recorded failed, shown partial
    return write_fake_run(path, run.config.read_text(), run.read_metrics()[:2], summary)


@pytest.mark.parametrize("status", ["failed", "partial", "diverged"])
def test_compare_gate_fails_on_a_run_that_did_not_finish_ok(tmp_path, capsys, status):
    from tests.test_tracking import fake_run

    a = fake_run(tmp_path / "a")
    b = _unfinished_copy(a, tmp_path / "b", status)
    code, out = _compare(capsys, a.path, b.path, "--tolerance", "0", "-o", tmp_path / "cmp")
    assert code == 1, out
    assert f"B's run b did not finish ok: {status}" in out and "within" not in out
    assert f"ok -> {status}" in out  # each side's status, in the table
    groups = json.loads((tmp_path / "cmp" / "compare.json").read_text())["comparisons"]
    assert groups[0]["groups"][0]["status"] == [["ok", status]]
    code, out = _compare(capsys, b.path, a.path, "--tolerance", "0", "-o", tmp_path / "cmp")
    assert code == 1 and f"A's run b did not finish ok: {status}" in out


def test_a_symlinked_run_directory_is_named_by_compare(tmp_path, capsys):
    from tests.test_tracking import fake_run

    a = fake_run(tmp_path / "a" / "ddp-000000000000")
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "linked").symlink_to(a.path, target_is_directory=True)
    code, out = _compare(capsys, tmp_path / "a", tmp_path / "tree", "-o", tmp_path / "cmp")
    assert code == 2  # no run read inside tree: refused, and the link is named
    assert f"{tmp_path / 'tree' / 'linked'} is a symbolic link to a directory: not read" in out


# ------------------------------------------------------------------ track


def test_track_refuses_a_summary_that_is_a_list_before_sending_any(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tests.test_tracking import fake_run

    fake_run(tmp_path / "results" / "a-000000000000")
    bad = fake_run(tmp_path / "results" / "b-000000000000")
    bad.summary.write_text("[1, 2]\n")
    tb = tmp_path / "tb"
    code = main(["track", str(tmp_path / "results"), "--to", "tensorboard", "--set",
                 f"dir={tb}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{bad.summary} is not a run's summary" in err and "got a JSON list" in err
    assert "nothing sent" in err
    assert not tb.exists() and not (tmp_path / "results" / "a-000000000000" /
                                    "tracking.json").exists()


def test_track_warns_of_non_finite_rows_appended_to_an_ok_run(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from bench.run.files import append_jsonl
    from tests.test_tracking import fake_run

    run = fake_run(tmp_path / "results" / "a-000000000000", steps=6)
    append_jsonl(run.metrics, {"step": 9, "loss": float("nan"), "lr": 1e-3})
    append_jsonl(run.metrics, {"step": 9, "val_loss": float("inf")})
    assert main(["track", str(tmp_path / "results"), "--to", "tensorboard", "--set",
                 f"dir={tmp_path / 'tb'}"]) == 0
    err = capsys.readouterr().err
    assert "a loss that is not finite (NaN or Infinity) at step 9" in err
    assert "rows at step 9 past the 6 steps summary.json records" in err


def test_a_sweep_name_read_by_track_follows_the_name_rule(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from bench.run.files import write_json
    from tests.test_tracking import fake_sweep

    fake_sweep(tmp_path / "results")
    write_json(tmp_path / "results" / "sw" / "sweep.json", {"name": "../../escape"})
    code = main(["track", str(tmp_path / "results"), "--to", "tensorboard", "--set",
                 f"dir={tmp_path / 'tb'}"])
    err = capsys.readouterr().err
    assert code == 2 and "'../../escape'" in err and "letters, digits" in err
    assert not (tmp_path / "tb").exists()


# ------------------------------------------------------------------ one escaping rule

MARKUP = "<script>alert(1)</script> <img src=x onerror=alert(1)> [x](javascript:alert(1)) |"


def _raw_markup(page: str) -> list[str]:
    """Markup of MARKUP that a markdown renderer would keep (raw tags, a live link)."""
    import re

    return [m for m in ("<script", "<img", r"(?<!\\)\]\(javascript") if re.search(m, page)]


def test_every_text_field_of_the_whatif_page_is_escaped(monkeypatch):
    from bench.study.whatif import report
    from bench.study.whatif.scenario import load_scenario

    s = load_scenario(None, ["hardware.gpu=H100 SXM"])
    s.network.profile, s.hardware.run = MARKUP, MARKUP  # texts the page repeats
    s.hardware.compute_s_per_step = None
    at = {"bandwidth_Bps": 1e9, "step_s": 1.0, "comm_s": 0.1, "utilisation": 0.9,
          "total_s": 3600.0}
    results = [report.MethodResult(MARKUP, "ddp", 8, 10, 1.0, at, dict.fromkeys(s.targets,
                                   1e9), [(1e9, 0.9)], [MARKUP])]
    page = report.table(s, results)
    assert not _raw_markup(page), page
    assert MARKUP.replace("<", "&lt;").split("[")[0] in page  # shown, as text
    table_rows = [line for line in page.splitlines() if line.startswith("| ")]
    assert all(line.count(" | ") == table_rows[0].count(" | ") for line in table_rows)
    with pytest.raises(ValueError, match="letters, digits"):  # the name: refused, not escaped
        load_scenario(None, [f"name={MARKUP}"])


def test_every_text_field_of_the_doctor_report_is_escaped(monkeypatch, tmp_path):
    from bench.node import doctor

    monkeypatch.setattr(doctor.platform, "node", lambda: MARKUP)
    results = [doctor.Result(MARKUP, doctor.FAIL, MARKUP),
               doctor.Result("skipped", doctor.SKIP, MARKUP)]
    page = doctor.format_report(results, doctor.Context(1, 0, tmp_path))
    assert not _raw_markup(page), page
    row = doctor.format_row(results[0])
    assert row.count(" | ") == 3, row  # the detail's | cannot add a column


def test_tensorboard_text_cannot_leave_its_code_block():
    from bench.study.tracking.sinks import _code

    text = f"name: x\n```\n{MARKUP}\n````\n"
    block = _code(text, "yaml")
    fence = block.splitlines()[0].removesuffix("yaml")
    assert set(fence) == {"`"} and len(fence) > 4 and block.endswith("\n" + fence)
    assert fence not in text


# ------------------------------------------------------------------ identity of state files


def _state(step: int, identity: dict | None) -> bytes:
    import io

    import torch

    buffer = io.BytesIO()
    torch.save({"step": step, "strategy": {}, "loop": {},
                **({"identity": identity} if identity else {})}, buffer)
    return buffer.getvalue()


def _identity(tmp_path: Path, rank: int, world: int = 2) -> dict:
    from bench.run.checkpoint import state_identity
    from bench.run.records import RunDir

    (tmp_path / "r").mkdir(exist_ok=True)
    (tmp_path / "r" / "config.yaml").write_text(matrix._fill(matrix.RECORDED, tmp_path))
    return state_identity(RunDir(tmp_path / "r"), rank, world)


def test_a_resume_refuses_rank_0s_state_in_rank_1s_place(tmp_path, capsys):
    """A 2-rank run whose state-rank1.pt was replaced by rank 0's (a sharded run would train
    rank 1 on rank 0's shard): refused before launch, naming the file."""
    rank0 = _state(2, _identity(tmp_path, 0))
    case = Case("swapped", matrix.RESUME,
                ["--resume", "{tmp}/r/checkpoints/state-rank1.pt", "rank 0's state",
                 "not rank 1's"], files=recorded_run(checkpoints={0: rank0, 1: rank0}))
    matrix.test_bad_input_fails_cleanly_and_changes_nothing(case, tmp_path, capsys)


def test_a_resume_refuses_another_runs_state(tmp_path, capsys):
    other = {**_identity(tmp_path, 1), "run": "0123456789ab", "layout": "pier, world 2"}
    case = Case("other-run", matrix.RESUME,
                ["{tmp}/r/checkpoints/state-rank1.pt", "belongs to another run or layout",
                 "0123456789ab", "pier, world 2"],
                files=recorded_run(checkpoints={0: _state(2, _identity(tmp_path, 0)),
                                                1: _state(2, other)}))
    matrix.test_bad_input_fails_cleanly_and_changes_nothing(case, tmp_path, capsys)


def test_state_files_of_this_run_and_older_ones_without_identity_are_accepted(tmp_path):
    from bench.run.checkpoint import verify_states
    from bench.run.records import RunDir

    for name, content in recorded_run(checkpoints={0: _state(2, _identity(tmp_path, 0)),
                                                   1: _state(2, None)}).items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content) if isinstance(content, bytes) else \
            path.write_text(matrix._fill(content, tmp_path))
    assert verify_states(RunDir(tmp_path / "r"), 2) == 2


def test_an_exported_fault_is_recorded_and_an_exported_resume_is_not_passed_on(
        tmp_path, monkeypatch, capsys):
    """COMMBENCH_FAULT left in the environment: the run says so and records it;
    COMMBENCH_RESUME left there does not reach the ranks of a run that is not resumed."""
    from bench.launch import torchrun

    seen = {}
    real = torchrun.run

    def spy(command, env, *args, **kwargs):
        seen.update(env)
        return real(command, env, *args, **kwargs)

    monkeypatch.setattr(torchrun, "run", spy)
    monkeypatch.setenv("COMMBENCH_FAULT", "1:2:crash")
    monkeypatch.setenv("COMMBENCH_RESUME", "1")
    argv = [matrix._fill(a, tmp_path) for a in run_argv(*matrix.SMALL, "run.steps=3")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "COMMBENCH_FAULT=1:2:crash is set" in err
    summary = json.loads(next((tmp_path / "out").glob("*/summary.json")).read_text())
    assert summary["fault_injected"] == "1:2:crash" and summary["status"] == "failed"
    assert "COMMBENCH_RESUME" not in seen and seen  # the ranks' environment


def test_deepspeed_backend_without_deepspeed_is_refused_before_launch(monkeypatch):
    """strategy.backend=deepspeed where DeepSpeed is not installed failed in every rank
    after launch; preflight refuses it, naming the key and what to do."""
    import importlib.util

    from bench.config import load_config
    from bench.config.preflight import preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))
    for config in ("configs/ddp-tiny.yaml", "configs/deepspeed-pp-tiny.yaml"):
        cfg = load_config(REPO / config, ["strategy.backend=deepspeed"])
        with pytest.raises(ValueError) as err:
            preflight(cfg)
        assert "strategy.backend" in str(err.value) and "not installed" in str(err.value)
    preflight(load_config(REPO / "configs/ddp-tiny.yaml", []))  # torch's DDP: no DeepSpeed


# ------------------------------------------- the same identity in DCP checkpoints (issue 46)


def _dcp_files(tmp_path: Path, **kwargs) -> dict:
    """recorded_run's files with a DCP checkpoint at step 2 keyed to this run's config."""
    from bench.run.checkpoint import run_key
    from bench.run.records import RunDir

    (tmp_path / "r").mkdir(exist_ok=True)
    (tmp_path / "r" / "config.yaml").write_text(matrix._fill(matrix.RECORDED, tmp_path))
    key, _ = run_key(RunDir(tmp_path / "r"), without_layout=True)
    assert key
    return {**recorded_run(), **matrix.dcp_checkpoint(run=key, **kwargs)}


def test_a_dcp_checkpoint_of_this_run_is_accepted(tmp_path):
    from bench.run.checkpoint import verify_states
    from bench.run.records import RunDir

    for name, content in _dcp_files(tmp_path).items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content) if isinstance(content, bytes) else \
            path.write_text(matrix._fill(content, tmp_path))
    assert verify_states(RunDir(tmp_path / "r"), 2) == 2


def test_a_dcp_checkpoint_whose_rank_1_skeleton_is_rank_0s_is_refused(tmp_path, capsys):
    """This run's checkpoint (its run key), but rank 1's part is rank 0's (a file copied
    between ranks): refused before launch, naming the file, nothing changed."""
    case = Case("dcp-swapped", matrix.RESUME,
                ["{tmp}/r/checkpoints/state-step2/__0_0.distcp holds rank 0's state",
                 "not rank 1's"], files=_dcp_files(tmp_path, identities={1: 0}))
    matrix.test_bad_input_fails_cleanly_and_changes_nothing(case, tmp_path, capsys)
