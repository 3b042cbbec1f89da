"""DeepSpeed engine (ZeRO stage 0-2) behind the DDP strategy (`strategy.backend: deepspeed`).

Exercised by `commbench run configs/ddp-tiny.yaml --set strategy.backend=deepspeed
--set strategy.zero_stage=1` and by tests/test_ddp.py. DeepSpeed's collectives bypass our
Communicator, so its comms logger (which synchronises and times every op) is switched on
and its entries are copied into the CommLedger after each step.
"""

from __future__ import annotations

from algorithms.base import StepStats, _microbatches


def build_engine(config, setup, optimizer):
    import deepspeed
    import deepspeed.ops

    # The shared-memory comm op JIT-compiles (~30 s) on first use; gloo is enough here.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    micro = setup.rank_batch_size // setup.num_microbatches
    ds_config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": setup.num_microbatches,
        "train_batch_size": micro * setup.num_microbatches * setup.comm.world_size,
        "gradient_clipping": setup.grad_clip,
        "zero_optimization": {"stage": config.zero_stage},
        "steps_per_print": 2**31 - 1,
        "comms_logger": {"enabled": True, "verbose": False, "prof_all": True, "debug": False},
    }
    engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=setup.model, optimizer=optimizer, config=ds_config, dist_init_required=False
    )
    return engine, ds_optimizer


def engine_step(strategy, batch) -> StepStats:
    """One optimizer step through the engine; DeepSpeed accumulates and clips itself."""
    engine = strategy.engine
    total_loss, tokens = 0.0, 0
    n = strategy.setup.num_microbatches
    for x, y in _microbatches(batch, n):
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        total_loss += loss.item() / n
        tokens += y.numel()
    strategy.step_index += 1
    return StepStats(loss=total_loss, tokens=tokens, comm_s=_drain_comms_log(strategy.comm))


def _drain_comms_log(comm) -> float:
    """Copy DeepSpeed's logged ops since the last call into the ledger; their seconds."""
    from deepspeed.comm.comm import comms_logger

    total = 0.0
    for name, by_size in comms_logger.comms_dict.items():
        for nbytes, (count, latencies_ms, _, _) in by_size.items():
            for ms in latencies_ms[:count]:
                comm.record(name, int(nbytes), ms / 1e3)
                total += ms / 1e3
    comms_logger.reset_data()
    return total

