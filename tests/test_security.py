"""Results directories travel (shared filesystems, tarballs, a paper's artefact): everything
commbench reads from one is untrusted. Nothing in it may execute or inject.

    pytest tests/test_security.py

- Markup: report.md and claims.md render record and claim-file text as text (no inline
  HTML survives, no `javascript:` link forms); the HTML pages escape everything.
- Pickles: every checkpoint is loaded with `torch.load(weights_only=True)`
  (bench/run/checkpoint.py `load_payload`): a crafted state-rank*.pt or final.pt whose pickle
  would run code is refused, unread, by `run --resume`, `eval`, `export` and `report`; a
  DCP checkpoint's .metadata only with DCP's metadata classes (bench/run/dcp_state.py).
- Paths: a run directory whose files are symbolic links out of it, or records naming
  `..`, never make commbench write outside the directory it was asked to write.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from bench.cli import main
from bench.model import GPT, GPTConfig
from bench.study.claims import run_claims
from bench.study.report import build_report
from bench.study.report.render import md_text, to_markdown
from tests.test_bad_input import _snapshot, dcp_checkpoint, recorded_run
from tests.test_claims import claim_data, fake_runner
from tests.test_report import DDP_VAL, _save, _sweep, write_run

HOSTILE = [
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    "[click](javascript:alert(1))",
    "[ref]: javascript:alert(1)",
]
"""Strings a crafted record or claim file carries into every text a page shows."""


def assert_inert_markdown(md: str) -> None:
    """No raw tag, and no link or reference definition whose `]` is not backslash-escaped."""
    for live in ("<script", "<img src=x"):
        assert live not in md, live
    assert not re.search(r"(?<!\\)\]\(javascript:", md)
    assert not re.search(r"(?<!\\)\]:\s*javascript:", md)


def test_markdown_text_renders_as_text():
    for text in HOSTILE:
        out = md_text(text)
        assert "<" not in out and "](" not in out.replace("\\](", "")
        assert_inert_markdown(out)
    # the report's own markup stays
    assert md_text("`code` and **bold**, 2.47× [0.93, 6.6]") == \
        "`code` and **bold**, 2.47× [0.93, 6.6]"


def test_every_block_of_a_page_is_escaped(tmp_path):
    import pandas as pd

    png = tmp_path / "f.png"
    png.write_bytes(b"\x89PNG")
    hostile = " ".join(HOSTILE)
    md = to_markdown([("h1", hostile), ("h2", hostile), ("p", hostile),
                      ("table", pd.DataFrame({hostile: [hostile]})),
                      ("figure", png, hostile)], tmp_path)
    assert_inert_markdown(md)


def test_report_of_a_crafted_results_directory_is_inert(tmp_path):
    sweep_dir, sweep = _sweep(tmp_path, "s")
    hostile = " ".join(HOSTILE)
    for seed in (0, 1):
        write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0)
        write_run(sweep_dir, sweep, "x<script>alert(1)</script>", "diloco", seed, DDP_VAL,
                  0.5, status="failed", error=hostile)
    out = tmp_path / "out"
    html_path = build_report(_save(sweep_dir, sweep), out)
    md = (out / "report.md").read_text()
    assert "&lt;script>" in md  # the text is there, as text
    assert_inert_markdown(md)
    html = html_path.read_text()
    assert "<script>" not in html and "<img src=x" not in html


def test_claims_page_of_a_crafted_claim_file_is_inert(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    claims_dir = tmp_path / "claims"
    claims_dir.mkdir()
    base = {"run": {"name": "base", "steps": 10}, "model": {"preset": "tiny", "seq_len": 32},
            "data": {"corpus": "embedded", "batch_size": 4}, "parallel": {"world_size": 2},
            "strategy": {"name": "ddp"}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    hostile = " ".join(HOSTILE)
    data = claim_data(statement=hostile,
                      paper={"source": hostile, "where": hostile, "numbers": hostile})
    data["rules"][0]["name"] = hostile
    (claims_dir / "toy.yaml").write_text(yaml.safe_dump(data))
    page = run_claims(claims_dir=claims_dir, output_dir="results", report_dir="report",
                      runner=fake_runner)
    md = (tmp_path / "report" / "claims.md").read_text()
    assert "&lt;script>" in md
    assert_inert_markdown(md)
    assert "<script>" not in page.read_text()
    json.loads((tmp_path / "report" / "claims.json").read_text())  # still valid JSON


@pytest.mark.parametrize("text", HOSTILE)
def test_table_cells_cannot_break_out_of_the_table(text):
    import pandas as pd

    from bench.study.report.render import markdown_table

    table = markdown_table(pd.DataFrame({"a": [text + "|\nnext"]}))
    assert table.count("\n") == 2  # header, rule, one row


# ------------------------------------------------------------------------------ pickles


class Planted:
    """Pickles as a call of `open(marker, "w")`: loading it with plain pickle creates the
    marker file (a stand-in for any command a crafted checkpoint could run)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def crafted(marker: Path, **fields) -> bytes:
    """A torch checkpoint with `fields` and an object that runs code when unpickled."""
    buffer = io.BytesIO()
    torch.save({**fields, "planted": Planted(marker)}, buffer)
    return buffer.getvalue()


