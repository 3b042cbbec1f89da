"""What a DiLoCo-family outer round sends when it streams, overlaps or compresses: the
what-if's description of Streaming DiLoCo (arXiv 2501.18512) and of the compressed
outer exchanges, as `algorithms/traffic.py` describes the plain round. One schedule for
the family, each strategy's exchange (`Exchange`): DiLoCo's average (below), Pier's the
same after its lazy start (`warmup_steps`), SparseLoCo's all-gather of each fragment's
coded payload, NoLoCo's pairwise exchange per fragment (their files).

    pytest tests/test_whatif_streaming.py tests/test_outer_traffic.py

Plain numbers (the model's `TrafficFacts`, the strategy's config); the records they
stand for are the ones algorithms/diloco.py, algorithms/outer.py and algorithms/comm.py
write (tests/test_whatif.py holds them against real runs' ledgers):
- fragments (`fragment_numels`): each fragment's parameters, as algorithms/streaming.py
  `fragment_indices` cuts them (blocks by pattern, the embedding and a tied head with
  block 0's fragment, the head and final norm with the last block's), this rank's
  shards when the replica is sharded;
- the schedule (`StreamingSchedule`): fragment p's sync points every H/P steps,
  round-robin; at the last step every fragment not synced there syncs, blocking;
- an exchange (`exchange_transfer`): uncompressed, one all-reduce in the wire dtype;
  int8/fp8/fp4, one `quantized_all_reduce` of the coded buffer (codes and per-row
  scales, padded to whole rows per replica); top-k, one all-gather of the values and
  indices; over the ranks holding this rank's position in every replica;
- overlap τ: a regular sync's exchange is launched τ steps earlier and recorded in the
  sync step, where it is priced under those τ steps' compute (`Transfer.overlap_steps`).
"""

from __future__ import annotations

from collections.abc import Callable

from algorithms.streaming import StreamingSchedule, block_fragments
from algorithms.traffic import Traffic, Transfer, cross_of, outer_notes, replica_inner, shard_rows


