"""The optimizer component (bench/optim.py): config checks, groups by module type, factory.

    pytest tests/test_optim.py
"""

from pathlib import Path

import pytest
import pytorch_optimizer
import torch
from torch import nn

from algorithms.base import set_lr
from algorithms.delay import DelayedOptimizer
from bench.config import describe, load_config
from bench.config.schema import OptimConfig
from bench.model import GPT, gpt_config, hidden_matrices
from bench.optim import (
    ChainedOptimizer,
    describe_optimizer,
    lr_at,
    make_optimizer_factory,
)
from bench.run.records import RunDir
from bench.run.train import Trainer
from tests.distributed import run_distributed
from tests.helpers import assert_bad_config, assert_same_params, max_change, params_of

SEQ = 16


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(gpt_config("tiny", 256, SEQ))


def old_factory(cfg):
    """The factory as bench/run/train.py had it before optimizers became a component."""
    o = cfg.optim

    def make(module):
        params = [p for p in module.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        if o.name == "adamw":
            return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas)
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum)

    return make


def train_steps(model, optimizer, cfg, batches, grad_clip=0.0):
    for step, (x, y) in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg) * group.get("lr_scale", 1.0)
        optimizer.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()


# ------------------------------------------------------------------ delay 0 == today


TODAY = [[], ["optim.name=sgd", "optim.momentum=0.9", "optim.lr=0.1"]]
DELAYED = ["optim.name=sgd", "optim.lr=0.1", "optim.delay=1", "optim.delay_correction=ef",
           "optim.grad_clip=0.5"]


def loop_against_reference(rank, world_size, runs, base_dir):
    """Per (overrides, reference factory): the real loop on one rank, and the same steps in
    plain torch. One launch for all (process start-up is the slow part)."""
    results = []
    for i, (overrides, reference_factory) in enumerate(runs):
        cfg = load_config("configs/ddp-tiny.yaml", [
            "parallel.world_size=1", "run.steps=4", "run.log_every=2", "run.val_every=0",
            "run.val_sequences=2", "model.seq_len=32", "data.batch_size=2",
            "checkpoint.final=false", *overrides])
        run_dir = Path(base_dir) / f"run{i}"
        run_dir.mkdir(parents=True)
        trainer = Trainer(cfg, run_dir, torch.device("cpu"), "gloo")
        model = GPT(trainer.strategy.model.cfg)
        model.load_state_dict(trainer.strategy.model.state_dict())
        start = params_of(model)
        trainer.run()
        batches = [trainer.stream.batch(step) for step in range(cfg.run.steps)]
        train_steps(model, reference_factory(cfg)(model), cfg, batches, cfg.optim.grad_clip)
        results.append((params_of(trainer.strategy.model), params_of(model), start))
    return results


def test_loop_delay_0_is_todays_training_and_delay_1_clips_before_storing(tmp_path):
    """delay 0: the loop == the old factory bit-exactly. delay 1 (+ EF): the loop (clip,
    then the wrapper's step) == the wrapper driven by hand with the fresh gradient clipped."""
    runs = [(overrides, old_factory) for overrides in TODAY]
    runs.append((DELAYED, make_optimizer_factory))
    results = run_distributed(loop_against_reference, 1, runs, str(tmp_path), timeout=180)[0]
    for loop, reference, start in results:
        assert max_change(loop, start) > 1e-4
        assert_same_params(loop, reference, atol=0, rtol=0)
    # the delayed run's metrics rows (steps 2 and 4) carry the wrapper's diagnostics
    rows = [r for r in RunDir(tmp_path / f"run{len(TODAY)}").read_metrics() if "loss" in r]
    assert [r["step"] for r in rows] == [2, 4]
    for row in rows:
        assert row["update_norm"] > 0 and row["stale_grad_diff_norm"] > 0
    plain = [r for r in RunDir(tmp_path / "run0").read_metrics() if "loss" in r]
    assert plain and all("update_norm" not in r for r in plain)


def test_factory_returns_plain_torch_optimizers_without_delay():
    for name, kind in (("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD)):
        optimizer = make_optimizer_factory(load_config(None, [f"optim.name={name}"]))(tiny_gpt())
        assert type(optimizer) is kind


# ---------------------------------------------------------------------------- muon


def block_linear_weights(model: GPT) -> set[int]:
    return {id(m.weight) for block in model.blocks
            for m in (block.attn.qkv, block.attn.proj, block.mlp.fc, block.mlp.proj)}


def test_muon_holds_exactly_the_hidden_matrices():
    model = tiny_gpt()
    optimizer = make_optimizer_factory(load_config(None, ["optim.name=muon"]))(model)
    assert isinstance(optimizer, ChainedOptimizer)
    muon, adamw = optimizer.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    muon_ids = {id(p) for g in muon.param_groups for p in g["params"]}
    adamw_ids = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert muon_ids == block_linear_weights(model)
    assert len(muon_ids) == 4 * model.cfg.n_layer
    assert adamw_ids == {id(p) for p in model.parameters()} - muon_ids
    assert id(model.embed.wte.weight) in adamw_ids  # embedding = tied head: AdamW


def test_muon_split_works_on_one_pipeline_stage():
    model = tiny_gpt()
    layers = model.as_layers()
    stage = nn.Sequential(layers[1])  # one Block, as a pipeline stage holds it
    assert {id(p) for p in hidden_matrices(stage)} == {
        id(m.weight) for m in (layers[1].attn.qkv, layers[1].attn.proj, layers[1].mlp.fc,
                               layers[1].mlp.proj)}
    last = nn.Sequential(layers[-2], layers[-1])  # the last Block and the head
    assert len(hidden_matrices(last)) == 4


@pytest.mark.parametrize("module", [
    nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)),  # a Linear outside any Block
    tiny_gpt().as_layers()[-1],  # the head stage: tied embedding and a LayerNorm
])
def test_muon_without_hidden_matrices_is_a_clear_error(module):
    make = make_optimizer_factory(load_config(None, ["optim.name=muon"]))
    with pytest.raises(ValueError, match="needs 2-D hidden matrices"):
        make(module)


