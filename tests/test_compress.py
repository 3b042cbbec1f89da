"""Compressed outer communication: the codecs (algorithms/compress.py) and the exchanges
that carry them (algorithms/comm.py `Communicator.average`, `average_sparse`, `launch`).

    pytest tests/test_compress.py

Round trips stay within each format's stated error bound (and the bound is not vacuous:
the error comes near it); top-k with error feedback sends everything eventually; the
quantized exchange on real gloo ranks equals its restatement in tensor math on every rank
and is recorded with the bytes actually sent; `none` is the plain all-reduce, bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from algorithms.comm import CommLedger, Communicator
from algorithms.compress import FP4_GRID, QUANTIZERS, RowQuantizer, TopK, bytes_per_element
from tests.distributed import run_distributed


def _sample(numel: int = 3000, seed: int = 0) -> torch.Tensor:
    """Values over six orders of magnitude, a row of zeros, and exact zeros here and there."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * torch.logspace(-4, 2, numel)[torch.randperm(
        numel, generator=g)]
    x[128:256] = 0.0
    x[::97] = 0.0
    return x


# ------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("kind", QUANTIZERS)
def test_round_trip_within_the_formats_bound(kind):
    codec = RowQuantizer(kind, row=64)
    x = _sample()
    error = (codec.round_trip(x) - x).abs()
    bound = codec.error_bound(x)
    assert bool((error <= bound * (1 + 1e-5) + 1e-30).all()), (error - bound).max()
    assert float((error / bound.clamp_min(1e-30)).max()) > 0.3  # the bound is near-tight
    assert float(error[128:256].max()) == 0.0  # a zero row comes back as zeros


def test_round_trip_bounds_are_what_the_bits_give():
    """int8: half a step of absmax/127; fp8: 3 mantissa bits; fp4: the e2m1 grid's points
    (times the row's scale) come back exactly, midpoints go to the smaller magnitude."""
    row = torch.linspace(-1, 1, 64)
    assert (RowQuantizer("int8", 64).round_trip(row) - row).abs().max() <= 1 / 254 + 1e-7
    grid = torch.tensor([*FP4_GRID, *(-v for v in FP4_GRID)] * 4)  # absmax 6: scale 1
    assert torch.equal(RowQuantizer("fp4", 64).round_trip(grid), grid)
    midpoints = torch.tensor([0.25, 1.25, 2.5, 5.0, -3.5, 6.0] + [0.0] * 58)
    expected = torch.tensor([0.0, 1.0, 2.0, 4.0, -3.0, 6.0] + [0.0] * 58)
    assert torch.equal(RowQuantizer("fp4", 64).round_trip(midpoints), expected)
    e4m3 = torch.tensor([448.0, 1.125, -0.0625, 2.0 ** -9] + [0.0] * 60)  # representable
    assert torch.equal(RowQuantizer("fp8", 64).round_trip(e4m3), e4m3)


def test_coded_sizes():
    """Bytes a row costs: its codes and one fp32 scale; buffers pad to whole rows per shard."""
    assert RowQuantizer("int8", 128).width == 128 + 4
    assert RowQuantizer("fp8", 128).width == 128 + 4
    assert RowQuantizer("fp4", 128).width == 64 + 4
    assert RowQuantizer("fp4", 128).coded_bytes(1000, shards=4) == 8 * 68  # 1024 elements
    assert bytes_per_element("fp4", 128) == pytest.approx(68 / 128)
    assert bytes_per_element("topk", topk_fraction=0.01) == pytest.approx(0.08)
    assert bytes_per_element("none", value_bytes=2) == 2.0
    assert TopK(0.01).coded_bytes(1000) == 10 * 8


@pytest.mark.parametrize("override,message", [
    ("strategy.outer_compression=int4",
     "strategy.outer_compression must be one of ['none', 'int8', 'fp8', 'fp4', 'topk']"),
    ("strategy.compression_row=7", "strategy.compression_row must be an even number >= 2"),
    ("strategy.topk_fraction=0", "strategy.topk_fraction must be in (0, 1]"),
    (["strategy.outer_compression=fp4", "strategy.outer_grad_dtype=bf16"],
     "strategy.outer_grad_dtype='bf16' with strategy.outer_compression='fp4'"),
])
def test_bad_compression_config_fails_before_launch(override, message):
    from tests.helpers import assert_bad_config

    assert_bad_config("configs/diloco-tiny.yaml", override, message)


# ------------------------------------------------------------------------ top-k


