"""Pipelines: partitioning, identities on real gloo ranks, ledger bytes, versions, errors.

Run with `pytest tests/test_pipeline.py`. The strategies are driven directly (not through
bench.run.train, which they join at integration): a small GPT (4 blocks) is built from the
same seed on every rank, each step's global batch is drawn from a step-keyed generator,
and replica r takes its rows, so every run sees the same tokens in the same order.
Parameters are compared after >= 3 steps (CPU, fp32).
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from algorithms.base import TrainSetup, set_lr
from algorithms.comm import Communicator
from algorithms.delay import DelayedOptimizer
from algorithms.partition import split_layers, stage_bounds
from algorithms.pipedream import PipeDream2BW, PipeDreamConfig
from algorithms.pipeline import Pipeline, PipelineConfig
from bench.config.schema import (
    OPTIMIZERS,
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
)
from bench.model import GPT, GPTConfig, LlamaConfig, build_model, lm_loss
from bench.optim import (
    build_optimizer,
    configure_optimizer_groups,
    make_optimizer_factory,
)
from tests.distributed import run_distributed
from tests.helpers import assert_same_params, max_change

VOCAB, SEQ, WIDTH, LAYERS = 64, 8, 32, 4
LR = 1e-2


def make_model(seed: int = 0, n_layer: int = LAYERS, arch: str = "gpt2",
               tied: bool = True) -> GPT:
    torch.manual_seed(seed)
    shape = dict(vocab_size=VOCAB, seq_len=SEQ, n_layer=n_layer, n_head=2, n_embd=WIDTH,
                 tie_embeddings=tied)
    if arch == "llama":
        return build_model(LlamaConfig(**shape, n_kv_head=1))
    return GPT(GPTConfig(**shape))


def make_optimizer(module, optim="adamw"):
    if optim == "config":  # bench's own optimizer builder, as `commbench run` makes it
        return build_optimizer(module, optim_config(delay=0))
    if optim.startswith("config:"):  # "config:NAME": bench's builder for optim.name NAME
        return build_optimizer(module, named_optim_config(optim.split(":")[1], delay=0))
    groups = configure_optimizer_groups(module, 0.1)
    if optim == "sgd":
        return torch.optim.SGD(groups, lr=LR * 10, momentum=0.9)
    return torch.optim.AdamW(groups, lr=LR)


def optim_config(delay: int) -> OptimConfig:
    """SGD with momentum (stateful): with AdamW the attention's key bias, whose gradient is
    zero up to rounding, turns summation-order noise into ~1e-6 differences."""
    return OptimConfig(name="sgd", lr=LR * 10, momentum=0.9, weight_decay=0.1, delay=delay)


def named_optim_config(name: str, delay: int, correction: str = "none") -> OptimConfig:
    """optim.name NAME as `commbench run` builds it (SGD with momentum: stateful)."""
    return OptimConfig(name=name, lr=LR, momentum=0.9, weight_decay=0.1, delay=delay,
                       delay_correction=correction)


def lr_of(step: int) -> float:
    """A learning rate that changes every step (which step's lr an update uses shows)."""
    return LR * 10 * (1 + step) / 4


def global_batch(step: int, size: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def full_state(model: GPT) -> dict:
    """The GPT's state_dict (the tied embedding under both of its names)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------- references


def one_process(steps: int, batch: int, microbatches: int, delay: int = 0,
                optim: str = "sgd", arch: str = "gpt2", tied: bool = True) -> dict:
    """Gradient accumulation in one process; `delay=1` applies each step's gradient a
    step late (our hand-written one-step-delay loop: step 0 applies nothing).

    Runs on one thread, as the ranks do: intra-op threads change summation orders.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _one_process(steps, batch, microbatches, delay, optim, arch, tied)
    finally:
        torch.set_num_threads(threads)


def _one_process(steps, batch, microbatches, delay, optim, arch, tied) -> dict:
    model = make_model(arch=arch, tied=tied)
    opt = make_optimizer(model, optim)
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


@dataclasses.dataclass(frozen=True)
class Spec:
    """One pipeline run: strategy, its config, grid and batch (per replica)."""

    kind: str
    kwargs: tuple = ()
    num_stages: int = 2
    rank_batch: int = 8
    microbatches: int = 4
    steps: int = 3
    optim: str = "sgd"
    lr_schedule: bool = False
    """Set `lr_of(step)` before each step (else the optimizer's own lr throughout)."""
    correction: str = "none"
    """optim.delay_correction, as the loop hands it to the strategy (TrainSetup)."""
    arch: str = "gpt2"
    tied: bool = True
    """Whether the head is the token embedding (else its own weight: no tied group)."""


def build(rank, world, spec: Spec, model_seed=0, grad_clip=0.0):
    comm = Communicator(rank, world, "cpu")
    setup = TrainSetup(
        model=make_model(model_seed, arch=spec.arch, tied=spec.tied), comm=comm,
        make_optimizer=lambda m: make_optimizer(m, spec.optim), total_steps=10,
        grad_clip=grad_clip, rank_batch_size=spec.rank_batch,
        num_microbatches=spec.microbatches, num_stages=spec.num_stages, loss_fn=lm_loss,
        delay_correction=spec.correction)
    cls, config_cls = (Pipeline, PipelineConfig) if spec.kind == "pipeline" else \
        (PipeDream2BW, PipeDreamConfig)
    return cls(config_cls(**dict(spec.kwargs)), setup)


def train(strategy, first_step, steps, rank_batch, lr_schedule=False):
    losses = []
    for step in range(first_step, first_step + steps):
        strategy.comm.step = step
        if lr_schedule:
            strategy.set_lr(lr_of(step))
        x, y = global_batch(step, rank_batch * strategy.grid.num_replicas)
        rows = slice(strategy.grid.replica * rank_batch, (strategy.grid.replica + 1) * rank_batch)
        losses.append(strategy.train_step((x[rows], y[rows])).loss)
    return losses


def _run_specs(rank, world, specs):
    """Every spec in turn on the same ranks; per spec this rank's results."""
    out = []
    for spec in specs:
        strategy = build(rank, world, spec)
        losses = train(strategy, 0, spec.steps, spec.rank_batch, spec.lr_schedule)
        records = [(r.step, r.phase, r.op, r.nbytes) for r in strategy.comm.ledger.records]
        val = strategy.evaluate([global_batch(99, 4)])
        strategy.close()
        versions = getattr(strategy, "versions", None)
        stray = None  # optimizer state held for parameters of a version it is not bound to
        if versions:
            bound = {id(p) for p in versions[strategy.bound].parameters()}
            stray = sum(id(p) not in bound for p in strategy.optimizer.state)
        out.append(dict(replica=strategy.grid.replica, state=strategy.export_state(),
                        losses=losses, records=records, val=val, stray_state=stray,
                        versions=len(getattr(strategy, "versions", [None]))))
    return out


def run_all(world, specs, timeout=300):
    """{spec: (merged replica-0 state, per-rank results)}; one set of processes for all."""
    per_rank = run_distributed(_run_specs, world, specs, timeout=timeout)
    merged = {}
    for i, spec in enumerate(specs):
        ranks = [results[i] for results in per_rank]
        state = {}
        for r in ranks:
            if r["replica"] == 0:
                state.update(r["state"])
        merged[spec] = (state, ranks)
    return merged


OURS_SYNC = Spec("pipedream", (("delay", 0),))
TORCH = {name: Spec("pipeline", (("schedule", name),) + extra) for name, extra in
         [("1f1b", ()), ("gpipe", ()), ("interleaved-1f1b", (("stages_per_rank", 2),))]}
TORCH_1F1B = TORCH["1f1b"]
OURS_ADAMW = Spec("pipedream", (("delay", 0),), optim="adamw", steps=1)
OURS_DELAYED = Spec("pipedream", (("delay", 1),), rank_batch=4, steps=4)
OURS_DELAYED_CFG = {steps: Spec("pipedream", (("delay", 1),), rank_batch=4, steps=steps,
                               optim="config", lr_schedule=True) for steps in (1, 4)}
OURS_DELAYED_3 = Spec("pipedream", (("delay", 1),), num_stages=3, rank_batch=4,
                      microbatches=2, steps=4)
HYBRID = {kind: Spec(kind, kwargs, rank_batch=4, microbatches=2)
          for kind, kwargs in [("pipedream", (("delay", 0),)), ("pipeline", ())]}
LEDGER = [Spec("pipedream", (("delay", 1),)), Spec("pipeline", (("schedule", "gpipe"),))]
UNTIED = {("llama", "pipedream"): Spec("pipedream", (("delay", 0),), arch="llama", tied=False),
          ("llama", "pipeline"): Spec("pipeline", (("schedule", "1f1b"),), arch="llama"),
          ("gpt2", "pipeline"): Spec("pipeline", (("schedule", "1f1b"),), tied=False)}
"""Llama (tied and untied) and an untied GPT-2 through both executors."""


@pytest.fixture(scope="module")
def two_ranks():
    return run_all(2, [OURS_SYNC, OURS_ADAMW, *TORCH.values(), OURS_DELAYED,
                       *OURS_DELAYED_CFG.values(), *UNTIED.values()])


@pytest.fixture(scope="module")
def four_ranks():
    return run_all(4, [*HYBRID.values(), OURS_SYNC, TORCH_1F1B, *LEDGER])


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


# SGD with momentum: AdamW would turn the key bias's ~0 gradient (softmax ignores it)
# into lr-sized steps of pure rounding noise, hiding the comparison at 1e-6.


@pytest.mark.timeout(400)
def test_2bw_delay0_equals_torch_1f1b_equals_one_process(two_ranks):
    ours, ranks = two_ranks[OURS_SYNC]
    single = one_process(3, 8, 4)
    assert_same_params(reference_keys(ours), single, atol=1e-6, rtol=0)
    assert_same_params(two_ranks[TORCH_1F1B][0], single, atol=1e-6, rtol=0)
    assert max_change(single, full_state(make_model())) > 1e-3
    assert [r["losses"] == [None] * 3 for r in ranks] == [True, False]  # last stage only
    # bit-identical after one AdamW step except the tied embedding, whose two halves are
    # summed per microbatch in one process but per stage here (later steps then differ
    # in the last bits everywhere)
    tied = ("embed.wte.weight", "head.weight")
    one_step = one_process(1, 8, 4, optim="adamw")
    ours = two_ranks[OURS_ADAMW][0]
    assert_same_params({k: v for k, v in ours.items() if k not in tied},
                       {k: v for k, v in one_step.items() if k not in tied}, atol=0, rtol=0)
    for key in tied:
        torch.testing.assert_close(ours[key], one_step[key], atol=1e-7, rtol=0)


@pytest.mark.timeout(400)
def test_llama_and_untied_heads_equal_one_process(two_ranks):
    """Both architectures, tied or not, pipeline to the one-process answer; an untied
    head has no tied group (no `tied` traffic), a tied one has."""
    for (arch, _), spec in UNTIED.items():
        state, ranks = two_ranks[spec]
        single = one_process(3, 8, 4, arch=arch, tied=spec.tied)
        assert state.keys() == single.keys()
        assert_same_params(state, single, atol=1e-6, rtol=0)
        assert max_change(single, full_state(make_model(arch=arch, tied=spec.tied))) > 1e-3
        tied_records = [rec for r in ranks for rec in r["records"] if rec[1] == "tied"]
        assert bool(tied_records) == spec.tied, spec


@pytest.mark.timeout(400)
def test_gpipe_and_interleaved_equal_1f1b(two_ranks):
    one_f1b = two_ranks[TORCH_1F1B][0]
    for name in ("gpipe", "interleaved-1f1b"):
        assert_same_params(two_ranks[TORCH[name]][0], one_f1b, atol=1e-6, rtol=0)
    assert max_change(one_f1b, full_state(make_model())) > 1e-3


@pytest.mark.timeout(400)
def test_2bw_equals_one_step_delay_loop(two_ranks):
    state, ranks = two_ranks[OURS_DELAYED]
    delayed = one_process(4, 4, 4, delay=1)
    assert_same_params(state, delayed, atol=1e-6, rtol=0)
    # and it is not the synchronous answer: the delay changes the parameters
    assert max_change(state, one_process(4, 4, 4)) > 1e-4
    assert all(r["versions"] == 2 for r in ranks)


def delayed_optimizer_run(steps: int, batch: int, microbatches: int, lr_shift: int = 0,
                          optim: OptimConfig | None = None):
    """One process, no pipeline, `optim.delay: 1` through bench.optim's factory (the
    DelayedOptimizer emulation, SGD unless `optim` says otherwise), driven as
    DataParallelStrategy drives it; the lr of step `t - lr_shift` is set before step t."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model()
        optimizer = make_optimizer_factory(Config(optim=optim or optim_config(delay=1)))(model)
        assert isinstance(optimizer, DelayedOptimizer)
        for step in range(steps):
            set_lr(optimizer, lr_of(max(0, step - lr_shift)))
            optimizer.zero_grad(set_to_none=True)
            optimizer.begin_step()
            x, y = global_batch(step, batch)
            for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
                (model(xm, ym)[1] / microbatches).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return full_state(model)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(400)
def test_2bw_equals_the_delayed_optimizer_emulation(two_ranks):
    """PipeDream-2BW on 2 stages == `optim.delay: 1` on one process, same data, <= 1e-6:
    step 0 applies nothing, step t applies g(t-1) at step t's learning rate."""
    first, _ = two_ranks[OURS_DELAYED_CFG[1]]
    init = full_state(make_model())
    assert max_change(first, init) == 0  # step 0: W(1) = W(0) on the pipeline
    assert max_change(delayed_optimizer_run(1, 4, 4), init) == 0  # and in the emulation
    state, _ = two_ranks[OURS_DELAYED_CFG[4]]
    assert_same_params(state, delayed_optimizer_run(4, 4, 4), atol=1e-6, rtol=0)
    # the test can tell which step's lr an update used, and that the delay matters
    assert max_change(state, delayed_optimizer_run(4, 4, 4, lr_shift=1)) > 1e-5
    assert max_change(state, one_process(4, 4, 4)) > 1e-4


# Every optimizer the schema accepts, and every correction, in the asynchronous pipeline.
# On one stage the pipeline computes bit-identical gradients to the emulation, so the two
# must agree exactly whatever the optimizer: this pins the version swap (every piece of
# optimizer state moved). Across stages the tied embedding's gradient is summed in another
# order (rounding), which AdamW-like optimizers turn into ~lr-sized differences on the
# attention key bias (its true gradient is 0: softmax ignores it), Muon's bf16
# Newton-Schulz into bf16 flips and SOAP's eigenbases of rank-deficient statistics into
# O(1) ones; so the multi-stage identities use SGD with momentum and Lion (stateful,
# numerically stable) at 1e-6.
OPTIMIZER_2BW = {name: Spec("pipedream", (("delay", 1),), num_stages=1, rank_batch=4,
                            steps=4, optim=f"config:{name}", lr_schedule=True)
                 for name in OPTIMIZERS}
STAGED_2BW = {(name, correction): Spec("pipedream", (("delay", 1),), rank_batch=4, steps=4,
                                       optim=f"config:{name}", lr_schedule=True,
                                       correction=correction)
              for name in ("sgd", "lion") for correction in ("none", "ef", "predict")}
CORRECTED_1STAGE = {(name, correction): dataclasses.replace(OPTIMIZER_2BW[name],
                                                            correction=correction)
                    for name in ("adamw", "muon") for correction in ("ef", "predict")}


@pytest.fixture(scope="module")
def one_stage_2bw():
    return run_all(1, [*OPTIMIZER_2BW.values(), *CORRECTED_1STAGE.values()])


@pytest.fixture(scope="module")
def two_stage_2bw():
    return run_all(2, list(STAGED_2BW.values()))


def emulation(name: str, correction: str = "none", steps: int = 4) -> dict:
    return delayed_optimizer_run(steps, 4, 4, optim=named_optim_config(name, 1, correction))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_2bw_with_every_optimizer_equals_its_delay_emulation(one_stage_2bw, name):
    """The version swap moves every piece of optimizer state, whatever its structure (Muon's
    two optimizers, the package optimizers): 2BW == `optim.delay: 1`, bit for bit."""
    state, ranks = one_stage_2bw[OPTIMIZER_2BW[name]]
    assert all(r["versions"] == 2 and r["stray_state"] == 0 for r in ranks)
    assert_same_params(state, emulation(name), atol=0, rtol=0)
    assert max_change(state, full_state(make_model())) > 1e-3  # it trained
    # and the test can tell: one step earlier on the lr schedule is another answer
    assert max_change(state, delayed_optimizer_run(4, 4, 4, lr_shift=1,
                                                   optim=named_optim_config(name, 1))) > 1e-6


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name,correction", list(CORRECTED_1STAGE))
def test_each_correction_in_2bw_equals_it_emulated(one_stage_2bw, name, correction):
    """Bit for bit, but for `predict`'s evaluation copy: the pipeline stashes W + u and
    evaluates (W + u) - u, one rounding away from the emulation's W (~1 ulp)."""
    state, _ = one_stage_2bw[CORRECTED_1STAGE[name, correction]]
    atol = 5e-7 if correction == "predict" else 0
    assert_same_params(state, emulation(name, correction), atol=atol, rtol=0)
    # the correction changed the answer: the test tells corrections apart
    assert max_change(state, one_stage_2bw[OPTIMIZER_2BW[name]][0]) > 1e-4


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name,correction", list(STAGED_2BW))
def test_each_correction_on_2_stages_equals_it_emulated(two_stage_2bw, name, correction):
    state, ranks = two_stage_2bw[STAGED_2BW[name, correction]]
    assert all(r["versions"] == 2 for r in ranks)
    assert_same_params(state, emulation(name, correction), atol=1e-6, rtol=0)
    if correction != "none":
        assert max_change(state, two_stage_2bw[STAGED_2BW[name, "none"]][0]) > 1e-4


@pytest.mark.timeout(400)
def test_hybrid_2_stages_x_2_replicas_equals_2_stages_with_twice_the_batch(two_ranks,
                                                                           four_ranks):
    for kind, spec in HYBRID.items():
        hybrid, ranks = four_ranks[spec]
        wide = two_ranks[OURS_SYNC if kind == "pipedream" else TORCH_1F1B][0]
        assert_same_params(hybrid, wide, atol=1e-6, rtol=0)
        assert_same_params(ranks[2]["state"], ranks[0]["state"], atol=0, rtol=0)
        dp = [rec for rec in ranks[0]["records"] if rec[1] == "dp"]
        assert len(dp) == 3  # one gradient all-reduce per step across the replicas
        assert len({r["val"] for r in ranks}) == 1  # every rank gets the same val loss


@pytest.mark.timeout(400)
def test_deepspeed_1f1b_equals_one_process():
    pytest.importorskip("deepspeed")
    spec = Spec("pipeline", (("schedule", "1f1b"), ("backend", "deepspeed")))
    state, ranks = run_all(2, [spec])[spec]
    assert_same_params(reference_keys(state), one_process(3, 8, 4), atol=1e-6, rtol=0)
    # its p2p sends reach the ledger: M activations and M gradients per step (step 0
    # also carries the engine's shape metadata, a few bytes)
    activation = 2 * SEQ * WIDTH * 4
    sent: dict[int, int] = {}
    for r in ranks:
        for step, _, op, nbytes in r["records"]:
            if op == "send" and nbytes == activation:
                sent[step] = sent.get(step, 0) + nbytes
    assert sent == {step: 2 * 4 * activation for step in range(3)}


# ---------------------------------------------------------------------- ledger, versions


@pytest.mark.timeout(400)
def test_p2p_bytes_per_step(four_ranks):
    S, M, b = 2, 4, 8
    activation = (b // M) * SEQ * WIDTH * 4  # fp32 hidden states of one microbatch
    expected = 2 * (S - 1) * M * activation
    for spec in [*LEDGER, OURS_SYNC, TORCH_1F1B]:
        for replica in (0, 1):
            sent: dict[int, int] = {}
            for r in four_ranks[spec][1]:
                if r["replica"] == replica:
                    for step, phase, op, nbytes in r["records"]:
                        if phase == "train" and op in ("send", "exchange"):
                            sent[step] = sent.get(step, 0) + nbytes
            if dict(spec.kwargs).get("delay") == 1:
                # a step's last gradient leaves in the next step; the run's last never does
                assert sent == {0: expected - activation, 1: expected, 2: expected}, spec
            else:
                assert sent == {0: expected, 1: expected, 2: expected}, spec


@pytest.mark.timeout(400)
def test_2bw_on_3_stages_holds_two_versions_and_resumes_bit_exactly():
    per_rank = run_distributed(_resume, 3, OURS_DELAYED_3, timeout=300)
    versions = [{}, {}]
    for newest, previous in per_rank:
        versions[0].update(newest)
        versions[1].update(previous)
    m = OURS_DELAYED_3.microbatches
    # after 5 steps the stage holds W(4) (newest) and W(3): the delay loop after 5 and 4
    assert_same_params(versions[0], one_process(5, 4, m, delay=1), atol=1e-6, rtol=0)
    assert_same_params(versions[1], one_process(4, 4, m, delay=1), atol=1e-6, rtol=0)


def _resume(rank, world, spec):
    straight = build(rank, world, spec)
    train(straight, 0, 5, spec.rank_batch)
    first = build(rank, world, spec)
    train(first, 0, 2, spec.rank_batch)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # mid-run: stashed activations in flight
    resumed = build(rank, world, spec, model_seed=7)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    train(resumed, 2, 3, spec.rank_batch)
    assert_same_params(resumed.export_state(), straight.export_state(), atol=0, rtol=0)
    # never more than two weight versions: two modules, distinct tensors, and the
    # optimizer steps exactly the parameters of the newest one
    versions = straight.weight_versions()
    assert len(versions) == 2
    tensors = {id(p) for v in versions for p in v.parameters()}
    assert len(tensors) == 2 * len(list(versions[0].parameters()))
    newest = straight.eval_model()
    bound = {id(p) for group in straight.optimizer.param_groups for p in group["params"]}
    assert bound == {id(p) for p in newest.parameters()}
    previous = versions[1] if newest is versions[0] else versions[0]
    return [{straight.names[k]: p.detach().clone()
             for k, p in v.named_parameters(remove_duplicate=False)}
            for v in (newest, previous)]


# ---------------------------------------------------------------------- failures, errors


def _crash(rank, world):
    strategy = build(rank, world, Spec("pipedream", (("delay", 1),), rank_batch=4,
                                       microbatches=2))
    if rank == 1:
        raise RuntimeError("stage 1 died")
    train(strategy, 0, 3, 4)  # stage 0 blocks on stage 1's gradient


@pytest.mark.timeout(150)
def test_crashing_stage_fails_without_hanging():
    with pytest.raises(RuntimeError, match="stage 1 died"):
        run_distributed(_crash, 2, timeout=100)


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


def test_deepspeed_log_gives_each_op_its_own_seconds():
    """DeepSpeed's comms logger appends each call's CUMULATIVE timer total (its comm.py:
    `timers(name).elapsed(reset=False)`): calls of 1, 2 and 3 ms over two sizes are logged
    as 1, 3 and 6 ms. Each op must get its own time; the old sum said 10 ms, not 6."""
    from algorithms.zero import per_op_seconds

    logged = {"all_reduce": {100: [2, [1.0, 3.0], [], []], 200: [1, [6.0], [], []]},
              "broadcast": {8: [1, [0.5], [], []]}}
    ops = per_op_seconds(logged)
    assert sorted(ops) == sorted([("all_reduce", 100, 1e-3), ("all_reduce", 100, 2e-3),
                                  ("all_reduce", 200, 3e-3), ("broadcast", 8, 0.5e-3)])
    assert sum(s for name, _, s in ops if name == "all_reduce") == pytest.approx(6e-3)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "ours-1f1b", "2bw"])
@pytest.mark.parametrize("S,M", [(2, 4), (3, 3), (4, 8), (2, 1)])
def test_critical_path_without_transfers_is_the_bubble(schedule, S, M):
    """bench/network/pipeline.py with free links: a flushed schedule's step is its
    M + S - 1 slots of compute (the bubble); 2BW's steady step is its compute plus the
    last stage's wait for S - 1 forwards after the step's synchronising all-reduce."""
    from algorithms.base import CriticalPath
    from bench.network.pipeline import critical_path_time

    if schedule == "2bw" and M < S - 1:
        pytest.skip("2BW needs M >= S - 1")
    c = 0.048
    got = critical_path_time(c, 0.0, 0.0, 0.0, CriticalPath(schedule, S, M))
    if schedule == "2bw":
        assert got == pytest.approx(c + (S - 1) * c / (3 * M))
    else:
        assert got == pytest.approx(c * (M + S - 1) / M)


@pytest.mark.parametrize("h", [0.010, 0.0])
def test_critical_path_of_a_latency_bound_1f1b_pays_each_receive_in_turn(h):
    """Two stages, 4 microbatches, a link much slower than a microbatch's compute, worked
    by hand from torch's Schedule1F1B: the last stage posts each activation receive only
    after its previous backward, so every one of them waits h + d (the sender is
    already waiting), the first after the first stage's first forward too (F); on gloo
    (h > 0) torch's three steady batches of the last stage post a gradient's send before
    the receive, so their activation arrives d - h later (the two messages one after the
    other; our executor posts the receive first and does not pay it); the first
    stage's last backward waits for the last gradient (d).
    Step = max(F, h) + d + (M - 1)(h + d + late) + M c_mb + d + B + other.
    (The old slot model gave (M + S - 1) 2 tau + 2 (S - 1) tau + other: 0.253 + other
    here, against 0.136 (h = 10 ms) + other.)"""
    from algorithms.base import CriticalPath
    from bench.network.pipeline import critical_path_time

    M, c, d, other = 4, 0.032, 0.0111, 0.06
    c_mb, f, b = c / M, c / (3 * M), 2 * c / (3 * M)
    # torch fuses each batch's sends before its receives; ours posts receives first
    for schedule, late in (("1f1b", d - h if h > 0 else 0.0), ("ours-1f1b", 0.0)):
        want = max(f, h) + d + (M - 1) * (h + d + late) + M * c_mb + d + b + other
        got = critical_path_time(c, d, h, other, CriticalPath(schedule, 2, M))
        assert got == pytest.approx(want, rel=1e-12), schedule


def test_critical_path_replays_each_stage_at_its_own_compute():
    """Two stages, free links, torch's 1F1B worked by hand with the last stage slower
    (c1 = 0.06 s, c0 = 0.04 s a step, 4 microbatches): the last stage runs its 4
    microbatches back to back after the first stage's first forward, and the first
    stage's last backward follows: f0 + 4 c1/4 + b0 = 0.07 s. Every stage at the slower
    one's compute (the old projection) gives the bubble at its rate: 0.06 x 5/4 = 0.075."""
    from algorithms.base import CriticalPath
    from bench.network.pipeline import critical_path_time

    path, c0, c1, M = CriticalPath("1f1b", 2, 4), 0.04, 0.06, 4
    want = c0 / (3 * M) + c1 + 2 * c0 / (3 * M)
    assert critical_path_time([c0, c1], 0.0, 0.0, 0.0, path) == pytest.approx(want)
    assert want == pytest.approx(0.07)
    assert critical_path_time(c1, 0.0, 0.0, 0.0, path) == pytest.approx(0.075)
    assert critical_path_time([c1, c1], 0.0, 0.0, 0.0, path) == pytest.approx(0.075)
    with pytest.raises(ValueError, match="one compute per stage"):
        critical_path_time([c0, c1, c1], 0.0, 0.0, 0.0, path)


def test_a_runs_pipeline_projection_prices_each_replica_with_its_stages_compute():
    """bench/network/timeline.py `pipeline_step_s`: 4 ranks = 2 replicas of 2 stages (rank = replica
    x 2 + stage); each replica's ranks get its replay with their own computes, the larger
    d of its ranks (with that rank's h) and the larger other; a world that is not whole
    replicas is refused."""
    from algorithms.base import CriticalPath
    from bench.network.pipeline import critical_path_time
    from bench.network.timeline import pipeline_step_s

    path = CriticalPath("1f1b", 2, 4)
    compute = [0.04, 0.06, 0.05, 0.05]
    links = [(0.010, 0.001), (0.012, 0.002), (0.0, 0.0), (0.0, 0.0)]
    others = [0.003, 0.001, 0.0, 0.002]
    got = pipeline_step_s(compute, links, others, path)
    first = critical_path_time([0.04, 0.06], 0.012, 0.002, 0.003, path)
    second = critical_path_time(0.05, 0.0, 0.0, 0.002, path)
    assert got == pytest.approx([first, first, second, second], rel=1e-12)
    assert second == pytest.approx(0.05 * 5 / 4 + 0.002)
    with pytest.raises(ValueError, match="whole number"):
        pipeline_step_s(compute[:3], links[:3], others[:3], path)


def test_critical_path_inputs_price_one_message_and_gloos_handshake():
    """d = one send of the largest point-to-point message on the profile; h = what an
    exchange of it costs more (gloo: the ready-to-receive, one latency; NCCL: none);
    the other records summed."""
    from algorithms.comm import CommRecord
    from bench.network import get_profile, record_seconds
    from bench.network.model import pricer
    from bench.network.pipeline import critical_path_inputs

    profile = get_profile("eth-10g")
    tier = profile.link(0, 1, 1)

    def rec(op, nbytes, peers, **kw):
        return CommRecord(step=0, phase="train", op=op, group_size=len(peers) + 1,
                          peers=peers, nbytes=nbytes, seconds=0.0, tier="inter", **kw)

    act = 8 * 32 * 64 * 4
    records = [rec("send", act // 2, (1,)), rec("exchange", act, (1,), peer_nbytes=(act,)),
               rec("recv", act, (1,))]
    tied = CommRecord(step=0, phase="tied", op="all_reduce", group_size=2, peers=(0, 1),
                      nbytes=4096, seconds=0.0, tier="inter")
    for backend, h in (("gloo", tier.latency_s), ("nccl", 0.0), (None, 0.0)):
        d, got_h, other = critical_path_inputs(records + [tied],
                                               pricer(profile, backend=backend))
        assert d == pytest.approx(tier.latency_s + act / tier.bandwidth_Bps)
        assert got_h == pytest.approx(h, abs=1e-15)
        assert other == pytest.approx(record_seconds(tied, profile, backend=backend))
    assert critical_path_inputs([tied], pricer(profile))[:2] == (0.0, 0.0)


# ---------------------------------------------------------------------- stage-local build


def _stage_initial_weights(rank, world, arch):
    """Per partition: a pipeline rank given a meta-device model; its stage's initial
    weights, and how many parameter elements of the whole model became real here."""
    return {partition: _stage_of(rank, world, arch, partition)
            for partition in ("layers", "parameters")}


def _stage_of(rank, world, arch, partition):
    torch.manual_seed(3)
    with torch.device("meta"):
        model = build_model(heavy_ends_config(arch))
    setup = TrainSetup(model=model, comm=Communicator(rank, world, "cpu"),
                       make_optimizer=lambda m: make_optimizer(m), total_steps=1,
                       rank_batch_size=4, num_microbatches=2, num_stages=world,
                       partition=partition, loss_fn=lm_loss)
    strategy = PipeDream2BW(PipeDreamConfig(delay=0), setup)
    real = sum(p.numel() for p in model.parameters() if not p.is_meta)
    return strategy.export_state(), real, sum(p.numel() for p in
                                              strategy.stage_module.parameters())


def heavy_ends_config(arch: str):
    """6 blocks and a large vocabulary: the two partitions cut differently."""
    shape = dict(vocab_size=4096, seq_len=SEQ, n_layer=6, n_head=2, n_embd=WIDTH)
    return LlamaConfig(**shape, tie_embeddings=True) if arch == "llama" else GPTConfig(**shape)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_each_stage_builds_only_itself_with_the_full_models_initial_values(arch):
    """Stage-local: every rank materialises its own stage of a meta-device model, holding
    exactly the values the same slice of a fully built model has (same seed), for both
    partitions; nothing of the other stages is allocated."""
    torch.manual_seed(3)
    full = build_model(heavy_ends_config(arch)).state_dict()
    cuts = {}
    results = run_distributed(_stage_initial_weights, 3, arch, timeout=120)
    for partition in ("layers", "parameters"):
        per_rank = [r[partition] for r in results]
        merged = {}
        for state, real, own in per_rank:
            assert real == own  # only the stage became real
            for key, value in state.items():
                assert torch.equal(value, full[key]), (partition, key)
                merged[key] = value
        assert merged.keys() == full.keys()  # the stages cover the model (tied head too)
        cuts[partition] = [sorted(state) for state, _, _ in per_rank]
    assert cuts["layers"] != cuts["parameters"]