def write_files(root: Path, files: dict[str, str | bytes]) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content.replace("{tmp}", str(root)))


def crafted_eval_run(root: Path, marker: Path) -> Path:
    """A finished run directory whose final.pt carries a planted object beside real weights."""
    model = GPT(GPTConfig(vocab_size=256, seq_len=16, n_layer=1, n_head=2, n_embd=16))
    config = {"data": {"corpus": "embedded", "tokenizer": "byte",
                       "cache_dir": str(root / "cache")}, "model": {"seq_len": 16}}
    files = {"run/config.yaml": yaml.safe_dump(config),
             "run/summary.json": json.dumps({"status": "ok", "run_name": "x"}),
             "run/checkpoints/final.pt": crafted(
                 marker, model=model.state_dict(), gpt_config=dataclasses.asdict(model.cfg),
                 tokenizer="byte", step=3)}
    write_files(root, files)
    return root / "run"


def test_resume_refuses_a_crafted_state_checkpoint_without_running_it(tmp_path, capsys):
    """Issue 29: `run --resume DIR` loaded checkpoints/state-rank*.pt with
    weights_only=False, so a received run directory ran a command once per rank."""
    marker = tmp_path / "executed"
    state = crafted(marker, step=2, strategy={}, loop={})
    write_files(tmp_path, recorded_run(checkpoints={0: state, 1: state}))
    before = _snapshot(tmp_path)
    code = main(["run", "--resume", str(tmp_path / "r"), "--quiet"])
    err = capsys.readouterr().err
    assert not marker.exists(), "the crafted pickle ran"
    assert code == 2, err
    assert f"{tmp_path}/r/checkpoints/state-rank0.pt holds objects other than tensors" in err
    assert _snapshot(tmp_path) == before


def test_resume_refuses_a_crafted_dcp_metadata_without_running_it(tmp_path, capsys):
    """torch.distributed.checkpoint reads a checkpoint's .metadata with plain pickle: a
    received state-stepN/.metadata naming any object ran it. It is read first with only
    DCP's metadata classes (bench/run/dcp_state.py `Reader`), by the launcher and the ranks."""
    import pickle

    marker = tmp_path / "executed"
    files = dcp_checkpoint()
    files["r/checkpoints/state-step2/.metadata"] = pickle.dumps(Planted(marker))
    write_files(tmp_path, {**recorded_run(), **files})
    before = _snapshot(tmp_path)
    code = main(["run", "--resume", str(tmp_path / "r"), "--quiet"])
    err = capsys.readouterr().err
    assert not marker.exists(), "the crafted pickle ran"
    assert code == 2, err
    assert (f"{tmp_path}/r/checkpoints/state-step2/.metadata holds objects other than a "
            "checkpoint's metadata (it names io.open") in err
    assert _snapshot(tmp_path) == before
    from bench.run import dcp_state  # the ranks' reader refuses it too
    with pytest.raises(ValueError, match="holds objects other than"):
        dcp_state.metadata_of(tmp_path / "r/checkpoints/state-step2")
    assert not marker.exists()


