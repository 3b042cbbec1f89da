"""One-step delay and error feedback (algorithms/delay.py) against hand-written tensor math.

    pytest tests/test_delay.py

The hand loops below spell out the rule of the module docstring with plain tensors:
step 0 applies nothing; step t >= 1 applies the gradient taken at W(t-1) on batch B(t-1).
"""

import io

import pytest
import torch
from torch.func import functional_call

from algorithms.delay import DelayedOptimizer, ef_correction, pipeline_delays, stage_delays
from bench.config import load_config
from bench.model import GPT, gpt_config
from bench.optim import build_optimizer, describe_optimizer, lr_at, make_optimizer_factory
from tests.helpers import assert_same_params, max_change, params_of

SEQ = 16
BASE = ["model.seq_len=16", "optim.warmup_steps=2", "run.steps=6", "optim.grad_clip=0"]


def tiny_gpt(seed: int = 0, n_layer: int | None = None, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(gpt_config("tiny", 256, SEQ, 0.0, n_layer, **overrides))


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (2, SEQ), generator=gen),
             torch.randint(0, 256, (2, SEQ), generator=gen)) for _ in range(n)]


def cfg_of(*overrides):
    return load_config(None, [*BASE, *overrides])


def train(model, optimizer, cfg, data, start: int = 0) -> None:
    """The strategy's step order: set lr, zero_grad, begin_step, forward/backward, (clip),
    step (algorithms/base.py DataParallelStrategy.train_step)."""
    for step, (x, y) in enumerate(data, start=start):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg) * group.get("lr_scale", 1.0)
        optimizer.zero_grad(set_to_none=True)
        getattr(optimizer, "begin_step", lambda: None)()  # a plain optimizer has none
        model(x, y)[1].backward()
        optimizer.step()


def grad_at(model, weights: dict, batch) -> dict:
    """∇f(W; B) for weights given as a name -> tensor dict (model's parameters untouched)."""
    weights = {k: w.detach().requires_grad_() for k, w in weights.items()}
    loss = functional_call(model, weights, batch)[1]
    return dict(zip(weights, torch.autograd.grad(loss, list(weights.values())), strict=True))


def named(model) -> dict:
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def test_delay_1_sgd_is_w_minus_lr_times_gradient_at_previous_weights():
    cfg = cfg_of("optim.name=sgd", "optim.weight_decay=0", "optim.delay=1")
    model, data = tiny_gpt(), batches(5)
    reference = tiny_gpt()
    weights = [named(reference)]  # weights[t] = W(t)
    for t in range(5):
        if t == 0:
            weights.append(weights[0])  # step 0 applies nothing
            continue
        g = grad_at(reference, weights[t - 1], data[t - 1])  # ∇f(W(t-1); B(t-1))
        lr = lr_at(t, cfg)
        weights.append({k: w - lr * g[k] for k, w in weights[t].items()})

    optimizer = make_optimizer_factory(cfg)(model)
    assert isinstance(optimizer, DelayedOptimizer)
    train(model, optimizer, cfg, data)
    assert max_change(weights[5], weights[0]) > 1e-4  # training moved the weights
    assert_same_params(named(model), weights[5], atol=1e-6, rtol=1e-6)


def test_first_step_applies_nothing_and_leaves_optimizer_state_empty():
    cfg = cfg_of("optim.delay=1")
    model = tiny_gpt()
    start = params_of(model)
    optimizer = make_optimizer_factory(cfg)(model)
    train(model, optimizer, cfg, batches(1))
    assert_same_params(params_of(model), start, atol=0, rtol=0)
    assert len(optimizer.state) == 0  # AdamW has not counted a step


def test_ef_with_lambda_0_is_plain_delay_bit_exactly():
    data = batches(6)
    runs = []
    for extra in (["optim.delay_correction=none"],
                  ["optim.delay_correction=ef", "optim.ef_lambda=0"]):
        cfg = cfg_of("optim.delay=1", *extra)
        model = tiny_gpt()
        train(model, make_optimizer_factory(cfg)(model), cfg, data)
        runs.append(params_of(model))
    assert_same_params(runs[0], runs[1], atol=0, rtol=0)