def fragment_numels(facts, fragments: int, pattern: str, ranks: int = 1,
                    index: int = 0) -> list[int]:
    """Elements of each fragment this rank's outer step exchanges: every parameter's
    (`ranks` > 1: its dim-0 shard on replica rank `index`, as FSDP2 holds it)."""
    layers = len(facts.layer_bytes) or max(p.layer for p in facts.params) + 1
    blocks = max(1, layers - 2)
    if fragments == 1:
        of_layer = [0] * layers
    else:
        of_block = block_fragments(blocks, fragments, pattern)
        of_layer = [of_block[0], *of_block, of_block[-1]]
    out = [0] * fragments
    for p in facts.params:
        numel = p.nbytes // 4
        if ranks > 1:
            rows = p.shape[0] if p.shape else 1
            numel = shard_rows(rows, ranks, index) * (numel // max(1, rows))
        out[of_layer[min(p.layer, len(of_layer) - 1)]] += numel
    return out


def exchange_transfer(config, numel: int, group: tuple[int, ...] | None, replicas: int,
                      wire_bytes: int, overlap_steps: int = 0) -> Transfer:
    """One fragment's exchange of `numel` fp32 elements over `group` (module docstring)."""
    codec = config.codec()
    if codec is None:
        return Transfer("outer", "all_reduce", (numel * wire_bytes,), group,
                        overlap_steps=overlap_steps, word_bytes=wire_bytes)
    if config.outer_compression == "topk":
        return Transfer("outer", "all_gather", (codec.coded_bytes(numel),), group,
                        overlap_steps=overlap_steps, word_bytes=1)
    return Transfer("outer", "quantized_all_reduce", (codec.coded_bytes(numel, replicas),),
                    group, overlap_steps=overlap_steps, word_bytes=1)


Exchange = Callable[[int, int, int, int, int], list[Transfer]]
"""(rank, fragment, its round, its elements on this rank, overlap steps) -> what `rank`
records for that fragment's sync: the exchange of a strategy whose round sends otherwise
than DiLoCo's average (SparseLoCo's all-gather, NoLoCo's pairwise exchange). `round`
counts the fragment's own syncs before this one (`StreamingSchedule.syncs_before`)."""


def average_exchange(config, cfg, wire_bytes: int) -> Exchange:
    """DiLoCo's exchange (`exchange_transfer`) across the ranks holding `rank`'s position
    in every replica."""
    p = cfg.parallel
    world, g = p.world_size, p.group_size

    def exchange(rank: int, fragment: int, round_: int, numel: int, overlap: int):
        return [exchange_transfer(config, numel, cross_of(rank, g, world), world // g,
                                  wire_bytes, overlap)]
    return exchange


def streaming_outer(config, cfg, facts, wire_bytes: int, exchange: Exchange | None = None,
                    warmup_steps: int = 0):
    """(rank, step) -> the outer transfers `rank` records in loop step `step` (0-based):
    for each fragment synced at the end of it, its exchange (`exchange`, default
    DiLoCo's; overlapped by τ where it was launched early). Nothing with one replica, nor
    at a sync within the first `warmup_steps` (Pier's lazy start fills its momentum
    locally: nothing launched, nothing sent)."""
    p = cfg.parallel
    world, g, steps = p.world_size, p.group_size, cfg.run.steps
    replicas = world // g
    schedule = StreamingSchedule(config.fragments, config.inner_steps, config.overlap_steps,
                                 steps)
    exchange = exchange or average_exchange(config, cfg, wire_bytes)
    sharded = p.shard == "fsdp"
    cache: dict[int, list[int]] = {}

    def numels(rank: int) -> list[int]:
        index = rank % g if sharded else 0
        if index not in cache:
            cache[index] = fragment_numels(facts, config.fragments, config.fragment_pattern,
                                           g if sharded else 1, index)
        return cache[index]

    def outer(rank: int, step: int) -> list[Transfer]:
        taken = step + 1
        if replicas == 1 or taken <= warmup_steps:
            return []
        regular = schedule.regular(taken)
        out = []
        for fragment in schedule.syncs(taken):
            launched = (fragment == regular and config.overlap_steps > 0
                        and schedule.launch(taken - config.overlap_steps) == fragment)
            out += exchange(rank, fragment, schedule.syncs_before(fragment, taken),
                            numels(rank)[fragment], config.overlap_steps if launched else 0)
        return out
    return outer


def streaming_traffic(config, cfg, facts, wire_bytes: int, exchange: Exchange | None = None,
                      warmup_steps: int = 0, warm_inner: Callable | None = None,
                      notes: list[str] | None = None) -> Traffic:
    """DiLoCo's family with fragments, overlap or a codec: every step the replica's inner
    traffic (algorithms/traffic.py `replica_inner`; in the first `warmup_steps`,
    `warm_inner`'s: Pier's lazy start), then `streaming_outer`'s syncs; the pattern
    repeats every H steps (in each phase: the lazy start, then the rounds)."""
    inner = replica_inner(cfg, facts, config.bucket_cap_mb)
    outer = streaming_outer(config, cfg, facts, wire_bytes, exchange, warmup_steps)
    steps = cfg.run.steps

    def transfers(rank: int, step: int) -> list[Transfer]:
        mine = warm_inner(rank) if step < warmup_steps else inner(rank)
        return [*mine, *outer(rank, step)]

    phases = [(0, warmup_steps), (warmup_steps, steps)] if 0 < warmup_steps < steps else []
    return Traffic(steps, transfers, period=config.inner_steps, phases=phases,
                   notes=[*outer_notes(cfg), *streaming_notes(config), *(notes or [])])


def streaming_notes(config) -> list[str]:
    """What the description assumes, in words."""
    notes = []
    if config.fragments > 1:
        notes.append(f"Streaming DiLoCo: {config.fragments} fragments "
                     f"({config.fragment_pattern}), one synced every "
                     f"{config.inner_steps // config.fragments} steps, each every "
                     f"{config.inner_steps}")
    if config.overlap_steps:
        notes.append(f"each regular sync's exchange launched {config.overlap_steps} steps "
                     "early: exposed = max(0, its time - those steps' compute); the last "
                     "step's other fragments block")
    if config.outer_compression != "none":
        notes.append(f"outer exchange compressed ({config.outer_compression}): the coded "
                     "bytes the run sends, through the collectives it runs")
    return notes
