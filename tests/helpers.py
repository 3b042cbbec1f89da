"""Parameter comparisons shared by the identity tests."""

import time

import torch
from torch import nn


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of a module's state, for comparing after training."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same_params(a: dict, b: dict, atol: float = 2e-5, rtol: float = 1e-4) -> None:
    """Same keys and, key by key, values equal to fp tolerance (0, 0 = bit-identical)."""
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=rtol, msg=key)


def max_change(a: dict, b: dict) -> float:
    """Largest absolute difference between two states: shows training really moved."""
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_bad_config(config: str | None, overrides: list[str] | str, *expected: str) -> str:
    """`load_config(config, overrides)` fails before launch with a ValueError whose message
    holds each of `expected` (the key, the value, what is valid); returns the message.

    The one bad-config table helper: test modules parametrise over (overrides, message)."""
    import pytest

    from bench.config import load_config

    overrides = [overrides] if isinstance(overrides, str) else list(overrides)
    with pytest.raises(ValueError) as err:
        load_config(config, overrides)
    message = str(err.value)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"
    return message


def burn_cpu(seconds: float) -> None:
    """Compute for `seconds` of this thread's CPU time: what a test strategy's step does
    to stand for compute. A sleep would not do: a CPU rank's compute is its CPU time
    (bench/run/meter.py, Compute clock), and a sleep, like a wait for a core, costs none."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class IdleStrategy:
    """Base of the tests' stand-in strategies that train nothing (timing and fault tests):
    the Strategy methods besides `train_step`, as no-ops."""

    def set_lr(self, lr):
        pass

    def eval_model(self):
        from algorithms.base import materialize  # the loop hands over a meta-device model

        materialize(self.setup.model, self.setup.model, self.comm.device)
        return self.setup.model

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass
