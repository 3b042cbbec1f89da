"""Pipelines: partitioning, identities on real gloo ranks, ledger bytes, versions, errors.

Run with `pytest tests/test_pipeline.py`. The strategies are driven directly (not through
bench.train, which they join at integration): a small GPT (4 blocks) is built from the
same seed on every rank, each step's global batch is drawn from a step-keyed generator,
and replica r takes its rows, so every run sees the same tokens in the same order.
Parameters are compared after >= 3 steps (CPU, fp32).
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from algorithms.comm import Communicator
from algorithms.partition import split_layers, stage_bounds
from algorithms.pipedream import PipeDream2BW, PipeDreamConfig
from algorithms.pipeline import Pipeline, PipelineConfig
from algorithms.pipeline_base import PipelineSetup, lm_loss
from bench.config import Config, DataConfig, ModelConfig, ParallelConfig
from bench.model import GPT, GPTConfig, configure_optimizer_groups
from tests.distributed import run_distributed
from tests.helpers import assert_same_params, max_change

VOCAB, SEQ, WIDTH, LAYERS = 64, 8, 32, 4
LR = 1e-2


def make_model(seed: int = 0, n_layer: int = LAYERS) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=n_layer, n_head=2,
                         n_embd=WIDTH))


def make_optimizer(module):
    return torch.optim.AdamW(configure_optimizer_groups(module, 0.1), lr=LR)


def global_batch(step: int, size: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def full_state(model: GPT) -> dict:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


# ---------------------------------------------------------------------- references


def one_process(steps: int, batch: int, microbatches: int, delay: int = 0) -> dict:
    """Gradient accumulation in one process; `delay=1` applies each step's gradient a
    step late (our hand-written one-step-delay loop: step 0 applies nothing)."""
    model = make_model()
    opt = make_optimizer(model)
    previous = None
    for step in range(steps):
        x, y = global_batch(step, batch)
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
            (model(xm, ym)[1] / microbatches).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.zero_grad(set_to_none=True)
        apply = grads if delay == 0 else previous
        previous = grads
        if apply is not None:
            for p, g in zip(model.parameters(), apply, strict=True):
                p.grad = g
            opt.step()
            opt.zero_grad(set_to_none=True)
    return full_state(model)


# ---------------------------------------------------------------------- distributed runs


def build(rank, world, kind, config_kwargs, num_stages, rank_batch, microbatches,
          model_seed=0, grad_clip=0.0):
    comm = Communicator(rank, world, "cpu")
    setup = PipelineSetup(model=make_model(model_seed), comm=comm, make_optimizer=make_optimizer,
                          total_steps=10, grad_clip=grad_clip, rank_batch_size=rank_batch,
                          num_microbatches=microbatches, num_stages=num_stages, loss_fn=lm_loss)
    cls, config_cls = (Pipeline, PipelineConfig) if kind == "pipeline" else \
        (PipeDream2BW, PipeDreamConfig)
    return cls(config_cls(**config_kwargs), setup)


def train(strategy, first_step, steps, rank_batch):
    losses = []
    for step in range(first_step, first_step + steps):
        strategy.comm.step = step
        x, y = global_batch(step, rank_batch * strategy.grid.num_replicas)
        rows = slice(strategy.grid.replica * rank_batch, (strategy.grid.replica + 1) * rank_batch)
        losses.append(strategy.train_step((x[rows], y[rows])).loss)
    return losses


def _run(rank, world, kind, config_kwargs, num_stages, rank_batch, microbatches, steps=3,
         grad_clip=0.0):
    strategy = build(rank, world, kind, config_kwargs, num_stages, rank_batch, microbatches,
                     grad_clip=grad_clip)
    versions = len(getattr(strategy, "versions", [None]))
    losses = train(strategy, 0, steps, rank_batch)
    records = [(r.step, r.phase, r.op, r.nbytes) for r in strategy.comm.ledger.records]
    val = strategy.evaluate([global_batch(99, 4)])
    strategy.close()
    return strategy.grid.replica, strategy.export_state(), losses, records, versions, val


def run(world, kind, config_kwargs, num_stages, rank_batch, microbatches, **kw):
    """Merged replica-0 state, per-rank results."""
    results = run_distributed(_run, world, kind, config_kwargs, num_stages, rank_batch,
                              microbatches, timeout=120, **kw)
    state = {}
    for replica, part, *_ in results:
        if replica == 0:
            state.update(part)
    return state, results


def reference_keys(state):
    assert state.keys() == full_state(make_model()).keys()
    return state


# ---------------------------------------------------------------------- partitioning


def test_partition_layers_and_parameters():
    layers = make_model(n_layer=6).as_layers()
    assert stage_bounds(layers, 1) == [(0, 8)]
    assert stage_bounds(layers, 3) == [(0, 3), (3, 5), (5, 8)]
    assert stage_bounds(layers, 4, "layers") == [(0, 3), (3, 5), (5, 6), (6, 8)]
    # with a large vocabulary the embedding (first) and the tied head (last) outweigh
    # several blocks: balanced by parameters, the ends hold one block, the middle four
    torch.manual_seed(0)
    heavy_ends = GPT(GPTConfig(vocab_size=4096, seq_len=SEQ, n_layer=6, n_head=2,
                               n_embd=WIDTH)).as_layers()
    assert stage_bounds(heavy_ends, 3, "parameters") == [(0, 2), (2, 6), (6, 8)]
    assert stage_bounds(heavy_ends, 3, "layers") == [(0, 3), (3, 5), (5, 8)]
    stages = split_layers(layers, 3)
    assert [m for s in stages for m in s] == layers  # same modules, in order


@pytest.mark.parametrize("stages", [5, 0])
def test_partition_rejects_bad_stage_counts(stages):
    with pytest.raises(ValueError, match="parallel.num_stages"):
        stage_bounds(make_model().as_layers(), stages)


def test_partition_rejects_unknown_rule():
    with pytest.raises(ValueError, match="parallel.partition"):
        stage_bounds(make_model().as_layers(), 2, "flops")


# ---------------------------------------------------------------------- identities


@pytest.mark.timeout(200)
def test_2bw_delay0_equals_torch_1f1b_equals_one_process():
    ours, results = run(2, "pipedream", {"delay": 0}, 2, 8, 4)
    torch_1f1b, _ = run(2, "pipeline", {"schedule": "1f1b"}, 2, 8, 4)
    single = one_process(3, 8, 4)
    assert_same_params(reference_keys(ours), single, atol=0, rtol=0)  # same op order
    assert_same_params(torch_1f1b, single, atol=1e-6, rtol=0)
    assert max_change(single, full_state(make_model())) > 1e-3
    losses = results[1][2]  # last stage reports the loss, the first does not
    assert all(v is not None for v in losses) and results[0][2] == [None] * 3


@pytest.mark.timeout(200)
def test_gpipe_and_interleaved_equal_1f1b():
    one_f1b, _ = run(2, "pipeline", {"schedule": "1f1b"}, 2, 8, 4)
    gpipe, _ = run(2, "pipeline", {"schedule": "gpipe"}, 2, 8, 4)
    interleaved, _ = run(2, "pipeline", {"schedule": "interleaved-1f1b",
                                         "stages_per_rank": 2}, 2, 8, 4)
    assert_same_params(gpipe, one_f1b, atol=1e-6, rtol=0)
    assert_same_params(interleaved, one_f1b, atol=1e-6, rtol=0)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stages,microbatches", [(2, 4), (3, 2)])
def test_2bw_equals_one_step_delay_loop(stages, microbatches):
    state, results = run(stages, "pipedream", {"delay": 1}, stages, 4, microbatches, steps=4)
    delayed = one_process(4, 4, microbatches, delay=1)
    assert_same_params(state, delayed, atol=1e-6, rtol=0)
    # and it is not the synchronous answer: the delay changes the parameters
    assert max_change(state, one_process(4, 4, microbatches)) > 1e-4
    assert all(versions == 2 for *_, versions, _ in results)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind,kwargs", [("pipedream", {"delay": 0}),
                                         ("pipeline", {"schedule": "1f1b"})])
def test_hybrid_2_stages_x_2_replicas_equals_2_stages_with_twice_the_batch(kind, kwargs):
    hybrid, results = run(4, kind, kwargs, 2, 4, 2)
    wide, _ = run(2, kind, kwargs, 2, 8, 4)
    assert_same_params(hybrid, wide, atol=1e-6, rtol=0)
    dp = [r for r in results[0][3] if r[1] == "dp"]
    assert len(dp) == 3  # one gradient all-reduce per step across the replicas
    assert results[0][5] == pytest.approx(results[3][5], abs=0)  # every rank: same val loss


# ---------------------------------------------------------------------- ledger, versions


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind,kwargs", [("pipedream", {"delay": 0}),
                                         ("pipedream", {"delay": 1}),
                                         ("pipeline", {"schedule": "1f1b"}),
                                         ("pipeline", {"schedule": "gpipe"})])
def test_p2p_bytes_per_step(kind, kwargs):
    S, M, b = 2, 4, 8
    _, results = run(4, kind, kwargs, S, b, M)
    activation = (b // M) * SEQ * WIDTH * 4  # fp32 hidden states of one microbatch
    for replica in (0, 1):
        sent: dict[int, int] = {}
        for rep, _, _, records, _, _ in results:
            if rep == replica:
                for step, phase, op, nbytes in records:
                    if phase == "train" and op in ("send", "exchange"):
                        sent[step] = sent.get(step, 0) + nbytes
        expected = 2 * (S - 1) * M * activation
        if kwargs.get("delay") == 1:  # the held gradient of a step leaves in the next one
            assert sum(sent.values()) == 3 * expected - activation
        else:
            assert sent == {0: expected, 1: expected, 2: expected}


@pytest.mark.timeout(120)
def test_2bw_holds_two_versions_and_resumes_bit_exactly():
    run_distributed(_resume, 3, timeout=100)


def _resume(rank, world):
    args = (rank, world, "pipedream", {"delay": 1}, 3, 4, 2)
    straight = build(*args)
    train(straight, 0, 5, 4)
    first = build(*args)
    train(first, 0, 2, 4)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    resumed = build(*args, model_seed=7)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    train(resumed, 2, 3, 4)
    assert_same_params(resumed.export_state(), straight.export_state(), atol=0, rtol=0)
    # never more than two weight versions: the stage's parameter tensors
    assert len(straight.weight_versions()) == 2
    owned = {id(p) for v in straight.weight_versions() for p in v.parameters()}
    assert owned == {id(p) for group in straight.optimizer.param_groups
                     for p in group["params"]} | {
        id(p) for v in straight.weight_versions() for p in v.parameters()}
    assert len(owned) == 2 * len(list(straight.versions[0].parameters()))


# ---------------------------------------------------------------------- failures, errors


def _crash(rank, world):
    strategy = build(rank, world, "pipedream", {"delay": 1}, 2, 4, 2)
    if rank == 1:
        raise RuntimeError("stage 1 died")
    train(strategy, 0, 3, 4)  # stage 0 blocks on stage 1's gradient


@pytest.mark.timeout(60)
def test_crashing_stage_fails_without_hanging():
    with pytest.raises(RuntimeError, match="stage 1 died"):
        run_distributed(_crash, 2, timeout=40)


def config(world=4, stages=2, group=1, batch=8, microbatches=4, n_layer=4):
    cfg = Config()
    cfg.parallel = ParallelConfig(world_size=world, group_size=group, num_stages=stages,
                                  num_microbatches=microbatches)
    cfg.data = DataConfig(batch_size=batch)
    cfg.model = dataclasses.replace(cfg.model, n_layer=n_layer) if isinstance(
        cfg.model, ModelConfig) else cfg.model
    return cfg


@pytest.mark.parametrize("strategy,cfg,key", [
    (PipelineConfig(), config(world=4, stages=3), "parallel.world_size"),
    (PipelineConfig(), config(stages=4, world=4, n_layer=2), "parallel.num_stages"),
    (PipelineConfig(), config(batch=6), "parallel.num_microbatches"),
    (PipelineConfig(), config(group=2), "parallel.group_size"),
    (PipeDreamConfig(), config(world=4, stages=4, microbatches=2), "parallel.num_microbatches"),
    (PipelineConfig(schedule="interleaved-1f1b", stages_per_rank=2),
     config(stages=4, world=4, n_layer=4), "stages_per_rank"),
])
def test_config_checks_name_the_key(strategy, cfg, key):
    with pytest.raises(ValueError, match=key):
        strategy.check(cfg)
    PipelineConfig().check(config())  # a good config passes


@pytest.mark.parametrize("kwargs,key", [
    (dict(backend="deepspeed"), "strategy.backend"),
    (dict(delay=2), "strategy.delay"),
])
def test_2bw_config_errors(kwargs, key):
    with pytest.raises(ValueError, match=key):
        PipeDreamConfig(**kwargs)


@pytest.mark.parametrize("kwargs,key", [
    (dict(schedule="zb"), "strategy.schedule"),
    (dict(backend="deepspeed", schedule="gpipe"), "strategy.schedule"),
    (dict(schedule="interleaved-1f1b"), "strategy.stages_per_rank"),
])
def test_pipeline_config_errors(kwargs, key):
    with pytest.raises(ValueError, match=key):
        PipelineConfig(**kwargs)
