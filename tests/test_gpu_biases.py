"""Issue 46's findings on the multi-GPU path, checked on CPU: what a run across ranks would hit.

    pytest tests/test_gpu_biases.py

Each test fails on the code before its fix through the same code path: real gloo ranks
(tests/distributed.py) where the bug is in the exchange itself, stand-ins for what needs
CUDA or NCCL (a crafted watchdog log, a recording compile function or communicator, the
fake stream clock of tests/test_gpu_path.py).
"""

from __future__ import annotations

import pytest
import torch

from algorithms.comm import CommLedger, Communicator
from algorithms.compress import TopK
from tests.distributed import run_distributed

# ------------------------------------------------------------------ top-k with a half dtype


CASES = [(dtype, k) for dtype in (torch.bfloat16, torch.float16) for k in (3, 5)]


def _sparse_half(rank, world_size):
    comm = Communicator(rank, world_size, "cpu", CommLedger(keep_records=True))
    out = []
    for dtype, k in CASES:
        x = torch.randn(41, generator=torch.Generator().manual_seed(rank))
        indices, values, _ = TopK(k / 41, dtype).select(x, None)
        assert values.numel() == k
        out.append((indices, values, comm.average_sparse(indices, values, 41)))
    return out


@pytest.mark.timeout(60)
def test_topk_exchange_with_a_half_dtype_and_odd_k():
    """The all-gathered payload (values, then int32 indices) put the indices at byte
    2k of each rank's part, and rank 1's part at byte 6k: not divisible by 4 when k is
    odd, so viewing them as int32 raised at the first outer step (any device)."""
    results = run_distributed(_sparse_half, 3, timeout=50)
    for case in range(len(CASES)):
        expected = torch.zeros(41)
        for rank_results in results:
            indices, values, _ = rank_results[case]
            expected.index_add_(0, indices.long(), values.float())
        for rank_results in results:
            assert torch.equal(rank_results[case][2], expected / 3), CASES[case]


# ------------------------------------------------------------------ NCCL watchdog on a subgroup

# World of 4 (DiLoCo, group_size 2: replicas {0, 1}, {2, 3}; cross groups {0, 2}, {1, 3}).
# Rank 3 froze; ranks 0, 1, 2 timed out in subgroups where each is group rank 0, and the
# bracket's `Rank N` is that group rank: only the `[rankN]:` prefix is the global rank.
SUBGROUP_TIMEOUT_LOG = """\
/usr/bin/python -m torch.distributed.run --nproc-per-node=4 --standalone -m bench.run.train run
[rank1]:[E1128 10:02:00.1 ProcessGroupNCCL.cpp:632] [PG ID 2 PG GUID 2 Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=4096, NumelOut=4096, Timeout(ms)=120000) ran for 120038 milliseconds before timing out.
[rank0]:[E1128 10:02:05.1 ProcessGroupNCCL.cpp:632] [PG ID 3 PG GUID 3 Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=40, OpType=ALLREDUCE, NumelIn=8192, NumelOut=8192, Timeout(ms)=120000) ran for 120012 milliseconds before timing out.
[rank2]:[E1128 10:02:05.2 ProcessGroupNCCL.cpp:632] [PG ID 4 PG GUID 4 Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=40, OpType=ALLREDUCE, NumelIn=8192, NumelOut=8192, Timeout(ms)=120000) ran for 120015 milliseconds before timing out.
[rank1]:[F1128 10:02:06.0 ProcessGroupNCCL.cpp:1614] [PG ID 2 PG GUID 2 Rank 0] Terminating the process after attempting to dump debug info, due to collective timeout or exception.
W1128 10:02:07.0 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 1234 closing signal SIGTERM
W1128 10:02:07.0 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 1236 closing signal SIGTERM
W1128 10:02:07.0 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 1237 closing signal SIGTERM
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
bench.run.train FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_10:02:07
  host      : gpu-node-1
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 1235)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 1235
============================================================"""


def test_nccl_watchdog_on_a_subgroup_names_global_ranks(tmp_path):
    """The parser read the bracket's group rank as the global one: {0} timed out, ranks 1, 2,
    3 'stopped responding', and rank 1's SIGABRT was not recognised as a watchdog abort,
    so the headline blamed rank 1 ('killed by SIGABRT'). Rank 3 is the one that froze."""
    from bench.launch.failure import error_text, nccl_timeouts
    from bench.run.records import RunDir

    lines = SUBGROUP_TIMEOUT_LOG.splitlines()
    assert nccl_timeouts(lines) == {0, 1, 2}
    run = RunDir(tmp_path)
    run.prepare()
    run.torchrun_log.write_text(SUBGROUP_TIMEOUT_LOG)
    headline = error_text(run, 1, lines[-14:], 4, 120).splitlines()[0]
    assert headline.startswith("rank 3 stopped responding"), headline
    assert "ranks 0, 1, 2 timed out after 120 s" in headline


