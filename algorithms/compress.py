"""Codecs for the outer communication: quantized (int8, fp8, fp4) and sparse (top-k).

    commbench run configs/streaming-diloco-tiny.yaml --set strategy.outer_compression=int8
    pytest tests/test_compress.py

Pure tensor functions, no communication: the exchanges that carry what they make are
`algorithms/comm.py` (`Communicator.average`, `average_sparse`); which outer step uses
them is `algorithms/outer.py`. The formats and their sources are in docs/algorithms.md
("Compressed outer communication").

- `RowQuantizer(kind, row)`: the flat pseudo-gradient viewed as rows of `row` elements
  (zero-padded), one absmax scale per row (fp32, 4 bytes), each element coded in
  - int8: `round(x / s)`, s = absmax / 127 (symmetric, 8 bits);
  - fp8: `x / s` cast to float8 e4m3 (`torch.float8_e4m3fn`), s = absmax / 448;
  - fp4: the nearest point of the e2m1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} (sign apart)
    to `|x| / s`, s = absmax / 6, two 4-bit codes per byte (ties go to the smaller
    magnitude).
  A row is coded into `width` bytes: its codes, then its scale. Worst-case error of one
  element x of a row with absmax m (`error_bound`): int8 m / 254; fp8 |x| / 16 + m / 448
  * 2^-10 (3 mantissa bits, e4m3's subnormal step 2^-9 at the bottom); fp4
  max(m / 24, |x| / 4) (half the grid's spacing around |x| / s).
- `TopK(fraction)`: the `ceil(fraction * n)` entries of largest magnitude of `x + e`, e the
  error-feedback buffer of what earlier rounds did not send; the new e is everything that
  was not sent (the values as they travel, so the wire dtype's rounding is fed back too).
  Whatever enters e leaves it eventually: a round with nothing new sends e's largest entries.
"""

from __future__ import annotations

import math

import torch

COMPRESSIONS = ("none", "int8", "fp8", "fp4", "topk")
"""`strategy.outer_compression` values."""
QUANTIZERS = ("int8", "fp8", "fp4")
SCALE_BYTES = 4
"""Each row's absmax scale travels as one fp32."""

FP8_MAX = 448.0
"""Largest finite float8 e4m3 (`torch.float8_e4m3fn`) value."""
FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The e2m1 magnitudes (OCP Microscaling spec, FP4 E2M1); code 8 + i is -FP4_GRID[i]."""
_CODE_BITS = {"int8": 8, "fp8": 8, "fp4": 4}
_LEVELS = {"int8": 127.0, "fp8": FP8_MAX, "fp4": FP4_GRID[-1]}
"""Where a row's absmax lands: the scale is absmax / this."""


