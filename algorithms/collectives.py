"""The averages `Communicator.average` and `average_sparse` run on a process group.

    pytest tests/test_compress.py

Raw torch.distributed work, unrecorded (the Communicator times and records it, as one op),
the same on every rank of the group: the plain mean (an all-reduce), and the compressed
exchanges of the outer step's pseudo-gradients (the codecs: algorithms/compress.py).

Averages in a compressed format (the outer step's pseudo-gradients,
`algorithms/compress.py`): quantized values cannot be summed inside an all-reduce without
overflowing their format, so `average(..., codec=RowQuantizer)` does what real systems do:
an all-to-all of the quantized shards (rank j receives every rank's rows of shard j), a
local reduce of the shard in fp32, its mean re-quantized, and an all-gather of the
quantized means; recorded as ONE op, `quantized_all_reduce`, whose `nbytes` is this rank's
whole quantized buffer (codes and scales; wire: 2(n-1)/n of it, as a ring all-reduce).
`average_sparse` all-gathers each rank's top-k (values and indices) and sums them in rank
order; recorded as an `all_gather` of the bytes this rank contributes. `gathered_average`
does the same for a payload in an outer rule's own format, decoded by the rule.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def mean_in_place(flat: torch.Tensor, pg, size: int) -> torch.Tensor:
    """The group's mean of `flat`, in place: one all-reduce (AVG on NCCL; gloo sums, then
    divides)."""
    native_avg = dist.get_backend(pg) == "nccl"  # gloo has no ReduceOp.AVG: sum, divide
    dist.all_reduce(flat, op=dist.ReduceOp.AVG if native_avg else dist.ReduceOp.SUM, group=pg)
    return flat if native_avg else flat.div_(size)


def quantized_average(flat: torch.Tensor, codec, pg, size: int) -> torch.Tensor:
    """The group's mean of `flat` through `codec` (a RowQuantizer): all-to-all of the coded
    shards, each rank's shard reduced in fp32 (in rank order) and re-coded, all-gather."""
    numel = flat.numel()
    padded = torch.zeros(codec.padded(numel, size), dtype=torch.float32, device=flat.device)
    padded[:numel] = flat
    coded = codec.encode(padded)
    received = torch.empty_like(coded)
    dist.all_to_all_single(received, coded, group=pg)
    shard = codec.decode(received).view(size, -1).sum(dim=0).div_(size)
    gathered = torch.empty_like(coded)
    dist.all_gather_into_tensor(gathered, codec.encode(shard), group=pg)
    return codec.decode(gathered)[:numel]


def sparse_average(indices: torch.Tensor, values: torch.Tensor, numel: int, pg,
                   size: int) -> torch.Tensor:
    """The group's mean of the sparse tensors (every rank's `indices`, `values`): one
    all-gather of both, as bytes, summed in rank order into a dense fp32 tensor."""
    value_bytes = tensor_bytes(values)
    payload = torch.cat([values.contiguous().view(torch.uint8),
                         indices.contiguous().view(torch.uint8)])
    gathered = torch.empty(size * payload.numel(), dtype=torch.uint8, device=payload.device)
    dist.all_gather_into_tensor(gathered, payload, group=pg)
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    for part in gathered.view(size, -1):
        # copies: a byte slice views as a wider dtype only at an offset divisible by its
        # size, which the indices after k half-precision values (k odd) are not
        out.index_add_(0, part[value_bytes:].clone().view(indices.dtype).long(),
                       part[:value_bytes].clone().view(values.dtype).float())
    return out.div_(size)


def gathered_average(payload: torch.Tensor, decode, pg, size: int) -> torch.Tensor:
    """The group's mean of what every rank's coded `payload` (a flat uint8 tensor, the same
    size on every rank) decodes to: one all-gather of the payloads, each decoded by
    `decode(payload) -> dense fp32` and summed in rank order (an outer rule's own format,
    e.g. SparseLoCo's chunked top-k, algorithms/outer_rules/sparseloco.py)."""
    gathered = torch.empty(size * payload.numel(), dtype=torch.uint8, device=payload.device)
    dist.all_gather_into_tensor(gathered, payload.contiguous(), group=pg)
    out = None
    for part in gathered.view(size, -1):
        dense = decode(part)
        out = dense if out is None else out.add_(dense)
    return out.div_(size)


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
