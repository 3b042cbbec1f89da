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


def tiny_gpt(seed: int = 0, n_layer: int = LAYERS) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=n_layer, n_head=2,
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


@pytest.mark.slow  # a launch of ~10-50 s; tox -e slow
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
    from bench.run.train import Trainer

    cfg = load_config("configs/ddp-tiny.yaml", ["parallel.world_size=2", "model.compile=true"])
    trainer = Trainer(cfg, Path(run_dir), torch.device("cpu"), "gloo")
    setup = trainer.strategy.setup
    return (type(setup.model).__name__, setup.compile is torch.compile,
            type(trainer.strategy.train_model).__name__)


@pytest.mark.slow  # a launch of ~10-50 s; tox -e slow
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


@pytest.mark.slow  # a launch of ~10-50 s; tox -e slow
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


# ------------------------------------------------------------------ pipeline idle time


class FakeStreamClock:
    """CudaClock's behaviour without CUDA: a mark is the compute stream's time when it
    reaches the mark; `FakeNcclWork.wait` returns to the host at once but makes the stream
    wait for the transfer (what NCCL's wait does)."""

    def __init__(self):
        self.stream = 0.0
        self.synchronized = 0

    def mark(self):
        return self.stream

    def seconds(self, start, end):
        return end - start

    def synchronize(self):
        self.synchronized += 1


class FakeNcclWork:
    def __init__(self, clock: FakeStreamClock, transfer_s: float):
        self.clock, self.transfer_s = clock, transfer_s

    def wait(self):
        self.clock.stream += self.transfer_s
        return True