class RowQuantizer:
    """int8 / fp8 / fp4 with a per-row absmax scale (module docstring)."""

    def __init__(self, kind: str, row: int = 128):
        if kind not in QUANTIZERS:
            raise ValueError(f"quantizer must be one of {list(QUANTIZERS)}, got {kind!r}")
        if row < 2 or row % 2:
            raise ValueError(f"row must be an even number >= 2, got {row!r}")
        self.kind, self.row = kind, row
        self.code_bytes = row * _CODE_BITS[kind] // 8
        self.width = self.code_bytes + SCALE_BYTES
        """Bytes of one coded row."""

    def padded(self, numel: int, shards: int = 1) -> int:
        """Elements a buffer of `numel` is padded to: whole rows, as many per shard."""
        unit = self.row * shards
        return max(1, math.ceil(numel / unit)) * unit

    def coded_bytes(self, numel: int, shards: int = 1) -> int:
        """Bytes of the coded buffer (codes and scales) for `numel` elements."""
        return self.padded(numel, shards) // self.row * self.width

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Flat float `x` (numel a multiple of `row`) -> uint8 [rows, width]."""
        rows = x.float().reshape(-1, self.row)
        absmax = rows.abs().amax(dim=1, keepdim=True)
        scale = absmax / _LEVELS[self.kind]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        y = rows / safe
        if self.kind == "int8":
            codes = y.round().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
        elif self.kind == "fp8":
            codes = y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            codes = _fp4_codes(y)
        out = torch.empty(rows.shape[0], self.width, dtype=torch.uint8, device=x.device)
        out[:, :self.code_bytes] = codes
        out[:, self.code_bytes:] = scale.view(torch.uint8)
        return out

    @torch.no_grad()
    def decode(self, coded: torch.Tensor) -> torch.Tensor:
        """uint8 [rows, width] -> flat fp32 [rows * row]."""
        codes = coded[:, :self.code_bytes]
        scale = coded[:, self.code_bytes:].contiguous().view(torch.float32)
        if self.kind == "int8":
            values = codes.contiguous().view(torch.int8).float()
        elif self.kind == "fp8":
            values = codes.contiguous().view(torch.float8_e4m3fn).float()
        else:
            values = _fp4_values(codes)
        return (values * scale).reshape(-1)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)) for any flat `x` (padded, then cut back)."""
        padded = torch.zeros(self.padded(x.numel()), dtype=torch.float32, device=x.device)
        padded[:x.numel()] = x.reshape(-1)
        return self.decode(self.encode(padded))[:x.numel()]

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per element of flat `x`: the largest |x - round_trip(x)| the format allows."""
        padded = torch.zeros(self.padded(x.numel()), dtype=torch.float32, device=x.device)
        padded[:x.numel()] = x.reshape(-1).abs()
        absmax = padded.reshape(-1, self.row).amax(dim=1, keepdim=True)
        magnitude = padded.reshape(-1, self.row)
        if self.kind == "int8":
            bound = (absmax / 254).expand_as(magnitude)
        elif self.kind == "fp8":
            bound = magnitude / 16 + absmax / FP8_MAX * 2.0 ** -10
        else:
            bound = torch.maximum(absmax / 24, magnitude / 4)
        return bound.reshape(-1)[:x.numel()]


def _fp4_codes(y: torch.Tensor) -> torch.Tensor:
    """[rows, row] values in [-6, 6] -> uint8 [rows, row / 2], two e2m1 codes a byte
    (element 2i in the low nibble, 2i + 1 in the high one)."""
    grid = torch.tensor(FP4_GRID, dtype=y.dtype, device=y.device)
    midpoints = (grid[1:] + grid[:-1]) / 2
    magnitude = torch.bucketize(y.abs(), midpoints)  # ties: the smaller magnitude
    codes = (magnitude + 8 * (y < 0)).to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _fp4_values(packed: torch.Tensor) -> torch.Tensor:
    table = torch.tensor([*FP4_GRID, *(-v for v in FP4_GRID)], dtype=torch.float32,
                         device=packed.device)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    return table[codes.long()]


class TopK:
    """Top-k sparsification with error feedback (module docstring)."""

    def __init__(self, fraction: float, value_dtype: torch.dtype = torch.float32):
        if not 0 < fraction <= 1:
            raise ValueError(f"top-k fraction must be in (0, 1], got {fraction!r}")
        self.fraction, self.value_dtype = fraction, value_dtype

    def count(self, numel: int) -> int:
        """Entries sent of a buffer of `numel`."""
        return max(1, math.ceil(self.fraction * numel))

    @staticmethod
    def index_dtype(numel: int) -> torch.dtype:
        return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64

    def coded_bytes(self, numel: int) -> int:
        """Bytes sent for a buffer of `numel`: k values and k indices."""
        index_bytes = self.index_dtype(numel).itemsize
        return self.count(numel) * (self.value_dtype.itemsize + index_bytes)

    @torch.no_grad()
    def select(self, x: torch.Tensor, error: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indices, values in the value dtype, the new error buffer) for flat `x`."""
        total = x.float() if error is None else x.float() + error
        k = self.count(total.numel())
        indices = torch.topk(total.abs(), k, sorted=False).indices
        values = total[indices].to(self.value_dtype)
        remainder = total.clone()
        remainder[indices] -= values.float()
        return indices.to(self.index_dtype(total.numel())), values, remainder


def make_codec(kind: str, row: int = 128, topk_fraction: float = 0.01,
               value_dtype: torch.dtype = torch.float32) -> RowQuantizer | TopK | None:
    """The codec of `strategy.outer_compression` (None for none)."""
    if kind == "none":
        return None
    if kind == "topk":
        return TopK(topk_fraction, value_dtype)
    return RowQuantizer(kind, row)


def bytes_per_element(kind: str, row: int = 128, topk_fraction: float = 0.01,
                      value_bytes: int = 4) -> float:
    """Bytes one element of the pseudo-gradient costs on the wire (payload, before the
    collective's own factor): the traffic description of a compression setting."""
    if kind == "none":
        return float(value_bytes)
    if kind == "topk":
        return topk_fraction * (value_bytes + 4)
    return (row * _CODE_BITS[kind] / 8 + SCALE_BYTES) / row