def test_ef_lambda_1_sgd_matches_hand_math():
    """u(t) = -lr(t) g(t-1); applied ũ(t) = u(t) + (u(t) - u(t-1)) once u(t-1) exists."""
    cfg = cfg_of("optim.name=sgd", "optim.weight_decay=0", "optim.delay=1",
                 "optim.delay_correction=ef", "optim.ef_lambda=1")
    model, data = tiny_gpt(), batches(4)
    reference = tiny_gpt()
    w = {0: named(reference), 1: named(reference)}  # step 0 applies nothing
    u = {}
    for t in (1, 2, 3):
        g = grad_at(reference, w[t - 1], data[t - 1])
        u[t] = {k: -lr_at(t, cfg) * g[k] for k in g}
        applied = u[t] if t == 1 else {k: 2 * u[t][k] - u[t - 1][k] for k in g}
        w[t + 1] = {k: w[t][k] + applied[k] for k in g}
    train(model, make_optimizer_factory(cfg)(model), cfg, data)

    plain = tiny_gpt()
    train(plain, make_optimizer_factory(cfg_of("optim.name=sgd", "optim.weight_decay=0",
                                               "optim.delay=1"))(plain), cfg, data)
    assert max_change(named(plain), w[4]) > 1e-5  # the correction changed the result
    assert_same_params(named(model), w[4], atol=1e-6, rtol=1e-6)


def test_predict_sgd_takes_each_gradient_at_the_extrapolated_weights():
    """g(t) is taken at W(t) + u(t-1), u(t-1) = W(t) - W(t-1) the last applied update (none
    before the first); the update still applies to W(t): W(t+1) = W(t) - lr(t) g(t-1)."""
    sgd = ["optim.name=sgd", "optim.weight_decay=0", "optim.delay=1", "optim.lr=0.3"]
    cfg = cfg_of(*sgd, "optim.delay_correction=predict")
    model, data = tiny_gpt(), batches(5)
    reference = tiny_gpt()
    w = {0: named(reference), 1: named(reference)}  # step 0 applies nothing
    g = {0: grad_at(reference, w[0], data[0])}
    for t in range(1, 5):
        at = w[t] if t == 1 else {k: w[t][k] + (w[t][k] - w[t - 1][k]) for k in w[t]}
        g[t] = grad_at(reference, at, data[t])
        w[t + 1] = {k: w[t][k] - lr_at(t, cfg) * g[t - 1][k] for k in w[t]}
    optimizer = make_optimizer_factory(cfg)(model)
    train(model, optimizer, cfg, data)

    plain = tiny_gpt()
    train(plain, make_optimizer_factory(cfg_of(*sgd))(plain), cfg, data)
    assert max_change(named(plain), w[5]) > 1e-4  # the prediction changed the result
    assert_same_params(named(model), w[5], atol=1e-6, rtol=1e-6)


def test_ef_correction_is_the_reconstructed_formula():
    u, previous = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 1.0])
    torch.testing.assert_close(ef_correction(u, previous, 0.5), torch.tensor([1.25, -3.5]))


@pytest.mark.parametrize("extra", [["optim.name=adamw", "optim.delay_correction=ef"],
                                   ["optim.name=muon"],
                                   ["optim.name=muon", "optim.delay_correction=predict"]])