def test_topk_with_error_feedback_sends_everything_eventually():
    """One pseudo-gradient, then rounds with nothing new: after ceil(1/fraction) rounds the
    error buffer is empty and what was sent sums to the pseudo-gradient exactly."""
    codec = TopK(0.1)
    x = _sample(1000)
    sent, error = torch.zeros_like(x), None
    rounds = math.ceil(1 / codec.fraction)
    for t in range(rounds):
        indices, values, error = codec.select(x if t == 0 else torch.zeros_like(x), error)
        assert len(indices) == 100 and len(set(indices.tolist())) == 100
        sent[indices.long()] += values
        # the largest entries leave first: what stays are the nonzeros not yet sent
        assert int((error != 0).sum()) == max(0, int((x != 0).sum()) - 100 * (t + 1))
    assert torch.equal(error, torch.zeros_like(x))
    assert torch.equal(sent, x)


def test_topk_feeds_back_the_wire_rounding():
    """Values travel in bf16: what the rounding lost stays in the buffer."""
    codec = TopK(1.0, torch.bfloat16)
    x = torch.tensor([1.0 + 2 ** -12, -3.0, 0.1])
    indices, values, error = codec.select(x, None)
    sent = torch.zeros_like(x)
    sent[indices.long()] = values.float()
    assert torch.equal(sent + error, x)
    assert error.abs().max() > 0


# ------------------------------------------------------------------------ the exchanges


def _exchanges(rank, world_size, kind):
    """Each rank's result of the quantized mean, the reference in tensor math from every
    rank's buffer, the plain mean, and the ledger's record."""
    comm = Communicator(rank, world_size, "cpu", CommLedger(keep_records=True))
    codec = RowQuantizer(kind, row=32)
    mine = _sample(1000, seed=rank)
    everyone = [_sample(1000, seed=r) for r in range(world_size)]
    result = comm.average(mine.clone(), codec=codec)
    # reference: each rank's coded buffer, shard s of every rank decoded and averaged in
    # fp32 in rank order, the mean coded again, all decoded
    padded = [torch.cat([x, torch.zeros(codec.padded(1000, world_size) - 1000)])
              for x in everyone]
    decoded = [codec.decode(codec.encode(x)).view(world_size, -1) for x in padded]
    shards = [sum(d[s] for d in decoded) / world_size for s in range(world_size)]
    reference = torch.cat([codec.decode(codec.encode(s)) for s in shards])[:1000]
    # each stage within its bound: the ranks' codings (averaged), then the mean's coding
    bound = (sum(codec.error_bound(x) for x in everyone) / world_size
             + codec.error_bound(torch.cat(shards)[:1000]))
    launched = comm.average(mine.clone(), codec=codec, launch=True)
    later = launched.wait()
    launched.record(tail_s=0.0)
    return result, reference, torch.stack(everyone).mean(0), bound, comm.ledger.records, later


def _every_kind(rank, world_size):
    """`_exchanges` for every format, in one launch (process start-up is the slow part)."""
    return {kind: _exchanges(rank, world_size, kind) for kind in QUANTIZERS}


@pytest.fixture(scope="module")
def exchanged():
    return run_distributed(_every_kind, 4, timeout=80)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", QUANTIZERS)
def test_quantized_exchange_equals_its_tensor_math_on_every_rank(kind, exchanged):
    results = [per_rank[kind] for per_rank in exchanged]
    codec = RowQuantizer(kind, row=32)
    for result, reference, mean, bound, records, later in results:
        assert torch.equal(result, results[0][0])  # every rank the same bits
        assert torch.equal(result, reference)
        assert torch.equal(later, result)  # launched: the same exchange
        assert bool(((result - mean).abs() <= bound * (1 + 1e-5) + 1e-30).all())
        sync, launched = records
        assert (sync.op, sync.nbytes, sync.group_size) == (
            "quantized_all_reduce", codec.coded_bytes(1000, 4), 4)
        assert sync.launch_step is None
        assert (launched.op, launched.nbytes, launched.launch_step) == (
            "quantized_all_reduce", sync.nbytes, 0)


def _plain_and_sparse(rank, world_size):
    comm = Communicator(rank, world_size, "cpu", CommLedger(keep_records=True))
    x = _sample(500, seed=rank)
    plain = x.clone()
    dist.all_reduce(plain)
    plain.div_(world_size)
    mine = comm.average(x.clone())  # codec None: the all-reduce itself
    indices = torch.arange(rank, 500, world_size, dtype=torch.int32)[:100]
    values = x[indices.long()]
    sparse = comm.average_sparse(indices, values, 500)
    return plain, mine, sparse, indices, values, comm.ledger.records


@pytest.mark.timeout(60)
def test_none_is_the_all_reduce_and_sparse_means_add_in_rank_order():
    results = run_distributed(_plain_and_sparse, 2, timeout=50)
    expected = torch.zeros(500)
    for _, _, _, indices, values, _ in results:
        expected.index_add_(0, indices.long(), values)
    for plain, mine, sparse, *_, records in results:
        assert torch.equal(mine, plain)
        assert torch.equal(sparse, expected / 2)
        assert [(r.op, r.nbytes) for r in records] == [("all_reduce", 2000),
                                                       ("all_gather", 100 * 8)]
