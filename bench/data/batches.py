"""Deterministic per-replica training batches and the shared validation set.

Exercised by every training run: bench/run/train.py draws `BatchStream(...).batch(step)` on each
rank and evaluates on its shard of `validation_set(...)`, the same windows for every
layout, batch size, world size and pipeline depth of the same data (run.val_sequences).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

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
            # int64's 8): the one array a corpus larger than memory costs (bench/data/__init__.py)
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


@dataclass(frozen=True)
class ValidationSet:
    """The windows every run on the same data is scored on, whatever its layout.

    `windows` is (sequences, seq_len + 1) tokens; `id` is 12 hex digits of the sha256 of
    its shape and tokens, so two runs share an id exactly when they score the same tokens
    (the corpus, tokenizer, data.val_fraction, model.seq_len and run.val_sequences all
    reach it through the tokens). Batch size, world size, layout and pipeline depth do
    not: they only change how `batches` cuts the set.
    """

    windows: np.ndarray
    seq_len: int
    id: str

    @property
    def sequences(self) -> int:
        return len(self.windows)

    def record(self) -> dict:
        """summary.json `val_set` (bench/run/summary.py): tokens = positions scored."""
        return {"id": self.id, "sequences": self.sequences, "seq_len": self.seq_len,
                "tokens": self.sequences * self.seq_len}

    def batches(self, batch_size: int, shard_index: int = 0,
                num_shards: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One data-parallel shard's share: windows shard_index, shard_index + num_shards,
        ..., in batches of at most `batch_size` (a shard may get none). The shards'
        shares are disjoint and cover the set, so a sum over shards is a sum over it."""
        if batch_size < 1 or not 0 <= shard_index < num_shards:
            raise ValueError(f"ValidationSet.batches: need batch_size >= 1 and 0 <= "
                             f"shard_index < num_shards, got {batch_size}, {shard_index}, "
                             f"{num_shards}")
        mine = torch.from_numpy(self.windows[shard_index::num_shards].astype(np.int64))
        return [(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())
                for rows in mine.split(batch_size) if len(rows)]  # never an empty batch


def validation_set(val_tokens: np.ndarray, seq_len: int, sequences: int) -> ValidationSet:
    """`sequences` windows of seq_len + 1 tokens spread evenly over the validation split:
    window k of the set is window floor(k * W / sequences) of the split's W windows
    (starting at multiples of seq_len, as in training), so the set samples the whole
    held-out text rather than its first documents, and it is all of it when sequences = W.
    Fails (naming run.val_sequences) when the split has fewer windows than asked for."""
    if sequences < 1:
        raise ValueError(f"run.val_sequences must be >= 1, got {sequences}")
    num_windows = (len(val_tokens) - 1) // seq_len
    if sequences > num_windows:
        raise ValueError(
            f"run.val_sequences must be <= {num_windows}, the windows of model.seq_len + 1 = "
            f"{seq_len + 1} tokens in the validation split ({len(val_tokens)} tokens), got "
            f"{sequences}; valid: 1 to {num_windows}, or more validation data "
            f"(data.val_fraction, a larger corpus)")
    picks = np.arange(sequences, dtype=np.int64) * num_windows // sequences
    windows = np.ascontiguousarray(val_tokens[picks[:, None] * seq_len + np.arange(seq_len + 1)])
    digest = hashlib.sha256(f"{sequences}x{seq_len + 1}:".encode())
    digest.update(windows.astype("<u4").tobytes())
    return ValidationSet(windows, seq_len, digest.hexdigest()[:12])
