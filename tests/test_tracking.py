"""Tracking sinks (bench/study/tracking/): what TensorBoard, MLflow and W&B hold, read back with
each library's own reader and compared with metrics.jsonl; backfill is idempotent; a
failing sink warns once and never fails the run; `tensorboard --logdir` serves the runs."""

import glob
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from bench.config import config_hash, load_config
from bench.config.schema import TensorBoardConfig
from bench.run.files import write_json
from bench.run.records import RunDir
from bench.run.summary import train_row, val_row
from bench.study.tracking.sinks import make_sink
from bench.study.tracking.sync import row_series, sync_run, track
from tests.fakes import make_summary, write_fake_run

REPO = Path(__file__).resolve().parent.parent
PROFILES = {"nvlink": 0.05, "wan-1g": 0.5}
STARTED = "2026-11-24T05:00:00+0000"


def fake_run(path: Path, seed: int = 0, steps: int = 20, started: str = STARTED,
             resumed_from_step: int | None = None, eval: bool = True) -> RunDir:
    """A finished run's records: a training row every 5 steps, validation every 10."""
    rows = []
    for step in range(5, steps + 1, 5):
        clock = {p: step * s for p, s in PROFILES.items()}
        rows.append(train_row(step, step * 2048, step * 0.1, clock, lr=1e-3,
                              loss=5.0 - step * 0.05 + seed * 0.01, step_s=0.1 + seed * 0.01,
                              compute_s=0.08, comm_s=0.02 + seed * 0.01, comm_bytes=1e6,
                              consensus=0.5 / step))
        if step % 10 == 0:
            rows.append(val_row(step, step * 2048, step * 0.1, clock,
                                val_loss=4.9 - step * 0.04 + seed * 0.01, extra={"worker0": 4.8}))
    summary = make_summary(status="ok", run_name="ddp", strategy="ddp", world_size=2,
                           steps=steps, total_tokens=steps * 2048, wall_s=steps * 0.1,
                           comm_s_total=steps * 0.02, comm_bytes_total=steps * 1_000_000,
                           final_val_loss=4.1, projected={"nvlink": 1.0, "wan-1g": 10.0},
                           eval={"lambada/acc": 0.25} if eval else None)
    summary.update(started=started, config_hash=f"{seed:012d}")
    if resumed_from_step is not None:
        summary["resumed_from_step"] = resumed_from_step
    config = {"run": {"name": "ddp", "seed": seed, "steps": steps},
              "strategy": {"name": "ddp"}, "optim": {"betas": [0.9, 0.95]}}
    run = write_fake_run(path, config, rows, summary)
    write_json(run.env, {"host": "node1", "git": {"commit": "abc123", "dirty": False},
                         "packages": {"torch": "2.13.0"}})
    return run


def fake_sweep(root: Path, name: str = "sw", seeds=(0, 1)) -> list[RunDir]:
    runs = [fake_run(root / name / f"ddp-{s:012d}", seed=s) for s in seeds]
    write_json(root / name / "sweep.json", {"name": name, "runs": {
        f"{s:012d}": {"dir": f"ddp-{s:012d}", "variant": "ddp", "seed": s, "label": "ddp",
                      "point": {}} for s in seeds}})
    return runs


def expected_series(run: RunDir) -> dict[str, dict[int, float]]:
    """{series: {step: value}} spelled out from metrics.jsonl (independently of the sinks'
    code): every number of a row under train/ or val/, the clocks per profile, comm share."""
    out: dict[str, dict[int, float]] = {}
    for row in run.read_metrics():
        kind = "val" if "val_loss" in row else "train"
        for key, value in row.items():
            if key == "step":
                continue
            items = value.items() if isinstance(value, dict) else [(None, value)]
            for sub, v in items:
                name = f"{kind}/{key}" + (f"/{sub}" if sub else "")
                out.setdefault(name, {})[row["step"]] = v
        if kind == "train":
            out.setdefault("train/comm_share", {})[row["step"]] = row["comm_s"] / row["step_s"]
    return out


