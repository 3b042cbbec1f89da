"""Streaming DiLoCo (algorithms/streaming.py, the rounds in algorithms/diloco.py): the
schedule, the fragments, and the strategy against its restatement in tensor math.

    pytest tests/test_streaming.py

- One fragment, no overlap, α = 0 is DiLoCo bit for bit: the strategy against the outer
  step as DiLoCo has always taken it (one flat fp32 Δ, summed by gloo, divided, torch SGD
  with Nesterov momentum on the global θ, θ copied into the replica).
- Two fragments, τ = 1, α = 0.5 on a two-layer model: the schedule (which fragment, Δ taken
  one step early, the final round), one outer state per fragment, and the merge
  θ_i ← (1 − α) θ + α θ_i, against the same written out by hand.
- The loop: bytes recorded as sent (a fragment's coded size), peak and series in the
  summary. Compression's own tests are tests/test_compress.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from algorithms.base import TrainSetup
from algorithms.comm import Communicator
from algorithms.compress import RowQuantizer
from algorithms.diloco import DiLoCo, DiLoCoConfig
from algorithms.streaming import StreamingSchedule, block_fragments, fragment_indices
from tests.distributed import run_distributed
from tests.helpers import assert_bad_config
from tests.local_updates import regression_batch, train_many

# ------------------------------------------------------------------------ the schedule


def test_schedule_round_robin_overlap_and_final_round():
    s = StreamingSchedule(num_fragments=2, inner_steps=4, overlap_steps=1, total_steps=9)
    assert [s.regular(t) for t in range(1, 10)] == [None, 0, None, 1, None, 0, None, 1, None]
    assert [s.launch(t) for t in range(1, 10)] == [0, None, 1, None, 0, None, 1, None, None]
    assert s.syncs(8) == [1] and s.syncs(9) == [0, 1]  # the last step syncs everything
    assert s.all_synced(0) and s.all_synced(9) and not s.all_synced(8)
    one = StreamingSchedule(1, 3, 0, 7)  # DiLoCo: every H steps and the last step
    assert [t for t in range(1, 8) if one.syncs(t)] == [3, 6, 7]
    assert all(one.launch(t) is None for t in range(1, 8))


def test_a_schedule_whose_fragments_do_not_divide_h():
    """H = 10 over P = 4: sync points 2, 5, 7, 10 in each round (gaps 2, 3, 2, 3); overlap
    below the shortest gap. The paper's H = 100, P = 8: 12, 25, 37, ..., 100. When P
    divides H it is the evenly spaced schedule."""
    s = StreamingSchedule(num_fragments=4, inner_steps=10, overlap_steps=1, total_steps=21)
    assert {t: s.regular(t) for t in range(1, 22) if s.regular(t) is not None} == {
        2: 0, 5: 1, 7: 2, 10: 3, 12: 0, 15: 1, 17: 2, 20: 3}
    assert [t for t in range(1, 22) if s.launch(t) is not None] == [1, 4, 6, 9, 11, 14, 16, 19]
    assert s.syncs(21) == [0, 1, 2, 3]
    paper = StreamingSchedule(8, 100, 5, 200)
    assert [t for t in range(1, 101) if paper.regular(t) is not None] == [
        12, 25, 37, 50, 62, 75, 87, 100]
    even = StreamingSchedule(4, 12, 0, 24)
    assert [t for t in range(1, 25) if even.regular(t) is not None] == list(range(3, 25, 3))
    with pytest.raises(ValueError, match=r"overlap_steps must be in \[0, floor\(inner_steps "
                                         r"/ fragments\) = 2\), got 2"):
        StreamingSchedule(4, 10, 2, 21)
    with pytest.raises(ValueError, match=r"fragments \(4\) must be between 1 and "
                                         r"strategy.inner_steps \(3\)"):
        StreamingSchedule(4, 3, 0, 21)


def test_fragment_patterns():
    assert block_fragments(6, 3, "strided") == [0, 1, 2, 0, 1, 2]
    assert block_fragments(6, 4, "sequential") == [0, 0, 1, 2, 2, 3]
    assert block_fragments(4, 1, "strided") == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="strategy.fragments \\(3\\) must be between 1"):
        block_fragments(2, 3, "strided")


class TwoLayer(nn.Module):
    """Two blocks (3 -> 3 -> 2) with the loop's `model(x, y) -> (out, loss)` convention and
    `as_layers()` = [embedding, blocks, head] (here: nothing, the two blocks, nothing)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(3, 3), nn.Linear(3, 2)

    def as_layers(self):
        return [nn.Identity(), self.first, self.second, nn.Identity()]

    def forward(self, x, y):
        out = self.second(torch.tanh(self.first(x)))
        return out, ((out - y) ** 2).mean()


def test_fragment_indices_follow_the_blocks():
    model = TwoLayer()
    assert fragment_indices(model, 2, "strided") == [[0, 1], [2, 3]]
    assert fragment_indices(model, 1, "strided") == [[0, 1, 2, 3]]