def test_eval_refuses_a_crafted_final_checkpoint_without_running_it(tmp_path, capsys):
    marker = tmp_path / "executed"
    run = crafted_eval_run(tmp_path, marker)
    code = main(["eval", str(run), "--suite", "smoke", "--limit", "2"])
    err = capsys.readouterr().err
    assert not marker.exists(), "the crafted pickle ran"
    assert code == 2 and "final.pt' holds objects other than tensors" in err, err
    assert not (run / "eval.json").exists()


def test_export_refuses_a_crafted_final_checkpoint_without_running_it(tmp_path, capsys):
    marker = tmp_path / "executed"
    run = crafted_eval_run(tmp_path, marker)
    code = main(["export", str(run), "--hf", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert not marker.exists(), "the crafted pickle ran"
    assert code == 2 and "holds objects other than tensors" in err, err
    assert not (tmp_path / "hf").exists()


def test_report_of_a_directory_with_crafted_checkpoints_runs_nothing(tmp_path):
    marker = tmp_path / "executed"
    sweep_dir, sweep = _sweep(tmp_path / "results", "s")
    for seed in (0, 1):
        path = write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0)
        write_files(path, {"checkpoints/final.pt": crafted(marker, step=1),
                           "checkpoints/state-rank0.pt": crafted(marker, step=1),
                           "checkpoints/state-step1/.metadata": __import__("pickle").dumps(
                               Planted(marker)),
                           "checkpoints/state-step1/complete.json": '{"step": 1}'})
    build_report(_save(sweep_dir, sweep), tmp_path / "report")
    assert not marker.exists()


def test_an_eval_checkpoint_whose_config_does_not_match_its_weights_is_refused(tmp_path):
    """A crafted gpt_config (a huge model) fails before the model is allocated."""
    from eval.lm import load_checkpoint

    model = GPT(GPTConfig(vocab_size=256, seq_len=16, n_layer=1, n_head=2, n_embd=16))
    path = tmp_path / "final.pt"
    torch.save({"model": model.state_dict(), "tokenizer": "byte",
                "gpt_config": {**dataclasses.asdict(model.cfg), "n_embd": 1 << 20}}, path)
    with pytest.raises(ValueError, match="its weights do not match its gpt_config"):
        load_checkpoint(path)
    torch.save({"model": model.state_dict(), "tokenizer": "byte",
                "gpt_config": {"vocab_size": 256, "layers": 3}}, path)
    with pytest.raises(ValueError, match="does not describe a model"):
        load_checkpoint(path)


# -------------------------------------------------------------------------------- paths


def tree(root: Path) -> dict[str, str]:
    """Every path under root, links as their targets (what a write outside would change);
    the tokeniser cache is not a record."""
    return {p.relative_to(root).as_posix(): (f"-> {p.readlink()}" if p.is_symlink() else
                                             p.read_text(errors="replace") if p.is_file()
                                             else "dir")
            for p in sorted(root.rglob("*")) if p.relative_to(root).parts[0] != "cache"}


def test_resume_refuses_a_run_directory_with_a_link_out_of_it(tmp_path, capsys):
    """A received run whose logs/ is a link: the launcher appended torchrun.log (and the
    ranks their error texts) wherever it pointed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("precious")
    write_files(tmp_path, recorded_run())
    (tmp_path / "r" / "logs").symlink_to(outside)
    before = tree(tmp_path)
    code = main(["run", "--resume", str(tmp_path / "r"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"run directory {tmp_path}/r: {tmp_path}/r/logs is a symbolic link (to {outside})" \
        in err
    assert tree(tmp_path) == {**before, "r/.lock": ""}  # the lock file, empty once released


def test_eval_refuses_a_run_directory_with_a_link_out_of_it(tmp_path, capsys):
    run = crafted_eval_run(tmp_path, tmp_path / "unused")
    (tmp_path / "elsewhere.json").write_text("{}")
    (run / "eval.json").symlink_to(tmp_path / "elsewhere.json")
    code = main(["eval", str(run), "--suite", "smoke", "--limit", "2"])
    err = capsys.readouterr().err
    assert code == 2 and f"{run}/eval.json is a symbolic link" in err, err
    assert (tmp_path / "elsewhere.json").read_text() == "{}"


@pytest.mark.parametrize("record", ["tracking.json", "sweep.json"])
def test_track_never_writes_outside_the_sinks_directory(tmp_path, record, capsys):
    """A record naming `..`: the TensorBoard run tracking.json names (its handle), or the
    sweep's name, made TensorBoard write outside its directory."""
    pytest.importorskip("tensorboard")
    from bench.run.files import write_json
    from bench.study.tracking.sync import track
    from tests.test_tracking import fake_sweep

    (run, _) = fake_sweep(tmp_path / "results")
    tb, escape = tmp_path / "tb", tmp_path / "escaped"
    if record == "tracking.json":
        write_json(run.tracking, {f"tensorboard:{tb}": {"handle": "../escaped/x",
                                                         "attempt": run.read_summary()[
                                                             "started"]}})
        assert track(tmp_path / "results", "tensorboard", [f"dir={tb}"]) >= 1
        assert "not a path inside" in capsys.readouterr().err
    else:  # the name rule refuses the sweep's name before anything is sent (issue 49)
        sweep = json.loads((run.path.parent / "sweep.json").read_text())
        write_json(run.path.parent / "sweep.json", {**sweep, "name": "../escaped"})
        with pytest.raises(ValueError, match="nothing sent.*'../escaped'"):
            track(tmp_path / "results", "tensorboard", [f"dir={tb}"])
        assert not tb.exists()
    assert not escape.exists()


def test_track_takes_no_destination_outside_from_a_record(tmp_path, capsys):
    from bench.study.tracking.sync import track
    from tests.test_tracking import fake_run

    run = fake_run(tmp_path / "results" / "r")
    config = yaml.safe_load(run.config.read_text())
    config["tracking"] = {"tensorboard": {"dir": str(tmp_path / "elsewhere")}}
    run.config.write_text(yaml.safe_dump(config))
    code = main(["track", str(tmp_path / "results"), "--to", "tensorboard"])
    err = capsys.readouterr().err
    assert code == 2 and "tracking.tensorboard.dir" in err and "--set dir=" in err, err
    assert not (tmp_path / "elsewhere").exists()
    with pytest.raises(ValueError, match="comes from the run's record"):
        track(tmp_path / "results", "tensorboard")


def test_track_skips_a_run_another_process_holds(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from bench.study.tracking.sync import track
    from tests.test_crash_safety import held_by_another_process
    from tests.test_tracking import fake_run

    run = fake_run(tmp_path / "results" / "r")
    with held_by_another_process(run.path, "commbench run --resume"):
        assert track(tmp_path / "results", "tensorboard", [f"dir={tmp_path / 'tb'}"]) == 1
    assert "r: not sent: run directory" in capsys.readouterr().err
    assert not run.tracking.exists()


def test_a_report_never_writes_through_a_link_in_its_directory(tmp_path, capsys):
    sweep_dir, sweep = _sweep(tmp_path / "results", "s")
    for seed in (0, 1):
        write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0)
    _save(sweep_dir, sweep)
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "report"
    out.mkdir()
    (out / "figures").symlink_to(outside)
    code = main(["report", str(tmp_path / "results"), "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and f"{out}/figures is a symbolic link" in err, err
    assert list(outside.iterdir()) == []
    # the library's own writes replace a link, never follow it
    (out / "figures").unlink()
    (out / "report.md").symlink_to(outside / "victim.md")
    build_report(sweep_dir, out)
    assert list(outside.iterdir()) == [] and not (out / "report.md").is_symlink()
