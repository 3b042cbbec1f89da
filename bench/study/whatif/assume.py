"""The assumptions a planner states, applied to a method's traffic and compute.

    commbench whatif configs/whatif/streaming-diloco-paper.yaml --set assume.exchange_dtype=fp32

A scenario's `assume:` section (bench/study/whatif/scenario.py `Assume`) says what the
published planners assume where the harness does otherwise: the dtype the data-parallel
reductions send, whether a step's reduction overlaps the backward pass, the tokens per
step. Its defaults are what the harness runs; `restate` rewrites a strategy's traffic
description (algorithms/traffic.py) under them, and `lines` says each in words, printed
with every result. Heterogeneous compute (per-replica speed, `hardware.replica_speed`)
is `speed_of`.
"""

from __future__ import annotations

from dataclasses import replace

from algorithms.traffic import Traffic, Transfer

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of each exchange dtype a scenario may state."""
STATE_PHASES = frozenset({"train", "inner", "outer", "gossip", "dp", "tied"})
"""Ledger phases whose collectives carry gradients or θ (not "clip": one fp32 norm)."""


def carries_state(t: Transfer) -> bool:
    """Whether `t` sends gradients or θ in fp32 (what `assume.exchange_dtype` rescales):
    a collective or a gossip exchange of a state phase, not a pipeline's activations
    (point-to-point in phase "train"), not a payload the method already sends narrower
    (`Transfer.word_bytes` < 4: a bf16 outer all-reduce, int8 or fp4 codes)."""
    if t.phase not in STATE_PHASES or t.word_bytes != 4:
        return False
    return t.peers is None or t.phase == "gossip"


def restate(traffic: Traffic, exchange_dtype: str, dp_overlap: str) -> Traffic:
    """`traffic` as the planner states it (module docstring); the defaults ("harness",
    "buckets") return it unchanged.

    exchange_dtype: every fp32 payload of gradients or θ (`carries_state`) sent in that
    dtype instead (bytes x dtype / 4, rounded down to whole elements).
    dp_overlap: "buckets" keeps DDP's bucket timeline; "backward" lets a step's whole
    data-parallel reduction (DDP's buckets, FSDP2's reduce-scatter) run under the whole
    backward, each launched when backward starts (exposed = max(0, its time - backward));
    "none" exposes it in full; "every" is "backward" for outer all-reduces and gossip
    exchanges too (those the method overlaps itself, `overlap_steps`, keep it). FSDP2's
    all-gathers keep their own overlap (none)."""
    if exchange_dtype == "harness" and dp_overlap == "buckets":
        return traffic
    word = DTYPE_BYTES.get(exchange_dtype, 4)
    memo: dict[Transfer, Transfer] = {}

    def one(t: Transfer) -> Transfer:
        if t in memo:
            return memo[t]
        out = t
        if word != 4 and carries_state(t):
            sizes = tuple(n // 4 * word for n in t.sizes)
            peer = None if t.peer_nbytes is None else tuple(n // 4 * word for n in t.peer_nbytes)
            out = replace(out, sizes=sizes, peer_nbytes=peer, word_bytes=word)
        reduction = t.ready is not None or (t.op == "reduce_scatter" and t.peers is None)
        if dp_overlap == "every" and not t.overlap_steps and (
                (reduction and t.phase in ("train", "inner")) or t.phase in ("outer", "gossip")):
            out = replace(out, ready=(1.0,) * len(t.sizes))
        elif reduction and t.phase in ("train", "inner"):
            if dp_overlap in ("backward", "every"):
                out = replace(out, ready=(1.0,) * len(t.sizes))
            elif dp_overlap == "none":
                out = replace(out, ready=None)
        memo[t] = out
        return out

    return replace(traffic, transfers=lambda rank, step: [
        one(t) for t in traffic.transfers(rank, step)])


def speed_of(replica_speed: list[float], gpus_per_replica: int):
    """rank -> its compute speed relative to the scenario's (1: as stated; 0.5: a
    straggler taking twice as long), from the per-replica list (replicas past its end: 1)."""
    def speed(rank: int) -> float:
        replica = rank // gpus_per_replica
        return replica_speed[replica] if replica < len(replica_speed) else 1.0
    return speed


DP_OVERLAP_WORDS = {
    "buckets": "a step's data-parallel reduction overlaps backward as the harness runs "
               "torch DDP: bucket i launched once backward has produced it, the last when "
               "backward ends (assume.dp_overlap=buckets)",
    "backward": "a step's data-parallel reduction (DDP's buckets, FSDP2's reduce-scatter) "
                "may run under the whole backward: exposed = max(0, its time - backward) "
                "(assume.dp_overlap=backward, the published simulators' assumption)",
    "none": "a step's data-parallel reduction is exposed in full (assume.dp_overlap=none)",
    "every": "every reduction, outer all-reduces and gossip exchanges too, may run under "
             "the backward of the step that issues it: exposed = max(0, the step's "
             "reductions - backward) (assume.dp_overlap=every, the Streaming DiLoCo "
             "authors' calculator: 'the reduction of gradients or outer gradients is "
             "overlapped over the backward pass')",
}


def lines(exchange_dtype: str, dp_overlap: str, tokens: str) -> list[str]:
    """The planner's assumptions in words (printed with every result)."""
    dtype = ("gradients and θ sent in fp32, as the runs send them (assume.exchange_dtype="
             "harness); an outer exchange a method narrows itself (outer_grad_dtype, "
             "compression) in its own dtype" if exchange_dtype == "harness" else
             f"gradients and θ sent in {exchange_dtype} (assume.exchange_dtype: "
             f"{DTYPE_BYTES[exchange_dtype]} bytes per parameter where the runs send 4); an "
             "outer exchange a method narrows itself keeps its own dtype")
    blocking = ([] if dp_overlap == "every" else [
        "outer all-reduces and gossip exchanges block (as the code runs them), except a "
        "streaming exchange's overlap_steps"])
    return [dtype, DP_OVERLAP_WORDS[dp_overlap], *blocking, tokens]
