"""Sharded replicas (`parallel.shard: fsdp`, algorithms/shard.py) through the real loop.

    pytest tests/test_shard.py

Identities on the same data: FSDP2 DDP == torch DDP; sharded DiLoCo and Pier (each
replica an FSDP2 group) == the unsharded ones (DDP inside the group). Tolerance 1e-6
absolute with SGD: FSDP2 reduce-scatters with its own pre/post division factors and the
sharded clip sums squared shard norms, in other orders than DDP's bucketed all-reduce and
torch's clip_grad_norm_, so the last float32 bits differ (AdamW would magnify the
rounding of near-zero gradients into lr-sized steps; parameters move by > 1e-3 here).
The ledger holds FSDP's all-gathers and reduce-scatters, and a sharded outer step moves
exactly |θ| bytes per replica (|θ| / group_size per rank, up to FSDP's row chunking).
Resume of sharded runs is bit-exact.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from algorithms.shard import local
from bench.run import dcp_state
from tests import strategies
from tests.distributed import run_distributed
from tests.helpers import assert_bad_config, assert_same_params, max_change
from tests.local_updates import make_trainer

SGD = ["optim.name=sgd", "optim.lr=0.5", "optim.momentum=0.9", "optim.grad_clip=0.5",
       "run.steps=4"]
PAIRS = {  # (config, overrides): every strategy that shards (tests/strategies.py `fsdp`)
    name: (strategies.config_of(entry, case), list(case.overrides))
    for name, (entry, case) in strategies.cases("fsdp").items()}


def _full_parameters(trainer) -> dict[str, torch.Tensor]:
    """The evaluated weights, whole (every rank takes part in the gather)."""
    state = trainer.strategy.export_state()
    return {k: v.clone() for k, v in state.items()}


def _pairs(rank, world_size, root):
    out = {}
    for name, (config, overrides) in PAIRS.items():
        for shard in ("none", "fsdp"):
            trainer = make_trainer(world_size, config, [*SGD, *overrides,
                                                        f"parallel.shard={shard}"],
                                   Path(root) / f"{name}-{shard}")
            start = _full_parameters(trainer)
            trainer.run()
            ledger = [(r.phase, r.op, r.step, r.nbytes, r.group_size)
                      for r in trainer.ledger.records]
            out[name, shard] = (start, _full_parameters(trainer), ledger)
            trainer.strategy.close()
    return out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    return run_distributed(_pairs, 4, str(root), timeout=600)


def num_params(state: dict) -> int:
    """|θ| of the tied GPT-2 the diloco config trains (head.weight is embed.wte.weight)."""
    return sum(v.numel() for k, v in state.items() if k != "head.weight")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", PAIRS)
def test_sharded_equals_unsharded(pairs, name):
    (start, plain, _), (_, sharded, _) = pairs[0][name, "none"], pairs[0][name, "fsdp"]
    assert max_change(plain, start) > 1e-3
    assert_same_params(sharded, plain, atol=1e-6, rtol=0)


@pytest.mark.timeout(600)
def test_ledger_holds_fsdp_collectives_and_sharded_outer_bytes(pairs):
    theta = num_params(pairs[0]["diloco", "fsdp"][0])
    per_rank = [rank["diloco", "fsdp"][2] for rank in pairs]
    for ledger in per_rank:
        ops = {(phase, op) for phase, op, *_ in ledger}
        assert {("inner", "all_gather"), ("inner", "reduce_scatter"), ("clip", "all_reduce"),
                ("outer", "all_reduce")} <= ops
        assert not any(op == "all_reduce" and phase == "inner" for phase, op, *_ in ledger)
        # a step's reduce-scatters hand in the whole replica's gradient (+ FSDP's padding)
        scattered = sum(n for phase, op, step, n, _ in ledger
                        if (phase, op, step) == ("inner", "reduce_scatter", 0))
        assert 4 * theta <= scattered < 4 * theta * 1.01
    # outer rounds at steps 2 and 4: the two ranks of a replica carry |θ| between them
    for replica in ((0, 1), (2, 3)):
        for step in (1, 3):
            outer = [sum(n for phase, op, s, n, _ in per_rank[r]
                         if (phase, op, s) == ("outer", "all_reduce", step)) for r in replica]
            assert sum(outer) == 4 * theta
            assert all(abs(b - 2 * theta) < 0.01 * 4 * theta for b in outer)
    unsharded = [n for phase, op, s, n, _ in pairs[0]["diloco", "none"][2]
                 if (phase, op, s) == ("outer", "all_reduce", 1)]
    assert unsharded == [4 * theta]  # unsharded, every rank sends all of θ


# ---------------------------------------------------------------------- resume


RESUME = {  # (config, overrides, the checkpoint's step): tests/strategies.py `fsdp_resume`
    name: (strategies.config_of(entry, case), list(case.overrides), case.checkpoint_step)
    for name, (entry, case) in strategies.cases("fsdp_resume").items()}


def _straight_then_resumed(rank, world_size, root):
    out = {}
    for name, (config, overrides, _) in RESUME.items():
        overrides = [*overrides, "parallel.shard=fsdp"]
        run_dir = Path(root) / name
        straight = make_trainer(world_size, config, overrides, run_dir)
        straight.run()
        mine = straight.strategy.sharded.local_state()
        straight.strategy.close()
        os.environ["COMMBENCH_RESUME"] = "1"
        try:
            resumed = make_trainer(world_size, config, overrides, run_dir)
            step = dcp_state.latest(resumed.records)[1]["step"]
            resumed.run()
        finally:
            del os.environ["COMMBENCH_RESUME"]
        outer = getattr(resumed.strategy, "outer", None)
        out[name] = (mine, resumed.strategy.sharded.local_state(), step,
                     None if outer is None else [local(g).clone() for g in outer.global_params],
                     None if outer is None else [local(g).clone() for g in
                                                 straight.strategy.outer.global_params])
    return out


@pytest.mark.timeout(300)
def test_sharded_runs_resume_bit_exactly(tmp_path):
    per_rank = run_distributed(_straight_then_resumed, 2, str(tmp_path), timeout=280)
    for results in per_rank:
        for name, (straight, resumed, step, theta, theta_straight) in results.items():
            assert step == RESUME[name][2], name  # the second run resumed there
            assert_same_params(resumed, straight, atol=0, rtol=0)
            if theta is not None:
                for a, b in zip(theta, theta_straight, strict=True):
                    assert torch.equal(a, b)


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize("overrides, expected", [
    (["optim.name=muon"], ("optim.name='muon'", "parallel.shard=fsdp", "adamw")),
    (["optim.name=soap"], ("optim.name='soap'", "Kronecker")),
    (["optim.name=adan"], ("optim.name='adan'",)),
    (["strategy.backend=deepspeed"], ("parallel.shard='fsdp'", "ZeRO")),
    (["strategy.name=diloco"], ("parallel.group_size is 1", "nothing to shard")),
    (["strategy.name=gasloc"], ("parallel.shard='fsdp'", "gasloc", "not implemented")),
    (["strategy.name=pipeline", "parallel.num_stages=2"], ("data-parallel strategies",)),
    (["model.compile=true"], ("model.compile", "parallel.shard=fsdp")),
])
def test_combinations_fsdp_cannot_do_are_refused_with_a_reason(overrides, expected):
    assert_bad_config("configs/ddp-tiny.yaml", ["parallel.shard=fsdp", *overrides], *expected)


def test_resume_onto_another_world_size_is_refused(tmp_path):
    """A sharded run's checkpoint holds each rank's shards for its layout: `--resume` with
    another parallel.world_size is refused before launch, naming both layouts and why
    (only unsharded torch DDP resumes onto another world size)."""
    from bench.config import load_config, to_dict
    from bench.launch.run import check_resume
    from tests.fakes import write_fake_run

    cfg = load_config("configs/ddp-tiny.yaml", ["parallel.shard=fsdp"])
    run = write_fake_run(tmp_path / "run", to_dict(cfg))
    other = load_config("configs/ddp-tiny.yaml", ["parallel.shard=fsdp",
                                                  "parallel.world_size=2"])
    with pytest.raises(ValueError, match=r"parallel.world_size differ: .* ddp on 4 ranks .*"
                                         r"ddp on 2 ranks .* parallel.shard none"):
        check_resume(other, run)
    # the same global batch does not help: the shards are each rank's own
    with pytest.raises(ValueError, match=r"only DDP with strategy.backend torch"):
        check_resume(load_config("configs/ddp-tiny.yaml", [
            "parallel.shard=fsdp", "parallel.world_size=2", "data.batch_size=16"]), run)


class _FakeComm:
    """What `_Recorder` reads of a Communicator, logging the calls that matter."""

    def __init__(self, device: str, delay):
        import contextlib
        self.device, self.delay, self.current_phase, self.step = torch.device(device), delay, \
            "train", 7
        self.calls, self.records = [], []
        self.phase = lambda name: contextlib.nullcontext()

    def synchronize(self):
        self.calls.append("synchronize")

    def hold(self, op, nbytes, started, group):
        self.calls.append("hold")
        return 0.25

    def record(self, op, nbytes, seconds, group):
        self.records.append((op, nbytes, seconds))


class _FakeDeviceClock:
    """Marks at 1, 2, 3, ... seconds: each timed op lasts 1 s on the 'device'."""

    def __init__(self):
        self.t = 0.0

    def mark(self):
        self.t += 1.0
        return self.t

    def synchronize(self):
        pass

    def seconds(self, start, end):
        return end - start


def test_fsdp_ops_on_a_gpu_are_not_counted_as_exposed(monkeypatch):
    """Issue 46: on a GPU FSDP2's collectives run on their own stream, overlapping compute.
    Their durations go to the ledger, but the step's exposed seconds are 0 (the step's
    compute is then the whole step, an upper bound), not their sum (which understated
    compute and made every sharded projection optimistic). On the CPU, where gloo blocks
    the host, their sum is exposed."""
    from algorithms import shard
    monkeypatch.setattr(shard, "clock_for", lambda device: _FakeDeviceClock())
    for device, exposed in (("cuda", 0.0), ("cpu", 2.0)):
        comm = _FakeComm(device, delay=None)
        recorder = shard._Recorder(comm, None)
        recorder.timed("all_gather", 64, lambda: None)
        recorder.timed("reduce_scatter", 128, lambda: None)
        assert recorder.flush() == exposed, device
        assert comm.records == [("all_gather", 64, 1.0), ("reduce_scatter", 128, 1.0)]


def test_an_emulated_fsdp_op_starts_when_the_device_reaches_it(monkeypatch):
    """Issue 46: under `network.emulate` the modelled transfer is held from when the device
    reaches the op (a synchronise before the host clock starts), not from when the host
    queued it; its host seconds are exposed on any device."""
    from algorithms import shard
    monkeypatch.setattr(shard, "clock_for", lambda device: _FakeDeviceClock())
    comm = _FakeComm("cuda", delay=object())
    recorder = shard._Recorder(comm, None)
    ran = []
    recorder.timed("all_gather", 64, lambda: ran.append(comm.calls.copy()))
    assert ran == [["synchronize"]]  # the device had drained before the op was queued
    assert comm.calls == ["synchronize", "synchronize", "hold"]
    assert recorder.flush() == 0.25 and comm.records == [("all_gather", 64, 0.25)]
