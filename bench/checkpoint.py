"""Checkpoints of a run: each rank's resumable state, and the final evaluation model.

    commbench run configs/ddp-tiny.yaml --set checkpoint.every=50   # state-rank{N}.pt
    commbench run --resume RUN_DIR                                  # continue from it

Every rank saves its own state (the strategy's `state_dict`, the loop state, the torch
RNG and the CommLedger) at the same step, atomically, and waits until all have. On
resume each rank restores it, and rank 0 drops the metrics rows logged after the
checkpoint (the steps are trained again). checkpoints/final.pt holds the eval model's
weights, its GPT config and tokenizer name: what `commbench eval` and `export` load.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from algorithms.base import Strategy
from algorithms.comm import CommLedger
from bench.records import RunDir


def resume_requested() -> bool:
    """`commbench run --resume` sets COMMBENCH_RESUME=1 for the ranks."""
    return bool(os.environ.get("COMMBENCH_RESUME"))


def save_state(run: RunDir, rank: int, step: int, strategy: Strategy, ledger: CommLedger,
               loop_state: dict[str, Any]) -> None:
    """Save this rank's state after `step` steps; returns when every rank has saved."""
    payload = {"step": step, "strategy": strategy.state_dict(), "loop": loop_state,
               "rng": torch.get_rng_state(), "ledger": ledger.records}
    run.save_torch(payload, run.state_checkpoint(rank))
    dist.barrier()  # every rank's state is on disk before any rank moves on


def load_state(run: RunDir, rank: int, strategy: Strategy,
               ledger: CommLedger) -> dict[str, Any] | None:
    """Restore this rank's saved state when resuming; the saved loop state, or None."""
    path = run.state_checkpoint(rank)
    if not resume_requested() or not path.exists():
        return None
    payload = torch.load(path, weights_only=False)
    strategy.load_state_dict(payload["strategy"])
    torch.set_rng_state(payload["rng"])
    ledger.records.extend(payload["ledger"])
    step = payload["step"]
    if rank == 0:  # drop rows logged after the checkpoint; they will be redone
        rows = [r for r in run.read_metrics() if r["step"] <= step]
        run.write_metrics(rows)
    return payload["loop"]


def save_eval_model(run: RunDir, rank: int, strategy: Strategy, gpt_config: dict,
                    tokenizer: str, step: int) -> None:
    """Rank 0 writes checkpoints/final.pt from every rank's `export_state()` (merged, the
    first rank's value of a key wins); every rank calls it (a collective)."""
    with strategy.comm.phase("eval"):
        mine = {k: v.detach().cpu() for k, v in strategy.export_state().items()}
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    if rank == 0:
        state: dict[str, torch.Tensor] = {}
        for part in parts:
            for key, value in part.items():
                state.setdefault(key, value)
        payload = {"model": state, "gpt_config": dict(gpt_config), "tokenizer": tokenizer,
                   "step": step}
        run.save_torch(payload, run.final_checkpoint)
