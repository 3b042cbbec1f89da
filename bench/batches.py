"""Deterministic per-replica training batches and the shared validation batches.

Exercised by every training run: bench/train.py draws `BatchStream(...).batch(step)` on each
rank and evaluates on `val_batches(...)`.
"""

from __future__ import annotations

import numpy as np
import torch


class BatchStream:
    """Batches for one data-parallel shard (rank or replica) of a seed-keyed sample order.

    The dataset is the `num_windows = (len(tokens) - 1) // seq_len` windows of seq_len + 1
    tokens starting at multiples of seq_len (neighbours share one boundary token). Global
    sample i = step*B + shard_index*rank_batch + j, with B = rank_batch*num_shards and
    j < rank_batch, is window perm_e[i % num_windows] where e = i // num_windows and perm_e
    is a permutation seeded by (seed, e). So a step's samples are the same whatever the
    split into shards: 4 shards of b rows concatenate to 1 shard of 4b rows (DDP identity).
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        rank_batch: int,
        shard_index: int,
        num_shards: int,
        seed: int,
    ) -> None:
        for key, value in (
            ("seq_len", seq_len),
            ("rank_batch", rank_batch),
            ("num_shards", num_shards),
        ):
            if value < 1:
                raise ValueError(f"BatchStream: {key} must be >= 1, got {value}")
        if not 0 <= shard_index < num_shards:
            raise ValueError(
                f"BatchStream: shard_index must be in [0, {num_shards}), got {shard_index}"
            )
        if seed < 0:
            raise ValueError(f"BatchStream: seed must be >= 0, got {seed}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.rank_batch, self.shard_index = rank_batch, shard_index
        self.global_batch = rank_batch * num_shards
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < self.global_batch:
            need = self.global_batch * seq_len + 1
            raise ValueError(
                f"data.corpus has {len(tokens)} training tokens; a global batch of "
                f"{self.global_batch} windows of seq_len {seq_len} needs at least {need}"
            )
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            # Generator.permutation(n)'s order, shuffled in place at 4 bytes a window (not
            # int64's 8): the one array a corpus larger than memory costs (bench/data.py)
            order = np.arange(self.num_windows, dtype=np.uint32 if self.num_windows < 1 << 32
                              else np.int64)
            np.random.default_rng([self.seed, epoch]).shuffle(order)
            self._epoch, self._perm = epoch, order
        return self._perm

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_BT, y_BT) int64 CPU tensors of shape (rank_batch, seq_len); y is x shifted."""
        if step < 0:
            raise ValueError(f"BatchStream.batch: step must be >= 0, got {step}")
        first = step * self.global_batch + self.shard_index * self.rank_batch
        windows = [
            self._permutation(i // self.num_windows)[i % self.num_windows]
            for i in range(first, first + self.rank_batch)
        ]
        return _gather(self.tokens, windows, self.seq_len)


def _gather(tokens: np.ndarray, windows, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    starts = np.asarray(windows, dtype=np.int64)[:, None] * seq_len
    rows = torch.from_numpy(tokens[starts + np.arange(seq_len + 1)].astype(np.int64))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def val_batches(
    val_tokens: np.ndarray, seq_len: int, batch_size: int, num_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first `num_batches` batches of consecutive windows of the validation split, the
    same on every rank. Clipped to the full batches that exist; a split shorter than one
    batch gives a single smaller batch."""
    if batch_size < 1 or num_batches < 1:
        raise ValueError(
            f"val_batches: batch_size and num_batches must be >= 1, "
            f"got {batch_size} and {num_batches}"
        )
    num_windows = (len(val_tokens) - 1) // seq_len
    if num_windows < 1:
        raise ValueError(
            f"data.corpus: the validation split has {len(val_tokens)} tokens, fewer than "
            f"seq_len + 1 = {seq_len + 1}; use a larger corpus or data.val_fraction"
        )
    num_batches = max(1, min(num_batches, num_windows // batch_size))
    return [
        _gather(val_tokens, range(k * batch_size, min((k + 1) * batch_size, num_windows)), seq_len)
        for k in range(num_batches)
    ]