def test_a_watchdog_line_without_the_global_prefix_counts_only_on_the_world():
    from bench.launch.failure import nccl_timeouts

    line = ("[E1128 10:02:00.1 ProcessGroupNCCL.cpp:632] [PG ID {} PG GUID {} Rank 1] Watchdog "
            "caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE)")
    assert nccl_timeouts([line.format(0, "0(default_pg)")]) == {1}
    assert nccl_timeouts([line.format(2, 2)]) == set()  # group rank 1 of which ranks?


# ------------------------------------------------------------------ Pier under model.compile


class CompileClock:
    """A stand-in `TrainSetup.compile`: torch.compile returns a wrapper at once and compiles
    at the wrapper's first calls (forward, then backward). This records, for each module it
    is given, when it was given it and when its wrapper was first called, as the loop's
    phase (`now`: "warm_up", or "step N")."""

    def __init__(self):
        self.now, self.events = "built", []

    def __call__(self, module):
        self.events.append(("compile", type(module).__name__, self.now))
        return FirstCall(module, self)


class FirstCall(torch.nn.Module):
    def __init__(self, module, clock: CompileClock):
        super().__init__()
        self.inner, self.clock, self.called = module, clock, False

    def forward(self, *args):
        if not self.called:
            self.called = True
            self.clock.events.append(("first call", type(self.inner).__name__, self.clock.now))
        return self.inner(*args)


def _pier_compile_events(rank, world_size, group_size):
    from algorithms.pier import Pier, PierConfig
    from tests.test_gpu_path import tiny_batch, tiny_setup

    clock = CompileClock()
    setup = tiny_setup(rank, world_size, compile=clock, group_size=group_size,
                       total_steps=4, num_microbatches=2)
    pier = Pier(PierConfig(inner_steps=2, warmup_fraction=0.5, schedule="constant"), setup)
    clock.now = "warm_up"
    pier.warm_up(tiny_batch(0))
    for step in range(4):
        clock.now = f"step {step}"
        pier.comm.step = step
        pier.train_step(tiny_batch(step * world_size + rank))
    return clock.events


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,group_size", [(2, 1), (4, 2)])
def test_pier_compiles_both_of_its_modules_in_warm_up(world_size, group_size):
    """The lazy start trains the world DDP; at T_w (step 2) Pier switches to the group's
    model (a group DDP, or the bare model for group_size 1), which was compiled then,
    inside a timed step. Both are compiled and first called in the untimed warm-up."""
    for events in run_distributed(_pier_compile_events, world_size, group_size, timeout=100):
        compiled = sorted(name for what, name, _ in events if what == "compile")
        assert compiled == (["DistributedDataParallel", "GPT"] if group_size == 1
                            else ["DistributedDataParallel"] * 2), events
        assert len(events) == 4, events  # each compiled once and first called once
        assert {when for _, _, when in events} == {"warm_up"}, events


def _compiled_warm_up_changes_nothing(rank, world_size):
    from algorithms.pier import Pier, PierConfig
    from tests.test_gpu_path import CompileRecorder, tiny_batch, tiny_setup

    params = []
    for warm in (False, True):
        setup = tiny_setup(rank, world_size, compile=CompileRecorder(), total_steps=4,
                           num_microbatches=2)
        pier = Pier(PierConfig(inner_steps=2, warmup_fraction=0.5, schedule="constant"), setup)
        if warm:
            pier.warm_up(tiny_batch(0))
        for step in range(3):
            pier.comm.step = step
            pier.train_step(tiny_batch(step * world_size + rank))
        params.append([p.detach().clone() for p in pier.model.parameters()])
    return params


@pytest.mark.slow  # torch.compile (dynamo, eager backend) on 2 ranks: ~15 s
@pytest.mark.timeout(240)
def test_compiled_warm_up_leaves_the_trajectory_as_it_was():
    """Real torch.compile (eager backend) through Pier's warm-up, no_sync and the switch:
    the parameters after 3 steps are those of the run that compiled in its steps."""
    for cold, warm in run_distributed(_compiled_warm_up_changes_nothing, 2, timeout=220):
        assert all(torch.equal(a, b) for a, b in zip(cold, warm, strict=True))


# ------------------------------------------------------------------ NCCL's lazy connections


class CollectiveLog:
    """A recording stand-in under the Communicator: torch.distributed's collectives (as the
    outer exchanges call them) logged as (op, bytes, group's ranks) under the current
    `phase`, then run. NCCL sets each kind and size up at its first call: what the
    warm-up issues must cover what the timed steps will."""

    OPS = ("all_reduce", "all_to_all_single", "all_gather_into_tensor")

    def __init__(self):  # in a rank's own process: patches its torch.distributed
        import torch.distributed as dist

        self.phase, self.ops = "built", []
        for name in self.OPS:
            setattr(dist, name, self.wrap(name, getattr(dist, name)))

    def wrap(self, name, original):
        import torch.distributed as dist

        def logged(*args, group=None, **kwargs):
            tensor = args[0] if name == "all_reduce" else args[1]  # what this rank sends
            ranks = None if group is None else tuple(dist.get_process_group_ranks(group))
            self.ops.append((self.phase, name, tensor.numel() * tensor.element_size(), ranks))
            return original(*args, group=group, **kwargs)

        return logged

    def of(self, phase):
        return [op[1:] for op in self.ops if op[0] == phase]