def test_row_series_names_every_number_of_a_row():
    row = train_row(5, 100, 1.0, {"nvlink": 0.5}, lr=1e-3, loss=2.0, step_s=0.2,
                    compute_s=0.15, comm_s=0.05, comm_bytes=10.0, consensus=0.1)
    kind, series = row_series(row)
    assert kind == "train"
    assert series == {"train/tokens": 100, "train/elapsed_s": 1.0, "train/lr": 1e-3,
                      "train/loss": 2.0, "train/step_s": 0.2, "train/compute_s": 0.15,
                      "train/comm_s": 0.05, "train/comm_bytes": 10.0, "train/consensus": 0.1,
                      "train/projected_elapsed_s/nvlink": 0.5, "train/comm_share": 0.25}
    kind, series = row_series(val_row(5, 100, 1.0, {"nvlink": 0.5}, 3.0, {"worker0": 3.1}))
    assert kind == "val" and series["val/val_loss"] == 3.0 and series["val/val_loss_worker0"] == 3.1


# ------------------------------------------------------------------------------ config


def test_tracking_section_parses_validates_and_is_not_the_runs_identity():
    cfg = load_config("configs/ddp-tiny.yaml", ["tracking.tensorboard.dir=tb",
                                                "tracking.wandb.mode=offline"])
    assert cfg.tracking.tensorboard.dir == "tb" and cfg.tracking.wandb.project == "commbench"
    assert cfg.tracking.mlflow is None
    assert set(cfg.tracking.sinks()) == {"tensorboard", "wandb"}
    assert config_hash(cfg) == config_hash(load_config("configs/ddp-tiny.yaml"))
    for overrides, message in [
        (["tracking.poll_s=0"], "tracking.poll_s must be > 0 seconds, got 0"),
        (["tracking.wandb.mode=cloud"], "tracking.wandb.mode must be one of ['online', "
                                        "'offline']"),
        (["tracking.tensorboard.dirr=tb"], "did you mean 'dir'"),
        (["tracking.mlflow.experiment= "], "tracking.mlflow.experiment must be an MLflow"),
    ]:
        with pytest.raises(ValueError) as err:
            load_config("configs/ddp-tiny.yaml", overrides)
        assert message in str(err.value), str(err.value)


# ----------------------------------------------------------------- read back: each sink


