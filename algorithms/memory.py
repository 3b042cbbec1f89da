"""What a strategy tells the memory plan (bench/memory.py) about one rank, before launch.

Plain numbers, no torch: the harness measures the model (parameters, the optimizer's
state, the activations one microbatch keeps for backward, on the meta device) and hands
them to the strategy class's `memory_terms(cfg, facts)` (algorithms/base.py
`Strategy.memory_terms`), which returns the rank's terms in bytes:
the ones every strategy has (`MemoryFacts.base_terms`) and its own (outer copies, weight
versions, stashed microbatches, buckets, shards). Names starting with "host: " are CPU
memory (offloaded state), counted against a GPU only when the run is on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

HOST = "host: "
"""Prefix of a term held in CPU memory (e.g. DiLoCo's offloaded outer state)."""


@dataclass(frozen=True)
class MemoryFacts:
    """One rank's model-side numbers (bytes), as the harness measured them."""

    param_bytes: int
    """This rank's parameters (fp32; a pipeline stage's, or the whole model)."""
    optimizer: dict[str, int]
    """The inner optimizer's state on this rank's parameters, by term (delay wrapper included)."""
    optimizer_step_bytes: int
    """Temporaries of one optimizer step (foreach lists on CUDA, the largest tensor on CPU)."""
    activation_bytes: int
    """What one microbatch's forward through this rank's layers keeps for backward."""
    block_bytes: int = 0
    """One block's activations for one microbatch: backward's working set (the gradients
    of a block's activations), and what checkpointing recomputes in a block's backward."""
    checkpointing: bool = False
    """Whether blocks are checkpointed (`activation_bytes` then holds their inputs only)."""
    logits_bytes: int = 0
    """One microbatch's logits (B x T x V; 0 off the head's rank): alive through backward
    with their gradient."""
    boundary_bytes: int = 0
    """One microbatch's hidden states (B x T x C): what crosses a stage boundary."""
    weight_copy_bytes: int = 0
    """bf16 autocast: the copies of this rank's weights autocast caches in a region and the
    matmuls save for backward (0 in fp32); not in `activation_bytes`."""
    stage: int = 0
    num_stages: int = 1
    num_microbatches: int = 1
    world_size: int = 1
    group_size: int = 1
    shard: int = 1
    """Ranks one replica's parameters, gradients and optimizer state are sharded over."""
    unit_param_bytes: int = 0
    """The largest transformer block's parameters (an FSDP unit gathered whole)."""
    root_param_bytes: int = 0
    """The parameters outside the blocks (embedding, head, final norm: FSDP's root unit)."""
    extra: dict = field(default_factory=dict)

    def base_terms(self, in_flight: float = 1, autocast_regions: float = 1) -> dict[str, int]:
        """Parameters, gradients, optimizer state (sharded over `shard` ranks) and the
        activations of `in_flight` microbatches with the logits and the step's temporaries;
        under bf16, autocast's weight copies of `autocast_regions` alive at once (gathered
        whole under FSDP: never sharded)."""
        n = self.shard
        terms = {"parameters": self.param_bytes // n, "gradients": self.param_bytes // n,
                 **{k: v // n for k, v in self.optimizer.items()},
                 "optimizer step temporaries": self.optimizer_step_bytes // n,
                 "activations": int(self.activation_bytes * in_flight)}
        if self.weight_copy_bytes:
            terms["bf16 weight copies (autocast)"] = int(self.weight_copy_bytes
                                                         * autocast_regions)
        terms["backward working set (one block)"] = self.block_bytes
        if self.checkpointing:
            terms["activation recomputation (one block)"] = self.block_bytes
        if self.logits_bytes:
            terms["logits and their gradient"] = 2 * self.logits_bytes
        return terms

    def sharded(self, shard: int) -> MemoryFacts:
        return replace(self, shard=shard)


def shard_terms(terms: dict[str, int], names, ranks: int) -> dict[str, int]:
    """`terms` with those whose name starts with one of `names` divided over `ranks`."""
    return {k: v // ranks if k.startswith(tuple(names)) else v for k, v in terms.items()}


def fsdp_terms(facts: MemoryFacts) -> dict[str, int]:
    """What FSDP2 holds unsharded besides the shards: the root unit (embedding, head)
    through forward and backward, two blocks gathered (the one running and the one
    prefetched), and a block's full gradients with their reduce-scatter buffer."""
    return {"FSDP: gathered root (embedding, head)": facts.root_param_bytes,
            "FSDP: gathered blocks (running + prefetched)": 2 * facts.unit_param_bytes,
            "FSDP: a block's unsharded gradients + reduce-scatter buffer":
                2 * facts.unit_param_bytes}


def require_shard_ranks(cfg, ranks: int, key: str) -> None:
    """parallel.shard=fsdp shards a replica over its ranks: refuse a replica of one rank."""
    if cfg.parallel.shard == "fsdp" and ranks < 2:
        raise ValueError(f"parallel.shard=fsdp shards each replica over its ranks, but {key} "
                         f"is {ranks}: a replica of one rank has nothing to shard (use "
                         f"parallel.shard=none, or >= 2 ranks per replica)")