OUTER_CASES = {
    "diloco": {},
    "diloco-bf16": {"outer_grad_dtype": "bf16"},
    "topk-bf16": {"outer_compression": "topk", "outer_grad_dtype": "bf16",
                  "topk_fraction": 0.0101},
    "int8": {"outer_compression": "int8", "compression_row": 64},
    "streaming": {"fragments": 2},
    "streaming-overlap": {"fragments": 2, "inner_steps": 4, "overlap_steps": 1},
    "pier": {"warmup_fraction": 0.5, "schedule": "constant"},
}


def _outer_warm_up_ops(rank, world_size, group_size, cases):
    from algorithms.diloco import DiLoCo, DiLoCoConfig
    from algorithms.pier import Pier, PierConfig
    from tests.test_gpu_path import tiny_batch, tiny_gpt, tiny_setup

    log = CollectiveLog()
    out = {}
    for name in cases:
        options = {"inner_steps": 2, **OUTER_CASES[name]}
        setup = tiny_setup(rank, world_size, model=tiny_gpt(n_layer=4), group_size=group_size,
                           total_steps=4, comm=Communicator(rank, world_size, "cpu",
                                                            CommLedger(keep_records=True)))
        strategy = (Pier(PierConfig(**options), setup) if name == "pier"
                    else DiLoCo(DiLoCoConfig(**options), setup))
        log.phase = f"{name} warm_up"
        strategy.warm_up(tiny_batch(0))
        recorded = len(strategy.comm.ledger)
        log.phase = f"{name} steps"
        for step in range(4):
            strategy.comm.step = step
            strategy.train_step(tiny_batch(step * world_size + rank))
        out[name] = log.of(f"{name} warm_up"), log.of(f"{name} steps"), recorded
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,group_size,cases", [
    (2, 1, list(OUTER_CASES)),
    pytest.param(4, 2, ["diloco", "streaming"], marks=pytest.mark.slow)])  # ~40 s
def test_warm_up_issues_every_outer_collective_at_full_size(world_size, group_size, cases):
    """DiLoCo, Streaming DiLoCo (with and without overlap) and Pier warmed up their DDP
    only: the first full-size outer all-reduce, all-to-all or all-gather connected inside
    the first timed outer step. Now the warm-up issues each of them once (same op, bytes
    and group as the steps' exchanges; each fragment size once) and records nothing."""
    results = run_distributed(_outer_warm_up_ops, world_size, group_size, cases, timeout=100)
    for out in results:
        for name in cases:
            warm, steps, recorded = out[name]
            assert recorded == 0, name
            assert steps and set(steps) <= set(warm), (name, warm, steps)
            if "overlap" not in name:  # overlap also warms its blocking sync's group
                assert set(warm) == set(steps), (name, warm, steps)


# ------------------------------------------------------------------ 2BW's device synchronises


def _synchronises_per_schedule(rank, world_size):
    from algorithms import pipeline
    from algorithms.clocks import HostClock
    from algorithms.pipedream import PipeDream2BW, PipeDreamConfig
    from algorithms.pipeline import Pipeline, PipelineConfig
    from tests.test_gpu_path import tiny_batch, tiny_setup

    events: list[str] = []

    class CountingClock(HostClock):  # the device clock's synchronise, counted
        def synchronize(self):
            events.append("clock")

    pipeline.clock_for = lambda device: CountingClock()  # this process only
    out = {}
    for name, make in [("2bw", lambda s: PipeDream2BW(PipeDreamConfig(delay=1), s)),
                       ("ours-1f1b", lambda s: PipeDream2BW(PipeDreamConfig(delay=0), s)),
                       ("torch-1f1b", lambda s: Pipeline(PipelineConfig(schedule="1f1b"), s))]:
        strategy = make(tiny_setup(rank, world_size, num_stages=2, num_microbatches=2))
        strategy.comm.synchronize = lambda: events.append("comm")  # torch.cuda.synchronize
        schedule, per_step = strategy.run_schedule, []

        def counted(batch, schedule=schedule, per_step=per_step):
            events.clear()
            result = schedule(batch)
            per_step.append(list(events))
            return result

        strategy.run_schedule = counted
        for step in range(3):
            strategy.comm.step = step
            strategy.train_step(tiny_batch(step))
        out[name] = per_step
    return out


@pytest.mark.timeout(120)
def test_2bw_synchronises_the_device_once_a_step_like_torchs_1f1b():
    """2BW's sends and receives went through the blocking Communicator ops: a device
    synchronise before each receive and around every op (5 or 6 a step on a rank of a
    2-stage pipeline of 2 microbatches), where torch's 1F1B queues its step and
    synchronises once, at the end, to read its event marks. Inside the schedule both now synchronise once a step."""
    for out in run_distributed(_synchronises_per_schedule, 2, timeout=100):
        for name, per_step in out.items():
            assert per_step == [["clock"]] * 3, (name, per_step)
