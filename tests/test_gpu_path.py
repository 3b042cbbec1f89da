"""The CUDA/NCCL path, checked on CPU (issue 30): what a first GPU run would hit.

Run with `pytest tests/test_gpu_path.py`. No GPU is needed: where the real behaviour needs
CUDA (device events, streams, NCCL's non-blocking waits), a fake device clock or a mocked
`torch.cuda` function stands in for it, and the test pins what our code does with it.
Multi-process tests use real gloo ranks (tests/distributed.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from algorithms.base import TrainSetup
from algorithms.comm import Communicator
from bench.model import GPT, GPTConfig, lm_loss
from tests.distributed import run_distributed
from tests.helpers import assert_bad_config

VOCAB, SEQ, WIDTH, LAYERS = 64, 8, 32, 2


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=LAYERS, n_head=2,
                         n_embd=WIDTH))


def tiny_batch(step: int, rows: int = 4):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def tiny_setup(rank, world, **kwargs) -> TrainSetup:
    options = dict(model=tiny_gpt(), comm=Communicator(rank, world, "cpu"),
                   make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                   total_steps=4, rank_batch_size=4, loss_fn=lm_loss)
    options.update(kwargs)
    return TrainSetup(**options)


# ------------------------------------------------------------------ compile after DDP


class CompileRecorder:
    """A `TrainSetup.compile` that records what it was given and compiles for real
    (dynamo's eager backend: graph capture, DDP's bucket split, no C++ toolchain)."""

    def __init__(self):
        self.given: list[str] = []

    def __call__(self, module):
        self.given.append(type(module).__name__)
        return torch.compile(module, backend="eager")


def _compile_order(rank, world):
    from algorithms.ddp import DDP, DDPConfig
    from algorithms.pipedream import PipeDream2BW, PipeDreamConfig
    from algorithms.pipeline import Pipeline, PipelineConfig

    out = {}
    eager = DDP(DDPConfig(), tiny_setup(rank, world))
    compiler = CompileRecorder()
    compiled = DDP(DDPConfig(), tiny_setup(rank, world, compile=compiler))
    assert isinstance(compiled.train_model, DistributedDataParallel)
    losses = [(eager.train_step(tiny_batch(s)).loss, compiled.train_step(tiny_batch(s)).loss)
              for s in range(2)]
    out["ddp"] = compiler.given, losses
    for name, strategy_class, config in [
            ("pipeline", Pipeline, PipelineConfig(schedule="1f1b")),
            ("pipedream", PipeDream2BW, PipeDreamConfig(delay=1))]:
        compiler = CompileRecorder()
        strategy = strategy_class(config, tiny_setup(rank, world, compile=compiler,
                                                     num_stages=2, num_microbatches=2))
        for s in range(3):
            strategy.train_step(tiny_batch(s))
        out[name] = compiler.given
    return out


@pytest.mark.timeout(240)
def test_strategies_compile_what_they_train_after_wrapping_it():
    """compile(DDP(model)), never DDP(compile(model)): the bare model compiled first gives
    DDP one backward graph (no bucket overlap; a slower baseline). Pipelines compile their
    stage modules (2BW: both weight versions); the compiled step trains like the eager one."""
    for out in run_distributed(_compile_order, 2, timeout=220):
        given, losses = out["ddp"]
        assert given == ["DistributedDataParallel"]
        for eager, compiled in losses:
            assert compiled == pytest.approx(eager, rel=1e-5)
        assert out["pipeline"] == ["Sequential"]
        assert out["pipedream"] == ["Sequential", "Sequential"]


def _trainer_hands_compile_to_the_strategy(rank, world, run_dir):
    from bench.config import load_config
    from bench.train import Trainer

    cfg = load_config("configs/ddp-tiny.yaml", ["parallel.world_size=2", "model.compile=true"])
    trainer = Trainer(cfg, Path(run_dir), torch.device("cpu"), "gloo")
    setup = trainer.strategy.setup
    return (type(setup.model).__name__, setup.compile is torch.compile,
            type(trainer.strategy.train_model).__name__)


@pytest.mark.timeout(120)
def test_the_loop_does_not_compile_the_bare_model(tmp_path):
    for model, compile_set, trained in run_distributed(
            _trainer_hands_compile_to_the_strategy, 2, str(tmp_path), timeout=100):
        assert (model, compile_set, trained) == ("GPT", True, "DistributedDataParallel")


@pytest.mark.parametrize("config,overrides", [
    ("configs/ddp-tiny.yaml", ["strategy.backend=deepspeed"]),
    ("configs/deepspeed-pp-tiny.yaml", []),
])
def test_compile_refused_where_deepspeed_runs_the_forward(config, overrides):
    assert_bad_config(config, [*overrides, "model.compile=true"], "model.compile",
                      "strategy.backend=deepspeed")


# ------------------------------------------------------------------ mixed precision


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def record_linear_dtypes(module) -> list:
    """The output dtypes of every Linear's forward in `module`, as they happen."""
    seen = []
    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return seen