def tensorboard_scalars(path: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def assert_series(got: dict[str, dict[int, float]], run: RunDir, rel: float = 0.0) -> None:
    want = expected_series(run)
    assert want.keys() <= got.keys(), sorted(want.keys() - got.keys())
    for name, points in want.items():
        assert got[name].keys() == points.keys(), name
        for step, value in points.items():
            assert got[name][step] == pytest.approx(value, rel=rel, abs=0), (name, step)


def test_tensorboard_holds_the_records_and_a_second_backfill_writes_nothing(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    run = fake_run(tmp_path / "results" / "ddp-000000000000")
    tb = tmp_path / "tb"
    assert track(tmp_path / "results", "tensorboard", [f"dir={tb}"]) == 0
    assert "tensorboard: 6 rows, summary, eval" in capsys.readouterr().out
    scalars = tensorboard_scalars(tb / run.path.name)
    assert_series(scalars, run, rel=1e-6)  # event files hold float32
    assert scalars["summary/wall_s"] == {20: pytest.approx(2.0)}
    assert scalars["summary/projected/wan-1g/total_s"] == {20: pytest.approx(10.0)}
    assert scalars["eval/lambada/acc"] == {20: pytest.approx(0.25)}
    files = sorted(tb.rglob("*"))

    assert track(tmp_path / "results", "tensorboard", [f"dir={tb}"]) == 0
    assert "tensorboard: up to date" in capsys.readouterr().out
    assert sorted(tb.rglob("*")) == files  # not even an empty event file


def test_mlflow_holds_the_records_with_config_and_env_and_sweep_parent(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    runs = fake_sweep(tmp_path / "results")
    uri = (tmp_path / "mlruns").as_uri()
    assert track(tmp_path / "results", "mlflow", [f"tracking_uri={uri}",
                                                  "experiment=exp"]) == 0
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("exp").experiment_id
    found = {r.info.run_name: r for r in client.search_runs([experiment])}
    assert set(found) == {"sw", "ddp-000000000000", "ddp-000000000001"}
    parent = found["sw"].info.run_id
    for run in runs:
        mlrun = found[run.path.name]
        assert mlrun.data.tags["mlflow.parentRunId"] == parent
        assert mlrun.data.tags["env.git.commit"] == "abc123"
        assert mlrun.data.tags["commbench.status"] == "ok"
        assert mlrun.info.status == "FINISHED"
        assert mlrun.data.params["run.seed"] == str(int(run.path.name.split("-")[1]))
        assert mlrun.data.params["optim.betas"] == "[0.9, 0.95]"
        got = {name: {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id,
                                                                          name)}
               for name in expected_series(run)}
        assert_series(got, run)  # exact: MLflow keeps float64
        assert mlrun.data.metrics["eval/lambada/acc"] == 0.25
    before = len(client.search_runs([experiment]))
    assert track(tmp_path / "results", "mlflow", [f"tracking_uri={uri}",
                                                  "experiment=exp"]) == 0
    assert len(client.search_runs([experiment])) == before
    for run in runs:  # not one metric point more
        history = client.get_metric_history(found[run.path.name].info.run_id, "train/loss")
        assert len(history) == 4


def wandb_records(run_dir: str):
    """The records of W&B's offline run files (the .wandb log format: a 7-byte header, then
    LevelDB-style 32 KiB blocks of chunks, each a slice of one protobuf Record)."""
    from wandb.proto import wandb_internal_pb2

    for path in sorted(glob.glob(os.path.join(run_dir, "run-*.wandb"))):
        data, pos, buffer = Path(path).read_bytes(), 7, b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            if left < 7:
                pos += left
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0:
                pos += left
                continue
            buffer += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL or LAST
                record = wandb_internal_pb2.Record()
                record.ParseFromString(buffer)
                buffer = b""
                yield record


def wandb_offline_run(wandb_dir: Path, run_id: str):
    """(the run record, {series: {step: value}}, summary) over every offline file of run_id."""
    history: dict[str, dict[int, float]] = {}
    summary, header = {}, None
    for run_dir in sorted(wandb_dir.glob(f"wandb/offline-run-*-{run_id}")):
        deadline = time.monotonic() + 30  # W&B's service may still be writing after finish()
        while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(str(run_dir))):
            assert time.monotonic() < deadline, f"{run_dir}: no exit record"
            time.sleep(0.1)
        for record in wandb_records(str(run_dir)):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                header = record.run
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item}
                step = items.pop("_step")
                for name, value in items.items():
                    if not name.startswith("_"):
                        history.setdefault(name, {})[step] = value
            elif kind == "summary":
                for item in record.summary.update:
                    summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return header, history, summary


def test_wandb_offline_files_hold_the_records_grouped_by_sweep(tmp_path):
    pytest.importorskip("wandb")
    runs = fake_sweep(tmp_path / "results")
    wb = tmp_path / "wb"
    settings = ["mode=offline", f"dir={wb}", "project=proj", "tags=[smoke]"]
    assert track(tmp_path / "results", "wandb", settings) == 0
    for run in runs:
        run_id = json.loads(run.tracking.read_text())["wandb:/proj"]["handle"]
        header, history, summary = wandb_offline_run(wb, run_id)
        assert header is not None
        assert header.project == "proj" and header.run_group == "sw"
        assert header.display_name == run.path.name and set(header.tags) == {"ddp", "smoke"}
        assert json.loads(header.notes)["git"]["commit"] == "abc123"
        assert_series(history, run)
        assert summary["summary/wall_s"] == 2.0 and summary["eval/lambada/acc"] == 0.25
        assert summary["status"] == "ok"
    offline = sorted(wb.glob("wandb/offline-run-*"))
    assert track(tmp_path / "results", "wandb", settings) == 0
    assert sorted(wb.glob("wandb/offline-run-*")) == offline  # nothing new


# ------------------------------------------------------------------- attempts, resumes