def test_muon_lr_follows_the_schedule_scaled_by_muon_lr():
    cfg = load_config(None, ["optim.name=muon", "optim.lr=0.002", "optim.muon_lr=0.02"])
    optimizer = make_optimizer_factory(cfg)(tiny_gpt())
    muon_group = optimizer.optimizers[0].param_groups[0]
    assert muon_group["lr"] == pytest.approx(0.02)
    set_lr(optimizer, 0.001)  # what every strategy's set_lr does with the schedule's lr
    assert muon_group["lr"] == pytest.approx(0.01)
    assert optimizer.optimizers[1].param_groups[0]["lr"] == pytest.approx(0.001)


# --------------------------------------------------------------- package optimizers


@pytest.mark.parametrize("name, kind", [("lion", pytorch_optimizer.Lion),
                                        ("adan", pytorch_optimizer.Adan),
                                        ("soap", pytorch_optimizer.SOAP)])
def test_package_optimizers_build_and_train(name, kind):
    cfg = load_config(None, [f"optim.name={name}", "optim.delay=1", "run.steps=3"])
    model = tiny_gpt()
    start = params_of(model)
    optimizer = make_optimizer_factory(cfg)(model)
    assert isinstance(optimizer, DelayedOptimizer) and isinstance(optimizer.optimizer, kind)
    x = torch.randint(0, 256, (2, SEQ))
    train_steps(model, optimizer, cfg, [(x, x)] * 3)
    assert max_change(params_of(model), start) > 0
    info = describe_optimizer(optimizer, cfg)
    assert info["optimizers"] == [kind.__name__] and info["delay"] == 1
    assert info["delayed_by"] == "emulation"


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize("override, message", [
    (["optim.delay=2"], "optim.delay must be 0 (synchronous) or 1 (one-step delay), got 2"),
    (["optim.delay_correction=ef"], "delays nothing: set optim.delay=1"),
    (["optim.delay_correction=predict", "strategy.name=pipedream-2bw", "strategy.delay=0",
      "parallel.world_size=2", "parallel.num_stages=2"], "delays nothing"),
    (["optim.name=adam"], "optim.name must be one of ['adamw', 'sgd', 'muon', 'lion', 'adan'"),
    (["optim.delay=1", "optim.delay_correction=feedback"],
     "optim.delay_correction must be one of ['none', 'ef', 'predict'], got 'feedback'"),
    (["optim.muon_lr=0"], "optim.muon_lr must be > 0, got 0.0"),
])
def test_bad_optim_config_names_key_value_and_valid_choices(override, message):
    assert_bad_config(None, override, message)


def test_direct_construction_is_checked_too():
    with pytest.raises(ValueError, match="optim.name must be one of"):
        OptimConfig(name="adagrad")


def test_config_show_documents_the_new_fields():
    text = describe(load_config(None, ["optim.delay=1", "optim.delay_correction=ef"]))
    assert "delay_correction: ef  # Correction of a delayed update" in text
    assert "RECONSTRUCTION" in text


# ------------------------------------------------------------------- data parallel


def ddp_delayed_against_one_process(rank, world_size, base_dir):
    """DDP on 2 ranks with delay 1 + EF (AdamW), and one process on both ranks' batches."""
    import torch.distributed as dist

    cfg = load_config("configs/ddp-tiny.yaml", [
        f"parallel.world_size={world_size}", "run.steps=4", "run.log_every=2",
        "run.val_every=0", "run.val_sequences=2", "model.seq_len=32", "data.batch_size=2",
        "checkpoint.final=false", "optim.delay=1",
        "optim.delay_correction=ef"])
    run_dir = Path(base_dir) / "ddp"
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, run_dir, torch.device("cpu"), "gloo")
    model = GPT(trainer.strategy.model.cfg)
    model.load_state_dict(trainer.strategy.model.state_dict())
    start = params_of(model)
    trainer.run()
    shards = [None] * world_size
    dist.all_gather_object(shards, [trainer.stream.batch(s) for s in range(cfg.run.steps)])
    batches = [tuple(torch.cat([shard[s][i] for shard in shards]) for i in range(2))
               for s in range(cfg.run.steps)]
    train_steps(model, make_optimizer_factory(cfg)(model), cfg, batches, cfg.optim.grad_clip)
    return params_of(trainer.strategy.model), params_of(model), start


def test_delay_works_data_parallel(tmp_path):
    """The mean of the ranks' gradients is what the delay stores: 2-rank DDP == one process
    on the concatenated batch (equal shards), to fp tolerance. (AdamW: Muon orthogonalises in
    bf16, which turns fp32 rounding differences into bf16-sized ones.)"""
    results = run_distributed(ddp_delayed_against_one_process, 2, str(tmp_path), timeout=180)
    loop, reference, start = results[0]
    assert max_change(loop, start) > 1e-4
    assert_same_params(loop, reference, atol=1e-5, rtol=1e-4)