def _deepspeed_precision(rank, world):
    from algorithms.ddp import DDP, DDPConfig
    from algorithms.pipeline import Pipeline, PipelineConfig

    out = {}
    for precision in ("fp32", "bf16"):
        autocast = bf16_autocast if precision == "bf16" else None
        setup = tiny_setup(rank, world, precision=precision, autocast=autocast)
        seen = record_linear_dtypes(setup.model)
        zero = DDP(DDPConfig(backend="deepspeed", zero_stage=0), setup)
        records_before = len(zero.comm.ledger)
        zero.train_step(tiny_batch(rank))
        train = zero.comm.ledger.records[records_before:]
        out[f"zero-{precision}"] = (set(seen), sum(r.nbytes for r in train))
    setup = tiny_setup(rank, world, precision="bf16", autocast=bf16_autocast, num_stages=2,
                       num_microbatches=2)
    seen = record_linear_dtypes(setup.model)
    pipe = Pipeline(PipelineConfig(backend="deepspeed"), setup)
    pipe.train_step(tiny_batch(0))
    out["deepspeed-pipe"] = set(seen)
    pipe.close()
    return out


@pytest.mark.timeout(300)
def test_deepspeed_engines_run_model_precision():
    """ZeRO and the DeepSpeed pipeline ran fp32 beside bf16 torch DDP: the engine switches
    an outside autocast off. With model.precision bf16 their forwards run under bf16
    autocast, and ZeRO still reduces fp32 gradients (DDP's bytes, not half of them)."""
    pytest.importorskip("deepspeed")
    for out in run_distributed(_deepspeed_precision, 2, timeout=280):
        fp32_dtypes, fp32_bytes = out["zero-fp32"]
        bf16_dtypes, bf16_bytes = out["zero-bf16"]
        assert fp32_dtypes == {torch.float32}
        assert bf16_dtypes == {torch.bfloat16}
        assert bf16_bytes == fp32_bytes > 0
        assert out["deepspeed-pipe"] == {torch.bfloat16}


def _pipeline_eval_precision(rank, world):
    from algorithms.pipedream import PipeDream2BW, PipeDreamConfig

    setup = tiny_setup(rank, world, autocast=bf16_autocast, num_stages=2, num_microbatches=2)
    strategy = PipeDream2BW(PipeDreamConfig(delay=0), setup)
    seen = record_linear_dtypes(strategy.stage_module)
    strategy.evaluate([tiny_batch(7)])
    return set(seen)


@pytest.mark.timeout(120)
def test_pipelines_evaluate_under_the_runs_autocast():
    """Data-parallel strategies validate under autocast (base.mean_loss); pipelines did
    not, so a bf16 run's validation loss came from another numeric path."""
    assert run_distributed(_pipeline_eval_precision, 2, timeout=100) == [{torch.bfloat16}] * 2
