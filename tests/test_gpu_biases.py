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