class FakeOp:
    def __init__(self, op, nbytes: int, peer: int):
        self.op, self.tensor, self.peer = op, torch.zeros(nbytes // 4), peer


def test_pipedream_idle_is_the_streams_wait_not_its_queued_compute():
    """PipeDream started its idle clock on the host after a device synchronise per op (and
    the op's own two): correct, but the host could never queue ahead. Its waits are now
    marked on the device's clock (P2PRecorder, as torch's schedules): the rank's own queued
    compute is not bubble, the stream's wait for the transfer is, with one synchronise."""
    import torch.distributed as dist

    from algorithms.comm import CommLedger
    from algorithms.pipedream import PipeDream2BW
    from algorithms.pipeline import P2PRecorder

    clock = FakeStreamClock()
    comm = Communicator(0, 2, "cpu", CommLedger(keep_records=True))
    transfer_s = {dist.irecv: 0.25, dist.isend: 0.0}

    def start_p2p(sends, recvs):  # NCCL's: the host returns at once
        ops = [FakeOp(dist.irecv, 4 * t.numel(), p) for p, t in recvs.items()]
        ops += [FakeOp(dist.isend, 4 * t.numel(), p) for p, t in sends.items()]
        return ops, [FakeNcclWork(clock, transfer_s[op.op]) for op in ops]

    comm.start_p2p = start_p2p
    stage = PipeDream2BW.__new__(PipeDream2BW)  # only its p2p state: no process group
    stage.comm, stage.pending, stage.recorder = comm, None, P2PRecorder(comm, clock)
    stage.exchanged = {("G", 0, 1)}
    clock.stream += 1.0  # compute queued before the receive: not idle
    stage.receive(torch.empty(1), 1, ("G", 0, 0))
    clock.stream += 2.0
    stage.pending = (1, torch.zeros(1))  # a held send: received by an exchange
    stage.receive(torch.empty(1), 1, ("G", 0, 1))
    assert stage.pending is None
    assert stage.recorder.finish() == pytest.approx(0.5)
    assert clock.synchronized == 1
    assert [(r.op, r.nbytes) for r in comm.ledger.records] == [("recv", 4), ("exchange", 4)]


def test_torch_schedule_idle_is_the_streams_wait_not_the_hosts():
    """NCCL's wait() returns at once: host-timed, the bubble was ~0 and the wait stayed in
    compute, priced again by the critical path. Timed on the device's clock, the idle is
    what the compute stream waited, and each batch is recorded issue -> end of its wait."""
    import torch.distributed as dist

    from algorithms.comm import CommLedger
    from algorithms.pipeline import P2PRecorder

    clock = FakeStreamClock()
    comm = Communicator(0, 2, "cpu", CommLedger())
    recorder = P2PRecorder(comm, clock)
    works = recorder.track([FakeOp(dist.isend, 64, 1), FakeOp(dist.irecv, 64, 1)],
                           [FakeNcclWork(clock, 0.2), FakeNcclWork(clock, 0.1)])
    clock.stream += 1.0  # compute queued between issue and wait: not idle
    for work in works:
        work.wait()
    works[0].wait()  # a second wait on the same work: counted once
    assert recorder.finish() == pytest.approx(0.3)
    assert clock.synchronized == 1  # one device synchronise per step, at the end
    (record,) = comm.ledger.records
    assert (record.op, record.nbytes, record.peers) == ("exchange", 64, (1,))
    assert record.seconds == pytest.approx(1.3)


class FakeDeviceClock:
    """A clock that is not the host's (so the code takes its CUDA path), timed on the host."""

    def mark(self):
        import time

        return time.perf_counter()

    def seconds(self, start, end):
        return end - start

    def synchronize(self):
        pass


def _deepspeed_pipe_on_a_device_clock(rank, world):
    from deepspeed.comm.comm import comms_logger

    from algorithms import pipeline_deepspeed
    from algorithms.pipeline import Pipeline, PipelineConfig

    pipeline_deepspeed.clock_for = lambda device: FakeDeviceClock()  # this process only
    setup = tiny_setup(rank, world, num_stages=2, num_microbatches=2)
    pipe = Pipeline(PipelineConfig(backend="deepspeed"), setup)
    steps = []
    for s in range(3):
        pipe.comm.step = s
        first = len(pipe.comm.ledger)
        stats = pipe.train_step(tiny_batch(s))
        steps.append(([(r.op, r.nbytes, r.seconds) for r in pipe.comm.ledger.records[first:]
                       if r.op not in ("send", "recv")], comms_logger.enabled, stats.comm_s))
    pipe.close()
    return steps, comms_logger.enabled


@pytest.mark.slow  # a launch of ~10-50 s; tox -e slow
@pytest.mark.timeout(200)
def test_deepspeed_pipeline_logger_is_off_after_the_first_step_on_cuda():
    """The comms logger synchronises the device after every op: on CUDA it is on for the
    first step only (as algorithms/zero.py does), then the learnt collectives are replayed
    and their exposed time comes from the marks around the gradient reductions."""
    pytest.importorskip("deepspeed")
    for steps, enabled_after_close in run_distributed(_deepspeed_pipe_on_a_device_clock, 2,
                                                      timeout=180):
        (first, on_after_first, _), *later = steps
        assert first and not on_after_first
        for ops, enabled, comm_s in later:
            assert not enabled
            assert [(op, nbytes) for op, nbytes, _ in ops] == [(op, n) for op, n, _ in first]
            assert all(seconds == 0.0 for _, _, seconds in ops)
            assert comm_s > 0  # the p2p idle and the timed reductions
        assert enabled_after_close


# ------------------------------------------------------------------ emulated DDP hook


class Recorded:
    """A context manager (or callable) that notes how it was called."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def __call__(self, *args, **kwargs):
        self.log.append((self.name, args, kwargs))
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_emulated_hook_future_and_completion_live_on_the_buckets_device(monkeypatch):
    """On CUDA the hook returned a CPU future (DDP could read the bucket before the
    all-reduce landed) and its timer thread recorded events on device 0 from every rank.
    The future is a CUDA future on the bucket's device; completion runs on that device and
    on the stream that queued the division after the all-reduce."""
    from algorithms import ddp

    log = []
    monkeypatch.setattr(torch.futures, "Future", Recorded(log, "Future"))
    monkeypatch.setattr(torch.cuda, "device", Recorded(log, "device"))
    monkeypatch.setattr(torch.cuda, "stream", Recorded(log, "stream"))
    gpu3 = torch.device("cuda", 3)
    ddp.device_future(gpu3)
    with ddp.on_stream(gpu3, "the division's stream"):
        pass
    assert log == [("Future", (), {"devices": [gpu3]}), ("device", (gpu3,), {}),
                   ("stream", ("the division's stream",), {})]
    log.clear()
    ddp.device_future(torch.device("cpu"))
    with ddp.on_stream(torch.device("cpu"), None):
        pass
    assert log == [("Future", (), {})]


def _emulated_ddp(rank, world):
    import threading

    from algorithms import ddp

    made, completed = [], []
    real_future, real_on_stream = ddp.device_future, ddp.on_stream

    def device_future(device):
        made.append(str(device))
        return real_future(device)

    def on_stream(device, stream):
        completed.append((str(device), threading.current_thread().name))
        return real_on_stream(device, stream)

    ddp.device_future, ddp.on_stream = device_future, on_stream
    comm = Communicator(rank, world, "cpu", delay=lambda record: 0.05)
    strategy = ddp.DDP(ddp.DDPConfig(bucket_cap_mb=0.01), tiny_setup(rank, world, comm=comm))
    for step in range(2):  # DDP's first step has one 1 MiB bucket; then bucket_cap_mb
        strategy.train_step(tiny_batch(2 * step + rank))
    return made, completed, [p.detach().clone() for p in strategy.model.parameters()]


@pytest.mark.timeout(120)
def test_emulated_hook_completes_each_bucket_through_the_device_helpers():
    (made, completed, params), (_, _, other) = run_distributed(_emulated_ddp, 2, timeout=100)
    assert len(made) > 2 and set(made) == {"cpu"}  # one future per bucket, its device's
    assert len(completed) == len(made)
    assert any(thread != "MainThread" for _, thread in completed)  # the timer thread
    for mine, theirs in zip(params, other, strict=True):  # the reduced gradients applied
        torch.testing.assert_close(mine, theirs, atol=0, rtol=0)


def test_an_emulated_pipeline_transfer_starts_when_the_device_reaches_it():
    """Issue 46: torch's 1F1B/GPipe queue their sends ahead of the GPU; under emulation the
    modelled hop was timed from the host's queueing. The batch now synchronises the device
    before its host clock starts (a no-op on CPU), as the FSDP recorder and DDP hook do."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from algorithms.pipeline import P2PRecorder, _Batch

    calls = []

    class Comm:
        device, delay = torch.device("cpu"), object()

        def synchronize(self):
            calls.append("synchronize")

    recorder = P2PRecorder(Comm())
    send = SimpleNamespace(op=dist.isend, tensor=torch.ones(4), peer=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("algorithms.pipeline.time.perf_counter",
                      lambda: calls.append("host clock") or 0.0)
        _Batch(recorder, [send], 1)
    assert calls[0] == "synchronize" and calls[1:] and set(calls[1:]) == {"host clock"}
    calls.clear()
    Comm.delay = None  # without emulation nothing waits for the device
    _Batch(recorder, [send], 1)
    assert calls == []


def _emulated_ddp_behind_the_host(rank, world):
    import time

    from algorithms import ddp

    reached, starts = [], []

    def device_reached(device):  # a stand-in for a CUDA event: the GPU is 50 ms behind
        def wait():
            time.sleep(0.05)
            reached.append(time.perf_counter())
        return wait

    ddp.device_reached = device_reached
    comm = Communicator(rank, world, "cpu", delay=lambda record: 0.01)
    modelled = comm.modelled_seconds

    def logged(op, nbytes, group=None, peers=None, started=None):
        starts.append(started)
        return modelled(op, nbytes, group, peers, started)

    comm.modelled_seconds = logged
    strategy = ddp.DDP(ddp.DDPConfig(bucket_cap_mb=0.01), tiny_setup(rank, world, comm=comm))
    for step in range(2):
        strategy.train_step(tiny_batch(2 * step + rank))
    seconds = [r.seconds for r in comm.ledger.records if r.op == "all_reduce"]
    return reached, starts, seconds


@pytest.mark.timeout(120)
def test_an_emulated_bucket_starts_its_link_when_the_device_reaches_it():
    """Issue 46: on CUDA the host queues a bucket while the GPU still computes it; the
    emulated link started at the host's queueing, so the modelled transfer overlapped
    kernels that had not run and DDP was favoured. Now each bucket's link starts when the
    device has reached it (`device_reached`, an event on CUDA; a 50 ms stand-in here),
    in launch order, and the bucket completes no earlier."""
    for reached, starts, seconds in run_distributed(_emulated_ddp_behind_the_host, 2,
                                                    timeout=100):
        assert len(reached) > 2 and len(starts) == len(reached)
        assert all(s >= r for s, r in zip(starts, reached, strict=True))
        assert starts == sorted(starts)
        assert seconds and min(seconds) >= 0.05


# ------------------------------------------------------------------ warm-up


FIRST_STEP_S = 0.6
"""Seconds the warm-up test strategy's first step of each process sleeps (a compile)."""


def _warmup_runs(rank, world, run_dir):
    import os
    from dataclasses import dataclass

    from algorithms.base import STRATEGIES, StepStats, Strategy, StrategyConfig
    from bench.config import load_config
    from bench.run.train import Trainer
    from tests.helpers import IdleStrategy, burn_cpu

    @dataclass
    class SlowStartConfig(StrategyConfig):
        name: str = "slow-start"

    class SlowStart(IdleStrategy, Strategy):
        Config = SlowStartConfig
        steps_here = 0

        def train_step(self, batch):
            if self.steps_here == 0:
                burn_cpu(FIRST_STEP_S)
            self.steps_here += 1
            self.comm.all_reduce(torch.ones(4))
            return StepStats(loss=1.0, tokens=batch[1].numel())

    globals()["SlowStart"] = SlowStart  # registered by name in this rank's process only
    STRATEGIES["slow-start"] = f"{__name__}:SlowStart"
    def config(*more):
        cfg = load_config("configs/ddp-tiny.yaml", [
            "run.steps=6", "run.log_every=2", "run.val_every=3", "run.val_sequences=8",
            "run.target_loss=100", "checkpoint.every=4", "checkpoint.final=false",
            "parallel.world_size=2", "network.profiles=[nvlink]", *more])
        cfg.strategy = SlowStartConfig()
        return cfg

    cfg = config()
    straight = Trainer(cfg, Path(run_dir), torch.device("cpu"), "gloo").run()
    os.environ["COMMBENCH_RESUME"] = "1"  # resume from step 4: a new process warms up again
    try:
        resumed = Trainer(cfg, Path(run_dir), torch.device("cpu"), "gloo").run()
    finally:
        del os.environ["COMMBENCH_RESUME"]
    # three warm-up steps, a metrics row after each: every settle inside the warm-up
    longer = Trainer(config("run.warmup_steps=3", "run.log_every=1"), Path(run_dir) / "w3",
                     torch.device("cpu"), "gloo").run()
    return straight, resumed, longer


@pytest.mark.timeout(150)
def test_warmup_is_recorded_apart_and_left_out_of_throughput(tmp_path):
    """Step 0 holds compile and communicator creation: on the clock (a user waits for it)
    but recorded apart, and throughput is the steady state's. A resume warms up again."""
    for straight, resumed, longer in run_distributed(_warmup_runs, 2, str(tmp_path),
                                                     timeout=130):
        per_step = straight["total_tokens"] // 6
        assert straight["warmup_steps"] == 1 and straight["warmup_tokens"] == per_step
        assert straight["warmup_s"] >= FIRST_STEP_S and straight["wall_s"] > straight["warmup_s"]
        steady_s = straight["wall_s"] - straight["warmup_s"]
        assert straight["throughput_tokens_per_s"] == pytest.approx(5 * per_step / steady_s)
        assert straight["time_to_target_steady_s"] == pytest.approx(
            straight["time_to_target_s"] - straight["warmup_s"])
        nvlink = straight["projected"]["nvlink"]
        assert nvlink["warmup_s"] >= FIRST_STEP_S
        assert nvlink["throughput_tokens_per_s"] == pytest.approx(
            5 * per_step / (nvlink["total_s"] - nvlink["warmup_s"]))
        assert resumed["warmup_steps"] == 2 and resumed["warmup_tokens"] == 2 * per_step
        assert resumed["warmup_s"] >= 2 * FIRST_STEP_S
        # warm-up windows cut by metrics rows still count as warm-up (they counted as
        # steady state, and warmup_s held only the last window's seconds)
        assert longer["warmup_steps"] == 3 and longer["warmup_tokens"] == 3 * per_step
        assert longer["warmup_s"] >= FIRST_STEP_S
        assert longer["throughput_tokens_per_s"] == pytest.approx(
            3 * per_step / (longer["wall_s"] - longer["warmup_s"]))


def _warm_up_groups(rank, world):
    import torch.distributed as dist

    comm = Communicator(rank, world, "cpu")
    blocks = [comm.new_group(r) for r in ([0, 1], [2, 3], [0, 2], [1, 3])]
    seen, real = [], dist.all_reduce

    def all_reduce(tensor, *args, group=None, **kwargs):
        seen.append(None if group is None else
                    next(b.ranks for b in blocks if b.pg is group))
        return real(tensor, *args, group=group, **kwargs)

    dist.all_reduce = all_reduce
    comm.warm_up()
    dist.all_reduce = real
    return seen, len(comm.ledger)


@pytest.mark.timeout(60)
def test_warm_up_creates_every_groups_communicator_in_creation_order():
    """NCCL creates a group's communicator at its first collective: DiLoCo's cross-replica
    group at its first outer step, inside a timed step. warm_up uses each group once,
    before step 0, in creation order (no deadlock), outside the ledger."""
    for rank, (seen, records) in enumerate(run_distributed(_warm_up_groups, 4, timeout=50)):
        mine = [b for b in ((0, 1), (2, 3), (0, 2), (1, 3)) if rank in b]
        assert seen == [*mine, None] and records == 0


# ------------------------------------------------------------------ MFU peak


@pytest.mark.parametrize("name,precision,tf32,peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", False, 989.5e12),
    ("NVIDIA H100 80GB HBM3", "fp32", False, 67e12),
    ("NVIDIA H100 80GB HBM3", "fp32", True, 494.5e12),
    ("NVIDIA H100 PCIe", "bf16", False, 756.5e12),
    ("NVIDIA H100 NVL", "bf16", False, 835.5e12),
    ("NVIDIA H200", "bf16", False, 989.5e12),
    ("NVIDIA H200 NVL", "fp32", False, 60e12),
    ("NVIDIA GH200 480GB", "bf16", False, 989.5e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", False, 312e12),
    ("NVIDIA A100 80GB PCIe", "fp32", False, 19.5e12),
    ("NVIDIA H100", "bf16", False, None),  # which H100? no peak rather than a wrong one
    ("NVIDIA H800", "bf16", False, None),
    ("NVIDIA GeForce RTX 4090", "bf16", False, None),
])
def test_mfu_peak_by_device_name_and_precision(name, precision, tf32, peak):
    """MFU divided by the bf16 peak whatever the precision, and "H100" matched PCIe and
    NVL parts with lower peaks."""
    from bench.env import peak_flops_of

    assert peak_flops_of(name, precision, tf32) == peak


def test_no_peak_on_cpu():
    from bench.env import peak_flops

    assert peak_flops(torch.device("cpu"), "bf16") is None


# ------------------------------------------------------------------ ZeRO host syncs


def _zero_item_calls(rank, world):
    from algorithms.ddp import DDP, DDPConfig

    calls, real = [], torch.Tensor.item

    def item(self):
        calls.append(self.numel())
        return real(self)

    counts = {}
    for microbatches in (1, 4):
        zero = DDP(DDPConfig(backend="deepspeed"), tiny_setup(
            rank, world, num_microbatches=microbatches))
        zero.train_step(tiny_batch(0))  # the first step learns; count the second
        torch.Tensor.item, calls[:] = item, []
        zero.train_step(tiny_batch(1))
        torch.Tensor.item = real
        counts[microbatches] = len(calls)
    return counts


@pytest.mark.slow  # a launch of ~10-50 s; tox -e slow
@pytest.mark.timeout(200)
def test_zero_engine_syncs_the_host_once_a_step_not_per_microbatch():
    pytest.importorskip("deepspeed")
    for counts in run_distributed(_zero_item_calls, 2, timeout=180):
        assert counts[4] == counts[1]


# ------------------------------------------------------------------ PipeDream p2p kinds


def stage_ops(stage, num_stages, microbatches, steps, delay):
    """What algorithms/pipedream.py does with `p2p_plan`, step by step: each op as the
    list of its parts (an exchange has two), ("send"|"recv", peer stage, message)."""
    from algorithms.schedule import actions, events, p2p_plan

    ops, held = [], None
    for k in range(steps):
        sends, exchanged = p2p_plan(stage, num_stages, microbatches, k, delay)
        for op, peer, message in events(stage, num_stages,
                                        actions(stage, num_stages, microbatches, k, delay)):
            if op == "send" and message in sends:
                assert held is None
                held = (peer, message)
            elif op == "send":
                ops.append([("send", peer, message)])
            elif message in exchanged:
                assert held is not None and held[0] == peer
                ops.append([("send", *held), ("recv", peer, message)])
                held = None
            else:
                ops.append([("recv", peer, message)])
    return ops


def rendezvous(ops: dict[int, list]) -> dict[int, int]:
    """Run every stage's ops where each part completes only when the peer's current op
    holds the matching part (NCCL at worst: a send waits for its receive). Returns the ops
    left per stage (empty: no deadlock)."""
    heads = dict.fromkeys(ops, 0)
    done = {s: set() for s in ops}
    moved = True
    while moved:
        moved = False
        for s in ops:
            if heads[s] == len(ops[s]):
                continue
            for i, (op, peer, message) in enumerate(ops[s][heads[s]]):
                if (heads[s], i) in done[s] or heads[peer] == len(ops[peer]):
                    continue
                want = "recv" if op == "send" else "send"
                for k, part in enumerate(ops[peer][heads[peer]]):
                    if part == (want, s, message) and (heads[peer], k) not in done[peer]:
                        done[s].add((heads[s], i))
                        done[peer].add((heads[peer], k))
                        moved = True
            for t in ops:
                while heads[t] < len(ops[t]) and all(
                        (heads[t], i) in done[t] for i in range(len(ops[t][heads[t]]))):
                    heads[t] += 1
                    moved = True
    return {s: len(ops[s]) - heads[s] for s in ops if heads[s] < len(ops[s])}


@pytest.mark.parametrize("delay", [0, 1])
def test_p2p_plan_sends_and_receives_each_message_with_one_op_kind(delay):
    """Every (stages, microbatches) the schema accepts, up to 8 stages and 12 microbatches
    (delay 1 needs M >= S - 1), 4 steps: each message is sent and received with the same
    op kind (batched or plain: different NCCL communicators otherwise, a hang), and the
    ops complete even if every send waits for its receive. delay 0 with M < S mixed them."""
    checked = 0
    for S in range(2, 9):
        for M in range(1, 13):
            if delay and M < S - 1:
                continue
            ops = {s: stage_ops(s, S, M, 4, delay) for s in range(S)}
            kinds = {}  # (direction, message) -> batched?
            for seq in ops.values():
                for op in seq:
                    for part, _, message in op:
                        kinds.setdefault(message, {})[part] = len(op) > 1
            for message, sides in kinds.items():
                if len(sides) == 2:  # the last step's held gradient is never received
                    assert sides["send"] == sides["recv"], (S, M, message)
            assert rendezvous(ops) == {}, (S, M)
            checked += 1
    assert checked == (84 if delay == 0 else 63)


class RecordingComm(Communicator):
    """Notes the op kind of each point-to-point message (exchange = batched)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.p2p: list[tuple[str, str, int]] = []

    def send(self, tensor, dst):
        self.p2p.append(("plain", "send", dst))
        super().send(tensor, dst)

    def recv(self, tensor, src):
        self.p2p.append(("plain", "recv", src))
        return super().recv(tensor, src)

    def exchange(self, sends, recvs):
        for peer in sends:
            self.p2p.append(("batched", "send", peer))
        for peer in recvs:
            self.p2p.append(("batched", "recv", peer))
        super().exchange(sends, recvs)


def _pipedream_op_kinds(rank, world, microbatches, delay):
    from algorithms.pipedream import PipeDream2BW, PipeDreamConfig

    comm = RecordingComm(rank, world, "cpu")
    strategy = PipeDream2BW(PipeDreamConfig(delay=delay), tiny_setup(
        rank, world, model=tiny_gpt(n_layer=world), comm=comm, num_stages=world,
        num_microbatches=microbatches, rank_batch_size=6))
    for step in range(3):
        strategy.train_step(tiny_batch(step, rows=6))
    return comm.p2p


@pytest.mark.timeout(120)
@pytest.mark.parametrize("microbatches,delay", [
    pytest.param(1, 0, marks=pytest.mark.slow), pytest.param(2, 0, marks=pytest.mark.slow),
    (2, 1)])
def test_pipedream_executor_uses_one_op_kind_per_message(microbatches, delay):
    """The real executor on 3 gloo ranks (gloo tolerates a mix; NCCL hangs): the i-th
    message from rank a to rank b is sent and received with the same kind of op."""
    per_rank = run_distributed(_pipedream_op_kinds, 3, microbatches, delay, timeout=100)
    for a in range(3):
        for b in range(3):
            sent = [kind for kind, op, peer in per_rank[a] if op == "send" and peer == b]
            received = [kind for kind, op, peer in per_rank[b] if op == "recv" and peer == a]
            assert sent[:len(received)] == received, (a, b)


# ------------------------------------------------------------------ netprobe on NCCL


def test_netprobe_nccl_sets_the_local_gpu_and_puts_tensors_on_it(monkeypatch):
    """`netprobe --backend nccl` probed with CPU tensors and never called set_device
    (NCCL moves CUDA tensors only; every rank would share GPU 0)."""
    from bench.node import netprobe

    assert netprobe.probe_device("gloo") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--backend nccl needs a CUDA device"):
        netprobe.probe_device("nccl")
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert netprobe.probe_device("nccl") == torch.device("cuda", 3) == chosen[0]


def test_netprobe_nccl_refused_without_a_gpu_per_rank(capsys):
    from bench.cli import main

    assert main(["netprobe", "--backend", "nccl", "--world-size", "2"]) == 2
    assert "one per GPU" in capsys.readouterr().err


# ------------------------------------------------------------------ checkpoints


class ExportOnly:
    """A strategy stand-in for the checkpoint functions: its state, its export, its device,
    and what a checkpoint records of its layout (bench/run/dcp_state.py `layout_of`)."""

    def __init__(self, rank, world, device="cpu"):
        from types import SimpleNamespace

        self.comm = Communicator(rank, world, device)
        self.rank = rank
        self.setup = SimpleNamespace(group_size=1, num_stages=1, shard="none",
                                     rank_batch_size=4)

    def data_shard(self):
        return self.rank, self.comm.world_size

    def state_scopes(self):
        return {}

    def export_state(self):
        # rank r holds "w{r}"; every rank also offers "shared" (rank 0's wins)
        return {f"w{self.rank}": torch.full((2,), float(self.rank)),
                "shared": torch.full((1,), float(self.rank))}

    def state_dict(self):
        return {"w": torch.ones(1)}

    def load_state_dict(self, state):
        self.loaded = state


def _final_export(rank, world, run_dir):
    import torch.distributed as dist

    from bench.run import checkpoint
    from bench.run.records import RunDir

    def refuse(*args, **kwargs):
        raise AssertionError("all_gather_object: every rank would hold every part")

    dist.all_gather_object = refuse
    run = RunDir(run_dir)
    run.prepare()
    group = checkpoint.barrier_group(60)
    checkpoint.save_eval_model(run, rank, ExportOnly(rank, world), {"n_layer": 1}, "byte", 3,
                               group)
    return run.final_checkpoint.exists()  # every rank returns after rank 0 has written


@pytest.mark.slow  # a launch of ~10-50 s; tox -e slow
@pytest.mark.timeout(60)
def test_final_export_gathers_on_rank_0_only(tmp_path):
    assert run_distributed(_final_export, 3, str(tmp_path), timeout=50) == [True] * 3
    saved = torch.load(tmp_path / "checkpoints" / "final.pt", weights_only=False)
    assert sorted(saved["model"]) == ["shared", "w0", "w1", "w2"]
    assert saved["model"]["shared"].item() == 0.0 and saved["model"]["w2"].tolist() == [2, 2]


def _slow_checkpoint_write(rank, world, run_dir, on_training_group):
    import os
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from algorithms.comm import CommLedger
    from bench.run import checkpoint, dcp_state
    from bench.run.records import RunDir

    # the training group times out after 2 s, as parallel.timeout_s would
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, is_master=False)
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("short", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=2))
    run = RunDir(run_dir)
    run.prepare()
    if rank == 1:  # a slow filesystem: this rank's DCP write takes longer than the timeout
        class SlowWriter(dcp_state.FileSystemWriter):
            def write_data(self, plan, planner):
                time.sleep(5)
                return super().write_data(plan, planner)
        dcp_state.FileSystemWriter = SlowWriter
    # checkpoint.timeout_s's group, or (the failure this guards against) the training group
    group = None if on_training_group else checkpoint.barrier_group(60)
    started = time.monotonic()
    try:
        checkpoint.save_state(run, rank, 4, ExportOnly(rank, world), CommLedger(), {}, group)
    except Exception as err:
        return f"{type(err).__name__}: {err}"[:2000], time.monotonic() - started
    found = dcp_state.latest(run)
    return found is not None and found[1]["step"] == 4, time.monotonic() - started


@pytest.mark.slow  # two launches of ~20-40 s each; tox -e slow
@pytest.mark.timeout(240)
def test_checkpoint_waits_have_their_own_timeout(tmp_path):
    """A multi-GB state written slower than parallel.timeout_s timed the other ranks out
    in the collectives of the save (DCP's gathers, the completion barrier); they wait on
    a group with checkpoint.timeout_s. Rank 1's DCP write is slowed by 5 s against a 2 s
    training-group timeout: the save completes on both ranks, and the same save on the
    training group times rank 0 out (so the slowdown lands where the waits are)."""
    results = run_distributed(_slow_checkpoint_write, 2, str(tmp_path / "own"), False,
                              timeout=110)
    assert [ok for ok, _ in results] == [True, True]
    assert all(seconds >= 5 for _, seconds in results)  # rank 0 waited for rank 1's write
    results = run_distributed(_slow_checkpoint_write, 2, str(tmp_path / "short"), True,
                              timeout=110)
    error, seconds = results[0]
    assert isinstance(error, str) and "timed out" in error.lower(), error
    assert seconds < 5  # timed out by the 2 s group, before rank 1's write ended


def _cuda_rng_round_trip(rank, world, run_dir):
    import os

    from algorithms.comm import CommLedger
    from bench.run import checkpoint
    from bench.run.records import RunDir

    gpu = torch.device("cuda", 0)
    saved_state, restored = torch.arange(4, dtype=torch.uint8), []
    torch.cuda.get_rng_state = lambda device: saved_state if device == gpu else None
    torch.cuda.set_rng_state = lambda state, device: restored.append((state.tolist(), device))
    run = RunDir(run_dir)
    run.prepare()
    strategy = ExportOnly(rank, world, device=gpu)
    checkpoint.save_state(run, rank, 2, strategy, CommLedger(), {"step": 2})
    os.environ["COMMBENCH_RESUME"] = "1"
    checkpoint.load_state(run, rank, strategy, CommLedger())
    return restored


def test_checkpoint_carries_the_cuda_generator(tmp_path):
    """Dropout on CUDA draws from the device's generator: without it in the checkpoint a
    resumed run is not bit-exact (mocked torch.cuda: the code path that runs on a GPU)."""
    assert run_distributed(_cuda_rng_round_trip, 1, str(tmp_path), timeout=50) == [
        [([0, 1, 2, 3], torch.device("cuda", 0))]]


# ------------------------------------------------------------------ launching on GPUs


def fake_cuda(monkeypatch, count: int) -> None:
    """This machine as a GPU node with `count` devices (for the checks that read it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_more_ranks_per_node_than_gpus_is_refused_where_torchrun_starts(monkeypatch):
    from bench.config import load_config
    from bench.config.preflight import check_device, check_gpus

    fake_cuda(monkeypatch, 4)
    eight = load_config("configs/ddp-tiny.yaml", ["parallel.world_size=8"])
    with pytest.raises(ValueError, match=r"world_size 8 / launch.nnodes 1 = 8 ranks per node, "
                                         r"one GPU each, but this node has 4 GPUs"):
        check_device(eight)
    check_gpus(load_config("configs/ddp-tiny.yaml", [  # 2 nodes x 4 ranks fit
        "parallel.world_size=8", "launch.nnodes=2", "launch.rdzv_endpoint=h:1"]))
    with pytest.raises(ValueError, match=r"launch.cuda_visible_devices '0,1' has 2 GPUs"):
        check_gpus(load_config("configs/ddp-tiny.yaml", [
            "parallel.world_size=4", "launch.cuda_visible_devices='0,1'"]))
    cpu = load_config("configs/ddp-tiny.yaml", ["parallel.world_size=8", "parallel.device=cpu"])
    check_gpus(cpu)  # CPU ranks need no GPU


def test_gloo_with_cuda_tensors_is_refused():
    assert_bad_config("configs/2bw-tiny.yaml", ["parallel.backend=gloo", "parallel.device=cuda"],
                      "parallel.backend 'gloo'", "parallel.device cuda", "send or receive")


def test_gloo_on_a_gpu_machine_with_device_auto_is_refused(monkeypatch):
    from bench.config import load_config
    from bench.config.preflight import check_device

    fake_cuda(monkeypatch, 4)
    with pytest.raises(ValueError, match="gloo cannot send"):
        check_device(load_config("configs/ddp-tiny.yaml", ["parallel.backend=gloo"]))


@pytest.mark.timeout(60)
def test_parallel_local_runs_get_disjoint_gpus(monkeypatch):
    """Concurrent local runs each started torchrun on GPUs 0..n-1: all on the same GPUs."""
    import threading
    import time

    from bench.config import load_config
    from bench.launch.executors import Task, _run_local, gpu_blocks

    fake_cuda(monkeypatch, 5)
    configs = [load_config("configs/ddp-tiny.yaml", ["parallel.world_size=2",
                                                     f"run.seed={seed}"]) for seed in range(4)]
    assert gpu_blocks(configs, 1) is None  # one at a time: the environment's GPUs
    assert gpu_blocks(configs, 3) == ["0,1", "2,3"]  # GPU 4 left over
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert gpu_blocks(configs, 3) == ["4,5", "6,7"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_blocks(configs, 3) is None  # CPU runs

    running, seen, lock = set(), [], threading.Lock()

    def runner(cfg, run_dir, progress=False):
        block = cfg.launch.cuda_visible_devices
        with lock:
            assert block not in running, f"two runs on GPUs {block}"
            running.add(block)
            seen.append(block)
        time.sleep(0.05)
        with lock:
            running.discard(block)
        return {"status": "ok"}

    class Quiet:
        live = False

        def start(self, task, note=""):
            pass

        def finish(self, task, summary):
            pass

    todo = [Task(str(c.run.seed), c, Path(f"/nonexistent/{i}"), str(i))
            for i, c in enumerate(configs)]
    summaries = _run_local(todo, runner, 3, Quiet(), ["4,5", "6,7"])
    assert len(summaries) == 4 and sorted(set(seen)) == ["4,5", "6,7"]

    # A run that fails before training gives its GPUs back, so the sweep ends with its
    # error (a block lost to an exception left the run beside it waiting for ever).
    class Broken(Quiet):
        def start(self, task, note=""):
            if task.run_id in ("0", "1"):  # both blocks: the next run waits for one
                raise OSError("the terminal went away")

    with pytest.raises(OSError, match="terminal"):
        _run_local(todo, runner, 2, Broken(), ["4,5", "6,7"])


def test_data_prepare_without_output_fills_the_runs_cache(tmp_path, monkeypatch, capsys):
    """`commbench data prepare NAME` without -o crashed (Path(None)): the Slurm example's
    first command. It tokenises into the cache a run with data.corpus NAME reads."""
    from bench.cli import main
    from bench.data import cached_corpus

    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["data", "prepare", "embedded", "--tokenizer", "byte"]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed.parent == tmp_path / ".cache" / "commbench"
    assert (printed / "meta.json").exists()
    assert cached_corpus("embedded", "byte", "~/.cache/commbench") == printed  # no re-tokenise


def test_the_launcher_tokenises_before_the_ranks_start(tmp_path, monkeypatch):
    """Rank 0 tokenised a large corpus while the others waited in a barrier and timed out
    (parallel.timeout_s): sweeps and Slurm jobs reach the ranks without a preflight."""
    from bench.config import load_config
    from bench.launch import run as launch

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question. " * 400)
    cache = tmp_path / "cache"
    cfg = load_config("configs/ddp-tiny.yaml", [
        f"data.corpus={corpus}", f"data.cache_dir={cache}", "parallel.world_size=1",
        "model.seq_len=16", f"run.output_dir={tmp_path / 'results'}"])
    seen = []

    def torchrun(cmd, env, run, progress, start_timeout_s):
        seen.append(sorted(p.name for p in cache.glob("*/meta.json")))
        return 1, ["torchrun exited"], None

    monkeypatch.setattr(launch, "_run_torchrun", torchrun)
    launch.run_config(cfg, tmp_path / "run", progress=False)
    assert seen == [["meta.json"]]  # the cache was filled before torchrun started


# ------------------------------------------------------------------ diagnostics


NCCL_TIMEOUT_LOG = """\
/usr/bin/python -m torch.distributed.run --nproc-per-node=4 --standalone -m bench.run.train run
[rank0]:[E1124 10:02:00.1 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=57, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=120000) ran for 120038 milliseconds before timing out.
[rank0]:[E1124 10:02:00.2 ProcessGroupNCCL.cpp:2268] [PG ID 0 PG GUID 0(default_pg) Rank 0]  failure detected by watchdog at work sequence id: 57 PG status: last enqueued work: 57, last completed work: 56
[rank1]:[E1124 10:02:00.3 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=57, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=120000) ran for 120041 milliseconds before timing out.
[rank3]:[E1124 10:02:00.4 ProcessGroupNCCL.cpp:632] [Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=57, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=120000) ran for 120044 milliseconds before timing out.
[rank0]:[F1124 10:02:01.0 ProcessGroupNCCL.cpp:1614] [PG ID 0 PG GUID 0(default_pg) Rank 0] Terminating the process after attempting to dump debug info, due to collective timeout or exception.
W1124 10:02:02.0 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 1235 closing signal SIGTERM
W1124 10:02:02.0 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 1236 closing signal SIGTERM
W1124 10:02:02.0 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 1237 closing signal SIGTERM
E1124 10:02:03.0 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: -6) local_rank: 0 (pid: 1234) of binary: /usr/bin/python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
bench.run.train FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-24_10:02:03
  host      : gpu-node-1
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 1234)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 1234
============================================================"""


def test_nccl_watchdog_abort_names_the_hung_rank_not_the_first_victim(tmp_path):
    """Rank 2 never reached the all-reduce; the others' watchdogs aborted them (SIGABRT),
    and torchrun's root cause was rank 0, which the headline used to blame."""
    from bench.launch.failure import error_text
    from bench.run.records import RunDir

    run = RunDir(tmp_path)
    run.prepare()
    run.torchrun_log.write_text("earlier attempt\n[Rank 2] Watchdog caught collective "
                                "operation timeout\n" + NCCL_TIMEOUT_LOG)
    tail = NCCL_TIMEOUT_LOG.splitlines()[-14:]  # the ranks' lines scrolled out of the tail
    headline = error_text(run, 1, tail, 4, 120).splitlines()[0]
    assert headline.startswith("rank 2 stopped responding"), headline
    assert "ranks 0, 1, 3 timed out after 120 s (parallel.timeout_s)" in headline
    assert "NCCL watchdog" in headline


def test_a_sigabrt_without_a_watchdog_timeout_is_still_the_culprit(tmp_path):
    from bench.launch.failure import error_text
    from bench.run.records import RunDir

    run = RunDir(tmp_path)
    run.prepare()
    tail = [line for line in NCCL_TIMEOUT_LOG.splitlines() if "Watchdog" not in line]
    run.torchrun_log.write_text("\n".join(tail))
    assert error_text(run, 1, tail, 4, 120).startswith("rank 0: killed by SIGABRT")


def test_self_evaluation_runs_on_the_runs_device(monkeypatch):
    """Self-evaluation after `commbench run` always ran lm-eval on the CPU."""
    from bench.config import load_config
    from eval.runner import eval_device

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = load_config("configs/ddp-tiny.yaml")
    assert eval_device(cfg) == "cpu"
    fake_cuda(monkeypatch, 8)
    assert eval_device(cfg) == "cuda"
    mine = load_config("configs/ddp-tiny.yaml", ["launch.cuda_visible_devices='6,7'"])
    assert eval_device(mine) == "cuda:6"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # as this process numbers them
    assert eval_device(mine) == "cuda:2"
    assert eval_device(load_config("configs/ddp-tiny.yaml", ["parallel.device=cpu"])) == "cpu"


# ------------------------------------------------------------------ bounded ledger


def test_ledger_keeps_bounded_aggregates_and_one_window_of_records():
    """The ledger's list grew with every op of the run and was pickled into every
    checkpoint. Trimmed each step it holds one window; the aggregates (comm.jsonl, bytes
    sent per peer) equal those of a ledger that kept every record."""
    import pickle

    from algorithms.comm import CommLedger, CommRecord

    def record(step, i):
        if i % 3 == 0:
            return CommRecord(step, "train", "exchange", 3, (1, 2), 30 + i, 0.1, "inter",
                              peer_nbytes=(10, 20 + i))
        if i % 3 == 1:
            return CommRecord(step, "train", "send", 2, (1,), 7, 0.2, "intra")
        return CommRecord(step, "outer", "all_reduce", 4, None, 400, 0.3 + i, "inter")

    full, bounded = CommLedger(keep_records=True), CommLedger()
    sizes = {}
    for step in range(200):
        bounded.trim()
        full.trim()  # a no-op with keep_records
        for i in range(5):
            full.add(record(step, i))
            bounded.add(record(step, i))
        assert len(bounded) == 5
        if step in (9, 199):
            sizes[step] = len(pickle.dumps(bounded.state_dict()))
    assert len(full) == 1000
    assert bounded.aggregate() == full.aggregate()
    per_step = {1: 10 + 7 + 10 + 7, 2: 20 + 23}  # records 0-4: exchange, send, -, exchange, send
    assert bounded.bytes_sent("train") == full.bytes_sent("train") == {
        peer: 200 * n for peer, n in per_step.items()}
    # the checkpointed state does not grow with the run (but for its counters' digits)
    assert sizes[199] < sizes[9] + 64 < len(pickle.dumps(full.records)) / 100
    restored = CommLedger()
    restored.load_state_dict(bounded.state_dict())
    assert restored.aggregate() == full.aggregate() and len(restored) == 0
    older = CommLedger()  # a checkpoint written before: the list of records
    older.load_state_dict(full.records)
    assert older.aggregate() == full.aggregate() and len(older) == 0


def _ledger_runs(rank, world, run_dir):
    import json

    from bench.config import load_config
    from bench.run import dcp_state
    from bench.run.records import RunDir
    from bench.run.train import Trainer

    out = {}
    for name, config, extra in [("ddp", "configs/ddp-tiny.yaml", []),
                                ("2bw", "configs/2bw-tiny.yaml", ["parallel.num_stages=2"])]:
        for keep in (True, False):
            cfg = load_config(config, [
                "run.steps=5", "run.log_every=2", "run.val_every=0", "run.val_sequences=8",
                "checkpoint.every=2", "checkpoint.final=false", "parallel.world_size=2",
                "model.n_layer=2", "model.seq_len=32", *extra])
            path = Path(run_dir) / f"{name}-{keep}"
            trainer = Trainer(cfg, path, torch.device("cpu"), "gloo", keep_records=keep)
            summary = trainer.run()
            trainer.strategy.close()
            keys = ("comm_bytes_total", "comm_wire_bytes_total", "projected",
                    "activation_bytes_per_boundary")
            saved = dcp_state.read(dcp_state.latest(RunDir(path))[0], rank)["own"]
            comm_rows = [json.loads(line) for line in RunDir(path).comm.read_text().splitlines()]
            out[name, keep] = ({k: summary.get(k) for k in keys},
                               [{k: v for k, v in row.items() if k != "seconds"}
                                for row in comm_rows] if rank == 0 else None,
                               len(trainer.ledger.records), type(saved["ledger"]).__name__)
    return out


@pytest.mark.timeout(240)
def test_the_loop_reads_the_same_figures_from_the_bounded_ledger(tmp_path):
    for out in run_distributed(_ledger_runs, 2, str(tmp_path), timeout=220):
        for name in ("ddp", "2bw"):
            (kept, kept_rows, kept_len, _), (bounded, rows, held, saved) = (
                out[name, True], out[name, False])
            for key in ("comm_bytes_total", "comm_wire_bytes_total",
                        "activation_bytes_per_boundary"):
                assert bounded[key] == kept[key], (name, key)
            assert bounded["projected"].keys() == kept["projected"].keys()
            assert rows == kept_rows  # comm.jsonl, but the measured seconds
            assert held < kept_len and saved == "dict"  # one step's window; aggregates saved


def test_progress_line_shows_the_windows_rate_not_the_warm_ups():
    """A run whose warm-up (compile, NCCL's set-up) took seconds: the progress line's tok/s
    is the rate of the steps since the previous row (1,024 tokens a step at 8 ms), not the
    run's average so far (20,480 tokens over 1.77 s: 11,587), which read 70x low on a GPU."""
    from bench.run.summary import progress_line, train_row

    row = train_row(step=20, tokens=20480, elapsed_s=1.7675, projected_elapsed_s={}, lr=0.0,
                    loss=3.5, step_s=0.008, compute_s=0.006, comm_s=0.002, comm_bytes=0.0)
    assert progress_line(row, 40) == "PROGRESS step 20/40 loss 3.5000 tok/s 128,000 comm 25%"
    assert "tok/s 0 " in progress_line(dict(row, step_s=0.0), 40)  # an empty window