def test_a_resume_continues_the_sink_run_and_a_new_attempt_starts_another(tmp_path):
    pytest.importorskip("tensorboard")
    path = tmp_path / "run-1"
    fake_run(path, steps=10)
    spec = TensorBoardConfig(dir=str(tmp_path / "tb"))
    assert sync_run(path, [make_sink("tensorboard", spec)])[0] == [
        f"tensorboard: 3 rows, summary, eval -> {tmp_path / 'tb' / 'run-1'}"]
    # resumed from step 10 and extended to 20: the same event directory, the new rows only
    fake_run(path, steps=20, started="2026-11-24T06:00:00+0000", resumed_from_step=10)
    lines, failed = sync_run(path, [make_sink("tensorboard", spec)])
    assert lines == [f"tensorboard: 3 rows, summary -> {tmp_path / 'tb' / 'run-1'}"]
    assert tensorboard_scalars(tmp_path / "tb" / "run-1")["train/loss"].keys() == {5, 10, 15, 20}
    # the same run started again from step 0 (a new attempt): a new event directory
    fake_run(path, steps=20, started="2026-11-24T07:00:00+0000")
    lines, failed = sync_run(path, [make_sink("tensorboard", spec)])
    assert lines == [f"tensorboard: 6 rows, summary, eval -> {tmp_path / 'tb' / 'run-1.2'}"]
    assert not failed


# --------------------------------------------------------------------------------- live


def _fake_launcher(tmp_path, rows_seen_live: list, wait_for_live: bool = True):
    """A stand-in for bench.launch.run.run_config: the records a run writes, over time (the
    header, rank 0 replacing metrics.jsonl, rows, the summary), without torchrun."""
    def run_config(cfg, run_dir, progress=True, resume=False):
        run = RunDir(run_dir)
        old = fake_run(tmp_path / "template")  # the rows to write
        run.path.mkdir(parents=True, exist_ok=True)
        run.config.write_text(old.config.read_text())
        write_json(run.summary, {"status": "running", "started": STARTED})
        write_json(run.env, json.loads(old.env.read_text()) | {"host": socket.gethostname()})
        run.write_metrics([])
        rows = old.read_metrics()
        for row in rows[:3]:
            run.append_metrics(row)
        deadline = time.monotonic() + 30
        while wait_for_live and time.monotonic() < deadline:  # the sinks get rows mid-run
            if run.tracking.exists() and json.loads(run.tracking.read_text()) and all(
                    e.get("train", -1) >= 10 for e in json.loads(run.tracking.read_text())
                    .values()):
                rows_seen_live.append(True)
                break
            time.sleep(0.05)
        for row in rows[3:]:
            run.append_metrics(row)
        write_json(run.summary, json.loads(old.summary.read_text()))
        return {**run.read_summary(), "run_dir": str(run.path)}
    return run_config


