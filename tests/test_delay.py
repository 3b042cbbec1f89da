"""One-step delay and error feedback (algorithms/delay.py) against hand-written tensor math.

    pytest tests/test_delay.py

The hand loops below spell out the rule of the module docstring with plain tensors:
step 0 applies nothing; step t >= 1 applies the gradient taken at W(t-1) on batch B(t-1).
"""

import io

import pytest
import torch
from torch.func import functional_call

from algorithms.delay import DelayedOptimizer, ef_correction
from bench.config import load_config
from bench.model import GPT, gpt_config
from bench.optim import lr_at, make_optimizer_factory
from tests.helpers import assert_same_params, max_change, params_of

SEQ = 16
BASE = ["model.seq_len=16", "optim.warmup_steps=2", "run.steps=6", "optim.grad_clip=0"]


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(gpt_config("tiny", 256, SEQ))


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
        optimizer.begin_step()
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
