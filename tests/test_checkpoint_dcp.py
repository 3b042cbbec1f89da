"""Checkpoints through torch.distributed.checkpoint (bench/run/dcp_state.py, issue 46):
a 4-rank FSDP DiLoCo run resumed bit-exact (and refused on 2 ranks), DDP written on 4 ranks
resumed on 2 (the same global batch), a replicated tensor written once, an unfinished
save never resumed from, and the launcher's layout rule (`layout_change_problem`).

Real gloo groups through the real loop (bench.run.train.Trainer), tiny configs, few steps.
"""

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from bench.config import load_config
from bench.run import checkpoint, dcp_state
from bench.run.records import RunDir
from tests.distributed import run_distributed
from tests.helpers import assert_same_params, params_of
from tests.local_updates import make_trainer

DILOCO = "configs/diloco-tiny.yaml"
DDP = "configs/ddp-tiny.yaml"
FSDP_DILOCO = ["run.steps=8", "strategy.inner_steps=4", "checkpoint.every=6",
               "parallel.group_size=2", "parallel.shard=fsdp"]


def saved_tensors(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors whose key starts with `prefix`, read in this process."""
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
           if k.startswith(prefix)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, storage_reader=FileSystemReader(path), no_dist=True)
    return out


@contextlib.contextmanager
def resuming():
    """As `commbench run --resume` tells the ranks (bench/run/checkpoint.py)."""
    os.environ["COMMBENCH_RESUME"] = "1"
    try:
        yield
    finally:
        del os.environ["COMMBENCH_RESUME"]


def _fsdp_diloco(rank, world_size, root):
    from algorithms.shard import local

    straight = make_trainer(world_size, DILOCO, FSDP_DILOCO, root)
    straight.run()
    mine = straight.strategy.sharded.local_state()
    theta = [local(g).clone() for g in straight.strategy.outer.global_params]
    straight.strategy.close()
    with resuming():
        again = make_trainer(world_size, DILOCO, FSDP_DILOCO, root)
        again.run()
    return {"straight": mine, "resumed": again.strategy.sharded.local_state(),
            "theta": theta,
            "theta_resumed": [local(g).clone() for g in again.strategy.outer.global_params]}


def _refused_on_two(rank, world_size, root):
    with resuming():
        trainer = make_trainer(world_size, DILOCO, FSDP_DILOCO, root)
        try:
            trainer.run()
        except RuntimeError as err:
            return str(err)
    return None


@pytest.mark.timeout(400)
def test_fsdp_diloco_on_4_ranks_resumes_bit_exact_and_refuses_2_ranks(tmp_path):
    """Checkpoint mid-round (step 6 of H = 4 rounds); the resumed run ends with the
    straight run's shards and global θ bit for bit. The global θ's shards are written once
    per shard position (2 replicas hold each), the inner state once per rank. Resuming it
    on 2 ranks is refused before any training, naming both layouts."""
    results = run_distributed(_fsdp_diloco, 4, str(tmp_path), timeout=360)
    for r in results:
        assert_same_params(r["resumed"], r["straight"], atol=0, rtol=0)
        for a, b in zip(r["theta_resumed"], r["theta"], strict=True):
            assert torch.equal(a, b)
    path, info = dcp_state.latest(RunDir(tmp_path))
    assert info["step"] == 6 and info["world_size"] == 4 and info["replicated"] is False
    storage = FileSystemReader(path).read_metadata().storage_data
    theta = [i.fqn for i in storage if "/strategy.outer." in i.fqn and "global_params" in i.fqn]
    assert theta and {f.split("/")[0] for f in theta} == {"shard@0", "shard@1"}
    assert len(theta) == len(set(theta))  # each (shard, tensor) once, not once per replica
    inner = {i.fqn.split("/")[0] for i in storage if "/strategy.model." in i.fqn}
    assert inner == {"rank0", "rank1", "rank2", "rank3"}  # inner shards differ per replica

    errors = run_distributed(_refused_on_two, 2, str(tmp_path), timeout=120)
    for error in errors:
        assert error and "DiLoCo on 4 ranks" in error and "DiLoCo on 2 ranks" in error
        assert "replicated on every rank" in error
    assert dcp_state.latest(RunDir(tmp_path))[1]["step"] == 6  # nothing was overwritten


# ------------------------------------------------------------- DDP: 4 ranks, then 2

DDP_RUN = ["run.steps=6", "checkpoint.every=3", "run.log_every=3", "model.dropout=0.0"]


def _ddp_on_four(rank, world_size, root):
    trainer = make_trainer(world_size, DDP, [*DDP_RUN, "data.batch_size=2"], root)
    trainer.run()
    return params_of(trainer.strategy.eval_model())


def _ddp_on_two(rank, world_size, root):
    with resuming():  # what the loop restores, looked at before any step
        trainer = make_trainer(world_size, DDP, [*DDP_RUN, "data.batch_size=4"], root)
        saved = checkpoint.load_state(trainer.records, rank, trainer.strategy, trainer.ledger,
                                      trainer.checkpoint_group)
        loaded = {"model": params_of(trainer.strategy.model),
                  "optimizer": trainer.strategy.optimizer.state_dict()}
        trainer.strategy.close()
        trainer2 = make_trainer(world_size, DDP, [*DDP_RUN, "data.batch_size=4"], root)
        summary = trainer2.run()
    return {"loop_step": saved["step"], "loaded": loaded, "summary": summary,
            "params": params_of(trainer2.strategy.eval_model())}


@pytest.mark.timeout(400)
def test_ddp_written_on_4_ranks_resumes_on_2_with_the_same_global_batch(tmp_path):
    """DDP's state is replicated: written once (total size about one copy, not four),
    loaded by 2 ranks (model and optimizer state equal the saved ones bit for bit), and
    the run continues: with data.batch_size 2 -> 4 the global batch (8) and so every
    step's samples are the same, and it ends where the 4-rank run ended (DDP's identity,
    to fp tolerance). An unfinished save (no complete.json) is never resumed from."""
    root = tmp_path / "run"
    straight = run_distributed(_ddp_on_four, 4, str(root), timeout=240)
    run = RunDir(root)
    path, info = dcp_state.latest(run)
    assert info["step"] == 3 and info["replicated"] is True
    assert info["layout"]["global_batch"] == 8
    # written once: every model/optimizer tensor under "world", one storage entry each
    storage = FileSystemReader(path).read_metadata().storage_data
    world = [i.fqn for i in storage if i.fqn.startswith("world/")]
    assert len(world) == len(set(world)) and world
    model = saved_tensors(path, "world/strategy.model.")
    one_copy = sum(t.numel() * t.element_size() for t in model.values())
    written = sum(f.stat().st_size for f in path.glob("*.distcp"))
    # model + AdamW's two moments (+ the ranks' own RNG, ledger: small) ~ 3 copies of θ;
    # every rank writing its own would be 12 (DCP adds ~1.5 kB per item)
    assert 3 * one_copy <= written < 5 * one_copy, (written, one_copy)
    # an unfinished later save (a crash mid-write): ignored, and removed by the resume
    partial = run.state_dir(5)
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"partial")
    no_marker = run.state_dir(4)
    no_marker.mkdir()
    (no_marker / ".metadata").write_bytes(b"x")
    assert checkpoint.verify_states(run, 2) == 3
    # two ranks' files swapped (in a copy): refused naming a file, whatever lies at the
    # offsets the metadata name (another rank's skeleton, or no tensor at all)
    swapped = tmp_path / "swapped"
    shutil.copytree(path, swapped)
    (swapped / "__0_0.distcp").rename(swapped / "was0")
    (swapped / "__1_0.distcp").rename(swapped / "__0_0.distcp")
    (swapped / "was0").rename(swapped / "__1_0.distcp")
    with pytest.raises(ValueError, match=r"swapped/__[01]_0.distcp (is corrupt|is trunc|holds "
                                         r"rank [01]'s state of step 3)"):
        dcp_state.check(swapped, info, 2)
    checkpoint.adopt_states(run, 2, 3)
    assert [p for _, p in run.state_dirs()] == [path]

    results = run_distributed(_ddp_on_two, 2, str(root), timeout=240)
    saved_model = {k.removeprefix("world/strategy.model."): v for k, v in model.items()}
    saved_model = {k: saved_model[k] for k in results[0]["loaded"]["model"]}
    saved_opt = saved_tensors(path, "world/strategy.optimizer.state.")
    for r in results:
        assert r["loop_step"] == 3
        assert_same_params(r["loaded"]["model"], saved_model, atol=0, rtol=0)
        for index, state in r["loaded"]["optimizer"]["state"].items():
            for name, value in state.items():
                assert torch.equal(value, saved_opt[
                    f"world/strategy.optimizer.state.{index}.{name}"])
        assert r["summary"]["status"] == "ok" and r["summary"]["steps"] == 6
        assert_same_params(r["params"], straight[0], atol=1e-5, rtol=1e-4)
    assert results[0]["params"].keys() == straight[0].keys()


# ------------------------------------------------------------- no processes


def test_the_launcher_layout_rule_allows_ddp_with_the_global_batch_kept():
    base = load_config(DDP)
    same = load_config(DDP, ["parallel.world_size=2", "data.batch_size=16"])
    assert checkpoint.layout_change_problem(base, base) is None
    assert checkpoint.layout_change_problem(base, same) is None
    other = load_config(DDP, ["parallel.world_size=2"])
    problem = checkpoint.layout_change_problem(base, other)
    assert "global batch must stay 32" in problem and "ddp on 4 ranks" in problem
    assert "ddp on 2 ranks" in problem and "data.batch_size to 32 / parallel.world_size" in problem
    sharded = load_config(DDP, ["parallel.shard=fsdp"])
    problem = checkpoint.layout_change_problem(
        sharded, load_config(DDP, ["parallel.shard=fsdp", "parallel.world_size=2",
                                   "data.batch_size=16"]))
    assert "only DDP with strategy.backend torch, parallel.shard none" in problem
    diloco = load_config(DILOCO)
    problem = checkpoint.layout_change_problem(
        diloco, load_config(DILOCO, ["parallel.world_size=2"]))
    assert "parallel.world_size differ" in problem and "diloco on 4 ranks" in problem


def test_the_ranks_layout_rule_names_both_layouts():
    ddp4 = {"strategy": "DDP", "world_size": 4, "group_size": 1, "num_stages": 1,
            "shard": "none", "global_batch": 8}
    ddp2 = {**ddp4, "world_size": 2}
    assert dcp_state.layout_problem(ddp4, ddp4, False, False) is None
    assert dcp_state.layout_problem(ddp4, ddp2, True, True) is None
    problem = dcp_state.layout_problem(ddp4, {**ddp2, "global_batch": 4}, True, True)
    assert "DDP on 4 ranks" in problem and "DDP on 2 ranks" in problem
    assert "global batch differs" in problem
    assert "per replica" in dcp_state.layout_problem(ddp4, ddp2, False, True)


def test_a_world_size_change_of_a_per_rank_state_is_refused_before_launch(tmp_path):
    """verify_states (the launcher's check) refuses from complete.json alone, before it
    reads the DCP files (here not even a valid .metadata)."""
    run = RunDir(tmp_path)
    path = run.state_dir(6)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")
    layout = {"strategy": "DiLoCo", "world_size": 4, "group_size": 2, "num_stages": 1,
              "shard": "fsdp", "global_batch": 32}
    (path / "complete.json").write_text(json.dumps(
        {"step": 6, "world_size": 4, "layout": layout, "replicated": False}))
    with pytest.raises(ValueError, match="DiLoCo on 4 ranks .* not 2 ranks"):
        checkpoint.verify_states(run, 2)
    with pytest.raises(ValueError, match=r"state-step6/.metadata is corrupt or truncated"):
        checkpoint.verify_states(run, 4)


def test_a_state_tree_survives_flattening():
    """Tensors out, everything else (int keys, tuple keys, None, tuples) in the skeleton."""
    state = {"a": torch.arange(3), 0: {"x": 1.5, "y": None}, ("p", 1): [torch.ones(2), "s"],
             "t": (1, 2), "nan": float("inf")}
    leaves: dict = {}
    tree = json.loads(json.dumps(dcp_state.flatten(state, "k", leaves)))
    assert sorted(leaves) == ["k.('p', 1).0", "k.a"]
    back = dcp_state.unflatten(tree, leaves, None)
    assert back.keys() == state.keys() and back["t"] == (1, 2) and back[0] == state[0]
    assert torch.equal(back["a"], state["a"]) and back[("p", 1)][1] == "s"
    with pytest.raises(TypeError, match="k.bad holds a set"):
        dcp_state.flatten({"bad": {1}}, "k", {})