# ---------------------------------------------------------- the strategy vs tensor math


def streaming_rounds(rank, world_size, fragments, tau, alpha, steps, inner_steps=4,
                     lr=0.7, mu=0.9):
    """The strategy and the algorithm written out: per fragment a global θ and a torch SGD
    (Nesterov) on it; Δ = mean over ranks of θ − θ_i, taken τ steps before the fragment's
    sync point (the fragment's θ is untouched meanwhile); at the sync: the outer step, then
    θ_i ← (1 − α) θ + α θ_i (α = 0: θ_i ← θ, a copy). Returns the largest difference of
    the replicas and of the evaluated (global) models, per step, and the rounds taken."""
    torch.manual_seed(0)
    model = TwoLayer()
    reference = copy.deepcopy(model)
    comm = Communicator(rank, world_size, "cpu")
    setup = TrainSetup(model=model, comm=comm, total_steps=steps,
                       make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    strategy = DiLoCo(DiLoCoConfig(inner_steps=inner_steps, outer_lr=lr, outer_momentum=mu,
                                   fragments=fragments, overlap_steps=tau, mix_alpha=alpha),
                      setup)
    inner = torch.optim.SGD(reference.parameters(), lr=0.1)
    params = list(reference.parameters())
    parts = [params[:2], params[2:]] if fragments == 2 else [params]
    thetas = [[p.detach().clone() for p in part] for part in parts]
    outers = [torch.optim.SGD(theta, lr=lr, momentum=mu, nesterov=True) for theta in thetas]
    period = inner_steps // fragments
    deltas: dict[int, torch.Tensor] = {}

    def delta_of(f):  # mean over ranks of θ − θ_i, one flat fp32 buffer, summed by gloo
        flat = torch.cat([(g - p.detach()).reshape(-1) for g, p in zip(thetas[f], parts[f],
                                                                       strict=True)])
        dist.all_reduce(flat)
        return flat.div_(world_size)

    def sync(f):
        delta, offset = deltas.pop(f) if f in deltas else delta_of(f), 0
        for g in thetas[f]:
            g.grad = delta[offset:offset + g.numel()].view_as(g).clone()
            offset += g.numel()
        outers[f].step()
        with torch.no_grad():
            for g, p in zip(thetas[f], parts[f], strict=True):
                g.grad = None
                p.copy_(g if alpha == 0 else (1 - alpha) * g + alpha * p)

    replica_errors, global_errors = [], []
    for s in range(1, steps + 1):
        strategy.train_step(regression_batch(rank, s))
        inner.zero_grad()
        reference(*regression_batch(rank, s))[1].backward()
        inner.step()
        regular = (s // period - 1) % fragments if s % period == 0 else None
        ahead = s + tau
        if tau and ahead <= steps and ahead % period == 0:  # launched now, synced at s + τ
            deltas[(ahead // period - 1) % fragments] = delta_of((ahead // period - 1)
                                                                 % fragments)
        if regular is not None:
            sync(regular)
        if s == steps:  # the final round: every other fragment too
            for f in range(fragments):
                if f != regular:
                    sync(f)
        mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        theirs = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
        replica_errors.append((mine - theirs).abs().max().item())
        evaluated = torch.cat([p.detach().reshape(-1)
                               for p in strategy.eval_model().parameters()])
        global_ = torch.cat([g.reshape(-1) for theta in thetas for g in theta])
        global_errors.append((evaluated - global_).abs().max().item())
    return replica_errors, global_errors, strategy.round, deltas


def both_cases(rank, world_size):
    """The two cases below in one launch (process start-up is the slow part)."""
    return (streaming_rounds(rank, world_size, 1, 0, 0.0, 10),
            *(streaming_rounds(rank, world_size, 2, 1, alpha, 9) for alpha in (0.5, 0.25)))


@pytest.fixture(scope="module")
def rounds():
    return run_distributed(both_cases, 2, timeout=80)


@pytest.mark.timeout(90)
def test_one_fragment_no_overlap_is_diloco_bit_for_bit(rounds):
    for (replica_errors, global_errors, count, left), *_ in rounds:
        assert count == 3  # steps 4, 8 and the final round at 10
        assert max(replica_errors) == 0.0 and max(global_errors) == 0.0
        assert not left


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", [1, 2], ids=["alpha=0.5", "alpha=0.25"])
def test_two_fragments_overlap_1_match_the_hand_written_schedule(rounds, case):
    """α = 0.5 (the paper's) and 0.25 (where swapping θ and θ_i in the merge shows)."""
    for ranks in rounds:
        replica_errors, global_errors, count, left = ranks[case]
        assert count == 6  # fragment 0 at 2, 6; fragment 1 at 4, 8; both at 9 (final)
        assert max(replica_errors) < 1e-6 and max(global_errors) < 1e-6
        assert not left  # every launched exchange was waited for


@pytest.mark.timeout(60)
def test_one_replica_overlaps_nothing_and_still_follows_the_schedule():
    """One replica sends nothing (a launched exchange is finished at once, unrecorded), but
    Δ is still taken τ steps early and merged."""
    (replica_errors, global_errors, count, left), = run_distributed(
        streaming_rounds, 1, 2, 1, 0.25, 9, timeout=50)
    assert count == 6 and not left
    assert max(replica_errors) < 1e-6 and max(global_errors) < 1e-6


# ------------------------------------------------------------------------ the loop

STREAMING_TINY = "configs/streaming-diloco-tiny.yaml"


@pytest.mark.timeout(200)
def test_loop_records_coded_bytes_per_fragment_and_the_peak(tmp_path):
    """2 ranks, 8 steps, H = 4, P = 2, τ = 1: fragment syncs at steps 2, 4, 6, 8, each
    exchange launched a step early and recorded (its coded bytes) in the step that waited."""
    common = ["run.steps=8", "strategy.inner_steps=4", "strategy.compression_row=32"]
    runs = [(STREAMING_TINY, common),
            (STREAMING_TINY, [*common, "strategy.fragments=1", "strategy.overlap_steps=0",
                              "strategy.mix_alpha=0", "strategy.outer_compression=none"])]
    results = run_distributed(train_many, 2, runs, str(tmp_path), timeout=180)
    codec = RowQuantizer("fp4", 32)
    for streaming, diloco in results:
        outer = [row for row in streaming["ledger"] if row[0] == "outer"]
        assert [(op, step) for _, op, step, *_ in outer] == [
            ("quantized_all_reduce", s) for s in (1, 3, 5, 7, 7)]  # 0-based; 8: the final
        numel = streaming["summary"]["num_params"]
        sizes = [nbytes for _, _, _, nbytes, *_ in outer]
        # fragments 0, 1, 0, then at the last step 0 (blocking) and 1 (the one in flight,
        # recorded after the work that followed its wait)
        assert sizes == [sizes[0], sizes[1], sizes[0], sizes[0], sizes[1]]
        # each fragment's coded size (codes and scales, padded to whole rows per rank)
        assert abs(sizes[0] + sizes[1] - codec.coded_bytes(numel, 2)) <= 4 * codec.width
        summary = streaming["summary"]
        assert summary["comm_bytes_total"] == 2 * sum(sizes)
        series = summary["comm_bytes_series"]
        assert sum(steps for _, steps, *_ in series) == 8
        assert [(first, n, nbytes) for first, n, nbytes, _ in series if nbytes] == [
            (2, 1, sizes[0]), (4, 1, sizes[1]), (6, 1, sizes[0]),
            (8, 1, sizes[0] + sizes[1])]
        # the peak: the largest fragment's sync, not the final step's sync of both
        assert summary["comm_peak_sync_bytes"] == max(sizes)
        assert summary["comm_peak_sync_wire_bytes"] == max(sizes)  # 2 ranks: 2(n-1)/n = 1
        plain = diloco["summary"]
        assert [(op, step, nbytes) for phase, op, step, nbytes, *_ in diloco["ledger"]
                if phase == "outer"] == [("all_reduce", 3, numel * 4),
                                         ("all_reduce", 7, numel * 4)]
        assert plain["comm_peak_sync_bytes"] == numel * 4
        assert 3 * summary["comm_peak_sync_bytes"] < plain["comm_peak_sync_bytes"]


def test_peak_leaves_out_the_closing_step_unless_it_is_the_only_sync():
    from bench.run.meter import peak_sync_bytes

    assert peak_sync_bytes([[1, 3, 0, 0], [4, 1, 10, 15], [5, 3, 0, 0], [8, 1, 30, 45]]) == (
        10, 15)
    assert peak_sync_bytes([[1, 7, 0, 0], [8, 1, 30, 45]]) == (30, 45)  # one round only
    assert peak_sync_bytes([[1, 8, 5, 5]]) == (5, 5)  # DDP: every step alike
    assert peak_sync_bytes([]) == (0, 0)


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("override,message", [
    (["strategy.inner_steps=1", "strategy.overlap_steps=0"],
     "strategy.fragments (2) must be between 1 and strategy.inner_steps (1)"),
    (["strategy.fragments=5", "strategy.overlap_steps=0"],
     "strategy.fragments (5) must be <= the model's number of blocks (2)"),
    ("strategy.overlap_steps=5", "strategy.overlap_steps must be in [0, floor(inner_steps "
                                 "/ fragments) = 5), got 5"),
    ("strategy.mix_alpha=1.5", "strategy.mix_alpha must be in [0, 1], got 1.5"),
    ("strategy.fragment_pattern=random", "strategy.fragment_pattern must be one of"),
    ("parallel.device=cuda", "strategy.overlap_steps=1 on CUDA (parallel.device 'cuda'): "
                             "not supported yet"),
])
def test_bad_streaming_config_fails_before_launch(override, message):
    assert_bad_config(STREAMING_TINY, override, message)