def test_a_run_is_followed_live_and_its_sinks_hold_all_its_records(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from bench.cli import run_and_evaluate

    live: list = []
    monkeypatch.setattr("bench.launch.run.run_config", _fake_launcher(tmp_path, live))
    cfg = load_config("configs/ddp-tiny.yaml", [f"tracking.tensorboard.dir={tmp_path / 'tb'}",
                                                "tracking.poll_s=0.05"])
    summary = run_and_evaluate(cfg, tmp_path / "results" / "r")
    assert summary["status"] == "ok" and live == [True]
    assert_series(tensorboard_scalars(tmp_path / "tb" / "r"), RunDir(tmp_path / "results" / "r"),
                  rel=1e-6)


def test_failing_sinks_warn_once_and_the_run_finishes_ok(tmp_path, monkeypatch, capfd):
    """An unwritable directory (TensorBoard), a package that is not installed (MLflow), a
    W&B server that cannot be reached (written offline instead): the run ends ok, its
    records complete, one warning each."""
    from bench.cli import run_and_evaluate

    live: list = []
    monkeypatch.setattr("bench.launch.run.run_config", _fake_launcher(tmp_path, live, False))
    for name in ["mlflow", *(m for m in sys.modules if m.startswith("mlflow."))]:
        monkeypatch.setitem(sys.modules, name, None)  # `import mlflow...` raises ImportError
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    overrides = [f"tracking.tensorboard.dir={blocker / 'tb'}", "tracking.poll_s=0.05",
                 f"tracking.mlflow.tracking_uri={tmp_path / 'mlruns'}"]
    if _installed("wandb"):
        overrides += [f"tracking.wandb.dir={tmp_path / 'wb'}", "tracking.wandb.mode=online"]
    cfg = load_config("configs/ddp-tiny.yaml", overrides)
    summary = run_and_evaluate(cfg, tmp_path / "results" / "r")
    assert summary["status"] == "ok"
    assert len(RunDir(tmp_path / "results" / "r").read_metrics()) == 6
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: tracking:")]
    assert sum("tensorboard dropped" in w for w in warnings) == 1, err
    assert sum("mlflow dropped" in w and "not installed" in w for w in warnings) == 1, err
    if _installed("wandb"):
        assert sum("cannot be reached" in w for w in warnings) == 1, err
        assert len(warnings) == 3, err
        assert list((tmp_path / "wb").glob("wandb/offline-run-*"))
    else:
        assert len(warnings) == 2, err


@pytest.mark.timeout(60)
def test_a_hanging_sink_holds_back_neither_the_others_nor_the_run(tmp_path, monkeypatch,
                                                                   capfd):
    """MLflow's server hangs (its `open` never returns): TensorBoard still gets the rows
    live, and the run returns after tracking.timeout_s with one warning."""
    pytest.importorskip("tensorboard")
    from bench.cli import run_and_evaluate
    from bench.study.tracking.sinks import MlflowSink

    release = threading.Event()
    monkeypatch.setattr(MlflowSink, "open", lambda self, run, handle: release.wait(120) or "x")
    live: list = []
    monkeypatch.setattr("bench.launch.run.run_config", _fake_launcher(tmp_path, live))
    cfg = load_config("configs/ddp-tiny.yaml", [
        f"tracking.tensorboard.dir={tmp_path / 'tb'}", "tracking.poll_s=0.05",
        f"tracking.mlflow.tracking_uri={tmp_path / 'mlruns'}", "tracking.timeout_s=1"])
    try:
        summary = run_and_evaluate(cfg, tmp_path / "results" / "r")
        assert not release.is_set()  # returned while MLflow still hangs
    finally:
        release.set()
    assert summary["status"] == "ok" and live == [True]
    assert_series(tensorboard_scalars(tmp_path / "tb" / "r"), RunDir(tmp_path / "results" / "r"),
                  rel=1e-6)
    err = capfd.readouterr().err
    assert err.count("warning: tracking: mlflow did not finish r within tracking.timeout_s=1 s"
                     ) == 1, err


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.mark.timeout(300)
def test_a_real_run_writes_tensorboard_mlflow_and_wandb_as_it_trains(tmp_path, monkeypatch):
    """`commbench run` through torchrun with the three sinks: each holds what
    metrics.jsonl holds (read back with its own reader)."""
    for name in ("tensorboard", "mlflow", "wandb"):
        pytest.importorskip(name)
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store so
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cli", "run", "configs/ddp-tiny.yaml", "--quiet",
         "--set", "parallel.world_size=2", "--set", "run.steps=10", "--set", "run.log_every=5",
         "--set", "run.val_every=5", "--set", "run.val_sequences=16",
         "--set", f"run.output_dir={out}",
         "--set", f"tracking.tensorboard.dir={tmp_path / 'tb'}",
         "--set", f"tracking.mlflow.tracking_uri={tmp_path / 'mlruns'}",
         "--set", "tracking.wandb.mode=offline", "--set", f"tracking.wandb.dir={tmp_path / 'wb'}"],
        capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "warning: tracking" not in proc.stderr, proc.stderr
    (path,) = out.iterdir()
    run = RunDir(path)
    assert_series(tensorboard_scalars(tmp_path / "tb" / path.name), run, rel=1e-6)
    ledger = json.loads(run.tracking.read_text())
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    (mlflow_key,) = [k for k in ledger if k.startswith("mlflow:")]
    run_id = ledger[mlflow_key]["handle"]
    assert_series({name: {m.step: m.value for m in client.get_metric_history(run_id, name)}
                   for name in expected_series(run)}, run)
    _, history, summary = wandb_offline_run(tmp_path / "wb", ledger["wandb:/commbench"]["handle"])
    assert_series(history, run)
    assert summary["summary/steps"] == 10 and summary["status"] == "ok"