def test_resume_mid_run_is_bit_exact(extra):
    """Between two steps the weights are W (predict's shift is undone by step()) and the
    state dict carries the stored gradient and u(t-1): a resumed run continues bit for bit."""
    cfg = cfg_of("optim.delay=1", *extra)
    data = batches(6)
    model = tiny_gpt()
    train(model, make_optimizer_factory(cfg)(model), cfg, data)
    uninterrupted = params_of(model)

    first = tiny_gpt()
    optimizer = make_optimizer_factory(cfg)(first)
    train(first, optimizer, cfg, data[:3])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)

    resumed = tiny_gpt(seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(saved["model"])
    optimizer = make_optimizer_factory(cfg)(resumed)
    optimizer.load_state_dict(saved["optimizer"])
    train(resumed, optimizer, cfg, data[3:], start=3)
    assert_same_params(params_of(resumed), uninterrupted, atol=0, rtol=0)


def test_diagnostics_are_the_update_and_the_stale_minus_fresh_gradient():
    cfg = cfg_of("optim.delay=1")
    model, data = tiny_gpt(), batches(3)
    optimizer = make_optimizer_factory(cfg)(model)
    train(model, optimizer, cfg, data[:1])
    w1 = named(model)
    train(model, optimizer, cfg, data[1:2], start=1)
    before = named(model)
    stale = grad_at(model, w1, data[1])  # g(1) = ∇f(W(1); B(1)), applied at step 2
    fresh = grad_at(model, named(model), data[2])  # g(2), taken at W(2)
    optimizer.watch_next_step()
    train(model, optimizer, cfg, data[2:], start=2)
    diagnostics = optimizer.diagnostics()
    expected_update = torch.cat([(p - before[k]).flatten()
                                 for k, p in named(model).items()]).norm()
    expected_diff = torch.cat([(stale[k] - fresh[k]).flatten() for k in stale]).norm()
    assert diagnostics["update_norm"] == pytest.approx(expected_update.item(), rel=1e-4)
    assert diagnostics["stale_grad_diff_norm"] == pytest.approx(expected_diff.item(), rel=1e-4)
    assert diagnostics["stale_grad_diff_norm"] > 0
    optimizer.step()  # an unwatched step: no update norm
    assert "update_norm" not in optimizer.diagnostics()


@pytest.mark.parametrize("kwargs, message", [
    ({"delay": 2}, "optim.delay must be 1"),
    ({"correction": "momentum"}, "optim.delay_correction must be one of ['none', 'ef', 'predict']"),
])
def test_wrapper_rejects_bad_arguments(kwargs, message):
    optimizer = torch.optim.SGD(tiny_gpt().parameters(), lr=0.1)
    with pytest.raises(ValueError) as err:
        DelayedOptimizer(optimizer, **kwargs)
    assert message in str(err.value)


# ------------------------------------------------ delay profiles (per-parameter delays, issue 47)

PIPELINE = ["optim.delay=1", "optim.delay_profile=pipeline"]


def with_delays(model, optimizer, delay: int | None = None, **kwargs) -> DelayedOptimizer:
    """`optimizer` wrapped with per-parameter delays: all `delay`, or `delays=` as given."""
    delays = kwargs.pop("delays", None)
    if delays is None:
        delays = {id(p): delay for p in model.parameters()}
    return DelayedOptimizer(optimizer, delays=delays, **kwargs)


def optimizer_states_equal(a, b) -> None:
    """The wrapped optimizers' state dicts are equal, tensors bit for bit."""
    def flat(state, prefix=""):
        if isinstance(state, dict):
            for k, v in state.items():
                yield from flat(v, f"{prefix}.{k}")
        elif isinstance(state, list | tuple):
            for i, v in enumerate(state):
                yield from flat(v, f"{prefix}[{i}]")
        else:
            yield prefix, state
    fa, fb = dict(flat(a.state_dict())), dict(flat(b.state_dict()))
    assert fa.keys() == fb.keys()
    for k in fa:
        if isinstance(fa[k], torch.Tensor):
            assert torch.equal(fa[k], fb[k]), k
        else:
            assert fa[k] == fb[k], k


@pytest.mark.parametrize("name", ["adamw", "muon", "sgd"])
def test_per_parameter_delays_all_0_are_the_plain_optimizer_bit_for_bit(name):
    cfg = cfg_of(f"optim.name={name}", *(["optim.momentum=0.9"] if name == "sgd" else []))
    data = batches(5)
    plain = tiny_gpt()
    plain_opt = build_optimizer(plain, cfg.optim)
    train(plain, plain_opt, cfg, data)
    model = tiny_gpt()
    delayed = with_delays(model, build_optimizer(model, cfg.optim), 0)
    train(model, delayed, cfg, data)
    assert max_change(named(plain), named(tiny_gpt())) > 1e-4  # training moved the weights
    assert_same_params(params_of(model), params_of(plain), atol=0, rtol=0)
    optimizer_states_equal(delayed.optimizer, plain_opt)
    assert delayed.num_applied == 5 and delayed.queue == []  # nothing stored


@pytest.mark.parametrize("name", ["adamw", "muon", "nadamw"])
def test_per_parameter_delays_all_1_are_the_uniform_path_bit_for_bit(name):
    cfg = cfg_of(f"optim.name={name}", "optim.delay=1")
    data = batches(6)
    uniform = tiny_gpt()
    uniform_opt = make_optimizer_factory(cfg)(uniform)
    assert uniform_opt.delays is None  # the factory's uniform profile: the unchanged path
    model = tiny_gpt()
    per_param = with_delays(model, build_optimizer(model, cfg.optim), 1)
    for step in range(len(data)):  # step by step: the diagnostics agree as well
        for m, opt in ((uniform, uniform_opt), (model, per_param)):
            opt.watch_next_step()
            train(m, opt, cfg, data[step:step + 1], start=step)
        assert uniform_opt.diagnostics() == per_param.diagnostics()
        assert_same_params(params_of(model), params_of(uniform), atol=0, rtol=0)
    assert per_param.num_applied == uniform_opt.num_applied == 5
    optimizer_states_equal(per_param.optimizer, uniform_opt.optimizer)


def expected_delays(model: GPT, num_stages: int) -> dict[str, int]:
    """By hand, for 3 blocks: P = 2 cuts [embed, b0, b1 | b2, head] (the first stage takes
    the extra block), P = 3 [embed, b0 | b1 | b2, head]; stage s of P is P - 1 - s steps
    late; the tied wte (the head's `weight`) is the embedding's, the first stage's."""
    stage_of_block = {2: {0: 0, 1: 0, 2: 1}, 3: {0: 0, 1: 1, 2: 2}}[num_stages]
    out = {}
    for name, _ in model.named_parameters():
        if name.startswith("embed."):
            stage = 0
        elif name.startswith("head."):
            stage = num_stages - 1
        else:
            stage = stage_of_block[int(name.split(".")[1])]
        out[name] = num_stages - 1 - stage
    return out


@pytest.mark.parametrize("num_stages", [2, 3])
def test_stage_delays_embedding_first_head_last_tied_weight_first_stages(num_stages):
    model = tiny_gpt(n_layer=3)
    assert model.head.weight is model.embed.wte.weight  # GPT-2's tied embedding/head
    delays = stage_delays(model.as_layers(), num_stages)
    by_name = {name: delays[id(p)] for name, p in model.named_parameters()}
    assert by_name == expected_delays(model, num_stages)
    assert delays[id(model.head.weight)] == num_stages - 1  # not the head's stage's 0
    assert delays[id(model.head.ln_f.weight)] == 0
    assert delays[id(model.embed.wpe.weight)] == num_stages - 1
    # optim.delay scales every stage's delay
    doubled = stage_delays(model.as_layers(), num_stages, delay=2)
    assert doubled == {k: 2 * d for k, d in delays.items()}
    # untied: the head's own weight takes the last stage's delay, 0
    untied = tiny_gpt(n_layer=3, tie_embeddings=False)
    delays = stage_delays(untied.as_layers(), num_stages)
    assert delays[id(untied.head.weight)] == 0
    assert delays[id(untied.embed.wte.weight)] == num_stages - 1


@pytest.mark.parametrize("num_stages", [2, 3])
def test_pipeline_profile_sgd_is_a_per_parameter_gradient_queue(num_stages):
    """SGD by hand: W_i(t+1) = W_i(t) - lr(t) g_i(t - d_i) once t >= d_i, each parameter's
    fresh gradients kept in its own queue; nothing before (the embedding's stage starts
    P - 1 steps late)."""
    cfg = cfg_of("optim.name=sgd", "optim.weight_decay=0", "optim.lr=0.3",
                 "model.n_layer=3", *PIPELINE, f"optim.delay_stages={num_stages}")
    steps = 6
    data = batches(steps)
    reference = tiny_gpt(n_layer=3)
    delay = expected_delays(reference, num_stages)
    w = named(reference)
    queue: dict[str, list] = {k: [] for k in w}
    for t in range(steps):
        g = grad_at(reference, w, data[t])  # g(t) at W(t)
        for k in w:
            queue[k].append(g[k])
        w = {k: (v - lr_at(t, cfg) * queue[k][t - delay[k]] if t >= delay[k] else v)
             for k, v in w.items()}

    model = tiny_gpt(n_layer=3)
    optimizer = make_optimizer_factory(cfg)(model)
    assert isinstance(optimizer, DelayedOptimizer) and optimizer.delays is not None
    train(model, optimizer, cfg, data)
    assert_same_params(named(model), w, atol=1e-6, rtol=1e-6)
    start = named(tiny_gpt(n_layer=3))
    assert all(max_change({k: w[k]}, {k: start[k]}) > 1e-5 for k in w)  # every stage moved
    uniform = tiny_gpt(n_layer=3)
    uniform_cfg = cfg_of("optim.name=sgd", "optim.weight_decay=0", "optim.lr=0.3",
                         "model.n_layer=3", "optim.delay=1")
    train(uniform, make_optimizer_factory(uniform_cfg)(uniform), uniform_cfg, data)
    assert max_change(named(uniform), w) > 1e-4  # the profile is not the uniform delay
    # each stored gradient is kept exactly d steps: sum_i d_i |p_i| numbers held
    held = sum(g.numel() for entry in optimizer.queue for g in entry if g is not None)
    assert held == sum(delay[k] * p.numel() for k, p in model.named_parameters())


def test_pipeline_profile_first_steps_apply_only_the_undelayed_stages():
    """P = 3: step 0 updates only the last stage, step 1 the last two; the optimizer
    (AdamW) holds no state for a parameter before its first gradient."""
    cfg = cfg_of("model.n_layer=3", *PIPELINE, "optim.delay_stages=3")
    model = tiny_gpt(n_layer=3)
    delay = expected_delays(model, 3)
    optimizer = make_optimizer_factory(cfg)(model)
    data = batches(3)
    for t in range(3):
        before = named(model)
        train(model, optimizer, cfg, data[t:t + 1], start=t)
        after = named(model)
        for name, p in model.named_parameters():
            moved = not torch.equal(before[name], after[name])
            assert moved == (t >= delay[name]), (t, name)
            assert (p in optimizer.state) == (t >= delay[name]), (t, name)
    assert optimizer.num_applied == 3


def test_pipeline_profile_step_with_nothing_to_apply_does_not_step_the_optimizer():
    """Every parameter delayed (no stage of delay 0): the first step calls nothing."""
    model = tiny_gpt()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    inner.step = lambda *a, **k: calls.append(1)
    optimizer = with_delays(model, inner, 2)
    train(model, optimizer, cfg_of(), batches(3))
    assert calls == [1] and optimizer.num_applied == 1  # steps 0 and 1 apply nothing


@pytest.mark.parametrize("extra", [["optim.name=adamw", "optim.delay_stages=2"],
                                   ["optim.name=adamw", "optim.delay_stages=3"],
                                   ["optim.name=muon", "optim.delay_stages=3"]])
def test_pipeline_profile_resume_mid_run_is_bit_exact(extra):
    """The checkpoint at step 3 holds gradients still queued (P = 3: two steps' worth)."""
    cfg = cfg_of("model.n_layer=3", *PIPELINE, *extra)
    data = batches(7)
    model = tiny_gpt(n_layer=3)
    train(model, make_optimizer_factory(cfg)(model), cfg, data)
    uninterrupted = params_of(model)

    first = tiny_gpt(n_layer=3)
    optimizer = make_optimizer_factory(cfg)(first)
    train(first, optimizer, cfg, data[:3])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # plain data, as checkpoints load

    resumed = tiny_gpt(seed=123, n_layer=3)
    resumed.load_state_dict(saved["model"])
    optimizer = make_optimizer_factory(cfg)(resumed)
    optimizer.load_state_dict(saved["optimizer"])
    train(resumed, optimizer, cfg, data[3:], start=3)
    assert_same_params(params_of(resumed), uninterrupted, atol=0, rtol=0)
    assert max_change(uninterrupted, params_of(tiny_gpt(n_layer=3))) > 1e-4


def test_a_uniform_checkpoint_does_not_load_into_the_pipeline_profile():
    data = batches(2)
    model = tiny_gpt(n_layer=3)
    cfg = cfg_of("model.n_layer=3", "optim.delay=1")
    optimizer = make_optimizer_factory(cfg)(model)
    train(model, optimizer, cfg, data)
    profile = make_optimizer_factory(cfg_of("model.n_layer=3", *PIPELINE,
                                            "optim.delay_stages=2"))(model)
    with pytest.raises(ValueError, match="optim.delay_profile or optim.delay_stages differ"):
        profile.load_state_dict(optimizer.state_dict())


def test_pipeline_profile_diagnostics_and_summary():
    cfg = cfg_of("model.n_layer=3", *PIPELINE, "optim.delay_stages=3")
    model = tiny_gpt(n_layer=3)
    optimizer = make_optimizer_factory(cfg)(model)
    data = batches(3)
    train(model, optimizer, cfg, data[:2])
    before = named(model)
    optimizer.watch_next_step()
    train(model, optimizer, cfg, data[2:], start=2)
    diagnostics = optimizer.diagnostics()
    expected = torch.cat([(p - before[k]).flatten() for k, p in named(model).items()]).norm()
    assert diagnostics["update_norm"] == pytest.approx(expected.item(), rel=1e-4)
    assert diagnostics["stale_grad_diff_norm"] > 0
    info = describe_optimizer(optimizer, cfg)
    assert info["delay_profile"] == "pipeline" and info["stage_delays"] == [2, 1, 0]
    assert "delay_profile" not in describe_optimizer(optimizer, cfg_of("optim.delay=1"))


@pytest.mark.parametrize("overrides, expected", [
    (["optim.delay_stages=1"], ["optim.delay_stages", "got 1", "from 2"]),
    (["optim.delay_stages=4"], ["optim.delay_stages", "got 4", "number of blocks (3)"]),
    (["optim.delay_profile=uniform", "optim.delay_stages=2"],
     ["optim.delay_stages=2", "optim.delay_profile=pipeline"]),
    (["optim.delay_stages=null"], ["optim.delay_stages", "got None", "from 2"]),
    (["optim.delay=0", "optim.delay_stages=2"], ["optim.delay_profile=pipeline",
                                                  "optim.delay is 0", "optim.delay=1"]),
    (["optim.delay_stages=2", "optim.delay_correction=ef"],
     ["optim.delay_correction='ef'", "one step of delay", "optim.delay_correction=none"]),
    (["optim.delay_stages=3", "optim.delay_correction=predict"],
     ["optim.delay_correction='predict'", "0 to 2 steps", "optim.delay_profile=uniform"]),
    (["optim.delay_stages=2", "strategy.backend=deepspeed"],
     ["optim.delay_profile=pipeline", "strategy.backend=deepspeed", "strategy.backend=torch"]),
    (["optim.delay_profile=stages"], ["optim.delay_profile", "'stages'", "pipeline"]),
])
def test_pipeline_profile_refusals_name_the_key(overrides, expected):
    with pytest.raises(ValueError) as err:
        load_config("configs/ddp-tiny.yaml",
                    ["model.n_layer=3", *PIPELINE, *overrides])
    for part in expected:
        assert part in str(err.value), (part, str(err.value))


@pytest.mark.parametrize("config", ["configs/pipeline-1f1b-tiny.yaml", "configs/2bw-tiny.yaml"])
def test_pipeline_profile_refused_where_the_optimizer_sees_one_stage(config):
    with pytest.raises(ValueError) as err:
        load_config(config, [*PIPELINE, "optim.delay_stages=2"])
    assert "optim.delay" in str(err.value)
    if "1f1b" in config:  # 2bw refuses optim.delay=1 itself
        assert "one stage of a real pipeline" in str(err.value)


def test_per_parameter_delays_refuse_corrections_and_a_stage_module():
    model = tiny_gpt()
    with pytest.raises(ValueError, match="optim.delay_correction='ef' is defined for one step"):
        with_delays(model, torch.optim.SGD(model.parameters(), lr=0.1), 1, correction="ef")
    with pytest.raises(ValueError, match="has no delay"):
        DelayedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), delays={})
    stage = torch.nn.Sequential(*model.as_layers()[:2])  # a pipeline stage: no as_layers
    with pytest.raises(ValueError, match="optim.delay_profile='pipeline' cuts the whole"):
        pipeline_delays(stage, 2)
    with pytest.raises(ValueError, match="optim.delay_stages=3 cannot cut"):
        pipeline_delays(model, 3)  # 2 blocks
