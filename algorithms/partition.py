"""Cut a model given as a layer list into contiguous pipeline stages.

Exercised by `pytest tests/test_pipeline.py -k partition`. The model arrives as
`GPT.as_layers()`: `[Embedding, Block * L, Head]`. The embedding always sits on the first
stage, the head (and so the loss) on the last; the L blocks are cut into `num_stages`
contiguous runs of at least one block each, so a pipeline needs `num_stages <= L`.

Two rules (`parallel.partition`, see docs/algorithms.md, Pipelines):
- `layers`: blocks spread as evenly as possible by count (earlier stages take the extra
  block when L is not a multiple of S).
- `parameters`: the cut that minimises the largest stage's parameter count, the
  embedding's parameters counted on the first stage and the head's on the last (a tied
  weight is counted on both: each of those stages holds and updates a copy).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

PARTITIONS = ("layers", "parameters")


def stage_bounds(layers: Sequence[nn.Module], num_stages: int,
                 partition: str = "layers") -> list[tuple[int, int]]:
    """`[(start, stop), ...]` per stage: indices into `layers` (embedding and head included).

    Raises ValueError naming `parallel.num_stages` or `parallel.partition` for a bad value.
    """
    return bounds_of([_numel(m) for m in layers], num_stages, partition)


def bounds_of(numels: Sequence[int], num_stages: int,
              partition: str = "layers") -> list[tuple[int, int]]:
    """`stage_bounds` from the layers' parameter counts (what the what-if knows)."""
    if partition not in PARTITIONS:
        raise ValueError(f"parallel.partition must be one of {list(PARTITIONS)}, "
                         f"got {partition!r}")
    num_blocks = len(numels) - 2
    if num_blocks < 1:
        raise ValueError(f"a pipeline needs a model of [embedding, blocks..., head], "
                         f"got {len(numels)} layers")
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"parallel.num_stages must be an integer >= 1, got {num_stages!r}")
    if num_stages > num_blocks:
        raise ValueError(
            f"parallel.num_stages ({num_stages}) must be <= the model's number of blocks "
            f"({num_blocks}): every stage holds at least one block"
        )
    if partition == "layers":
        sizes = [num_blocks // num_stages + (s < num_blocks % num_stages)
                 for s in range(num_stages)]
    else:
        sizes = _balanced_sizes(list(numels), num_stages)
    bounds, start = [], 1
    for s, size in enumerate(sizes):
        stop = start + size
        bounds.append((0 if s == 0 else start, stop + 1 if s == num_stages - 1 else stop))
        start = stop
    return bounds


def split_layers(layers: Sequence[nn.Module], num_stages: int,
                 partition: str = "layers") -> list[list[nn.Module]]:
    """The layers of each stage (the same module objects, not copies)."""
    return [list(layers[a:b]) for a, b in stage_bounds(layers, num_stages, partition)]


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _balanced_sizes(costs: list[int], num_stages: int) -> list[int]:
    """Blocks per stage minimising the largest stage cost (dynamic programme over cuts).

    `costs` is per layer including the embedding (first) and head (last), which are
    added to the first and last stage.
    """
    blocks = costs[1:-1]
    n = len(blocks)
    prefix = [0]
    for c in blocks:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, i: int, j: int) -> int:  # blocks [i, j) on `stage`
        extra = (costs[0] if stage == 0 else 0) + (costs[-1] if stage == num_stages - 1 else 0)
        return prefix[j] - prefix[i] + extra

    inf = float("inf")
    # best[s][j]: minimal max cost placing the first j blocks on stages 0..s-1
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], cost(s - 1, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    sizes, j = [], n
    for s in range(num_stages, 0, -1):
        i = cut[s][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]