# -------------------------------------------------------------------- tensorboard serves


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_scalars(logdir: Path, expected_runs: set[str], timeout_s: float = 90) -> dict:
    """Start `tensorboard --logdir` on localhost; {run: {tag: [(step, value)]}} from its
    scalars endpoints once every expected run is listed."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
                             "--host", "127.0.0.1", "--port", str(port), "--reload_interval",
                             "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}/data/plugin/scalars"
    try:
        deadline = time.monotonic() + timeout_s
        tags: dict = {}
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{base}/tags", timeout=5) as response:
                    tags = json.load(response)
            except OSError:
                pass
            if expected_runs <= set(tags) and all("train/loss" in tags[r] for r in expected_runs):
                break
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.5)
        else:
            raise AssertionError(f"tensorboard listed {sorted(tags)}, not {expected_runs}")
        out = {}
        for run in expected_runs:
            out[run] = {}
            for tag in ("train/loss", "val/val_loss"):
                query = urllib.parse.urlencode({"run": run, "tag": tag})
                with urllib.request.urlopen(f"{base}/scalars?{query}", timeout=5) as response:
                    out[run][tag] = [(step, value) for _, step, value in json.load(response)]
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.timeout(180)
def test_tensorboard_serves_a_backfilled_sweep(tmp_path):
    pytest.importorskip("tensorboard")
    runs = fake_sweep(tmp_path / "results")
    assert track(tmp_path / "results", "tensorboard", [f"dir={tmp_path / 'tb'}"]) == 0
    served = served_scalars(tmp_path / "tb", {f"sw/{r.path.name}" for r in runs})
    for run in runs:
        rows = run.read_metrics()
        got = served[f"sw/{run.path.name}"]
        assert [s for s, _ in got["train/loss"]] == [r["step"] for r in rows if "loss" in r]
        assert [v for _, v in got["train/loss"]] == pytest.approx(
            [r["loss"] for r in rows if "loss" in r], rel=1e-6)
        assert [v for _, v in got["val/val_loss"]] == pytest.approx(
            [r["val_loss"] for r in rows if "val_loss" in r], rel=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sweep_with_tensorboard_is_served_and_its_seeds_compare(tmp_path):
    """The issue's check: `commbench sweep SPEC --set tracking.tensorboard.dir=tb` writes
    event files that `tensorboard --logdir tb` serves; `commbench compare` of its two DDP
    seeds prints the table and writes the figure, of one run with itself exits 0."""
    pytest.importorskip("tensorboard")
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: small\nbase: {REPO / 'configs' / 'ddp-tiny.yaml'}\n"
                    "set: {parallel.world_size: 2, run.steps: 10, run.log_every: 5, "
                    "run.val_every: 5, run.val_sequences: 16}\nseeds: [0, 1]\n"
                    "variants: {ddp: {strategy.name: ddp}}\n")
    tb = tmp_path / "tb"
    proc = subprocess.run([sys.executable, "-m", "bench.cli", "sweep", str(spec), "--no-report",
                           "--output-dir", str(tmp_path / "results"),
                           "--set", f"tracking.tensorboard.dir={tb}"],
                          capture_output=True, text=True, timeout=500, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    run_dirs = sorted(p for p in (tmp_path / "results" / "small").iterdir() if p.is_dir()
                      and not p.name.startswith("_"))
    served = served_scalars(tb, {f"small/{p.name}" for p in run_dirs})
    for path in run_dirs:
        rows = RunDir(path).read_metrics()
        assert [v for _, v in served[f"small/{path.name}"]["train/loss"]] == pytest.approx(
            [r["loss"] for r in rows if "loss" in r], rel=1e-6)
    a, b = (str(p) for p in run_dirs)
    cmp = subprocess.run([sys.executable, "-m", "bench.cli", "compare", a, b, "-o",
                          str(tmp_path / "cmp")], capture_output=True, text=True, cwd=REPO)
    assert cmp.returncode == 0, cmp.stderr
    assert "run.seed: 0 -> 1" in cmp.stdout and "max |Δloss|" in cmp.stdout
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 10_000
    same = subprocess.run([sys.executable, "-m", "bench.cli", "compare", a, a, "--tolerance",
                           "0", "-o", str(tmp_path / "same")], capture_output=True, text=True,
                          cwd=REPO)
    assert same.returncode == 0, same.stdout + same.stderr
    assert json.loads((tmp_path / "same" / "compare.json").read_text())["comparisons"][0][
        "groups"][0]["train_max_abs_delta"] == 0
