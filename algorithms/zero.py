"""DeepSpeed engine (ZeRO stage 0-2) behind the DDP strategy (`strategy.backend: deepspeed`).

Exercised by `commbench run configs/ddp-tiny.yaml --set strategy.backend=deepspeed
--set strategy.zero_stage=1` and by tests/test_ddp.py; the math is docs/algorithms.md's
DDP section. DeepSpeed's collectives bypass our Communicator, so its comms logger is used
to learn each op's name and logical bytes, which are copied into the CommLedger.

The logger synchronises the device after EVERY op it sees, which on a GPU would remove
ZeRO's overlap of communication with compute. So:
- CPU (gloo): the logger stays on. Its device synchronise is a no-op there and gloo ops
  block the host, so each op's logged latency is its real, fully exposed time: the step's
  exposed communication is their sum, each record carries its own seconds.
- CUDA: the logger is on for the first step only, to learn the step's ops and sizes
  (identical every step for a fixed batch shape); later steps replay those records with
  `seconds = 0` (unknown per op) and the logger off. The step is timed as for torch DDP:
  exposed = from the last gradient becoming ready (a post-accumulate-grad hook on every
  parameter, a CUDA event) until the engine's backward returned (algorithms/ddp.py's
  clocks). Known gap, NOT measured on CUDA: ZeRO-1/2's parameter all-gather inside
  `engine.step()` and ZeRO-2 reductions finished before the last gradient count as compute.

Precision (`model.precision: bf16`): the engine disables an autocast entered outside it,
so its own `torch_autocast` section turns bf16 autocast on around the forward, as torch
DDP runs it: fp32 weights, gradients and optimizer. Its lower-precision-safe module list
is left empty, so gradients are reduced in fp32 like DDP's (DeepSpeed's default would
reduce Linear gradients in bf16: half the bytes, a different algorithm from the
baseline's). DeepSpeed's own `bf16` section (bf16 weights, fp32 master copy) is not used
for the same reason.
"""

from __future__ import annotations

import torch

from algorithms.base import _microbatches
from algorithms.clocks import HostClock, clock_for
from algorithms.contract import StepStats

LOSS_SCALER, ZERO_STAGE, PARAM_SLICE_MAPPINGS = "loss_scaler", "zero_stage", "param_slice_mappings"
"""DeepSpeed's keys of the objects in a ZeRO-1/2 optimizer state (deepspeed.checkpoint
.constants; not imported here: DeepSpeed is imported only by the code that uses it)."""


def autocast_config(precision: str) -> dict:
    """The DeepSpeed config section for `model.precision` (module docstring): bf16
    autocast around the engine's forward, fp32 gradient reductions; fp32: nothing."""
    if precision == "fp32":
        return {}
    if precision != "bf16":
        raise ValueError(f"model.precision must be fp32 or bf16, got {precision!r}")
    return {"torch_autocast": {"enabled": True, "dtype": "bfloat16",
                               "lower_precision_safe_modules": []}}


class ZeroEngine:
    """The DeepSpeed engine of one rank and the measurement of its steps (module docstring).

    `optimizer` is the engine's wrapped optimizer (the strategy's `set_lr` and state use it).
    """

    def __init__(self, config, setup, optimizer):
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
            # ZeRO-1/2 hand the optimizer flat partitions: fine for the elementwise
            # optimizers config validation lets through (algorithms/ddp.py DEEPSPEED_REFUSES)
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31 - 1,
            "comms_logger": {"enabled": True, "verbose": False, "prof_all": True,
                             "debug": False},
            **autocast_config(setup.precision),
        }
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=setup.model, optimizer=optimizer, config=ds_config, dist_init_required=False
        )
        reset_comms_log()  # the initial parameter broadcast is not training traffic
        self.comm, self.num_microbatches = setup.comm, setup.num_microbatches
        self.zero_stage = config.zero_stage
        self.clock = clock_for(next(setup.model.parameters()).device)
        self.last_gradient = None
        """Clock mark of the latest gradient accumulation (the end of backward compute)."""
        if not isinstance(self.clock, HostClock):
            for p in setup.model.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._gradient_ready)
        self.step_ops: list[tuple[str, int]] | None = None
        """CUDA: the (op, bytes) of one step, learnt from the logger on the first step."""

    def state_dict(self) -> dict:
        """The model and the engine's optimizer (ZeRO-1/2: this rank's partition of the fp32
        master weights and optimizer state, DeepSpeed's own format with its objects made
        plain, so the checkpoint loads with `torch.load(weights_only=True)`, which executes
        nothing: the loss scaler's attributes, the stage's number, and without the
        parameters' slice addresses, which the engine computes and its load never reads)."""
        optimizer = dict(self.optimizer.state_dict())
        if self.zero_stage > 0:
            optimizer[LOSS_SCALER] = dict(vars(optimizer[LOSS_SCALER]))
            optimizer[ZERO_STAGE] = int(optimizer[ZERO_STAGE])
            optimizer.pop(PARAM_SLICE_MAPPINGS, None)
        return {"model": self.engine.module.state_dict(), "optimizer": optimizer}

    def load_state_dict(self, state: dict) -> None:
        self.engine.module.load_state_dict(state["model"])
        if self.zero_stage == 0:
            self.optimizer.load_state_dict(state["optimizer"])
            return
        from deepspeed.runtime.zero.config import ZeroStageEnum

        optimizer = dict(state["optimizer"])
        scaler = self.optimizer.loss_scaler  # the engine's own object, its saved attributes
        vars(scaler).update(optimizer[LOSS_SCALER])
        optimizer[LOSS_SCALER] = scaler
        optimizer[ZERO_STAGE] = ZeroStageEnum(optimizer[ZERO_STAGE])
        # DeepSpeed reads the entry of this rank's data-parallel index from a list of every
        # rank's partition; each rank restores its own, from the fp32 master copy (exact)
        states = [optimizer] * self.comm.world_size
        self.optimizer.load_state_dict(states, load_optimizer_states=True,
                                       load_from_fp32_weights=True)

    def close(self) -> None:
        release_deepspeed_state()

    def _gradient_ready(self, param) -> None:
        self.last_gradient = self.clock.mark()

    def train_step(self, batch) -> StepStats:
        """One optimizer step through the engine; DeepSpeed accumulates and clips itself."""
        losses, tokens, backward_end = [], 0, None
        n = self.num_microbatches
        for x, y in _microbatches(batch, n):
            _, loss = self.engine(x, y)
            self.engine.backward(loss)
            backward_end = self.clock.mark()
            self.engine.step()
            losses.append(loss.detach())
            tokens += y.numel()
        # one host sync a step, as DataParallelStrategy (not one per microbatch)
        total_loss = torch.stack(losses).mean().item()
        if isinstance(self.clock, HostClock):
            comm_s = _drain_comms_log(self.comm)
        else:
            self._replay_step_ops()
            self.clock.synchronize()
            comm_s = max(0.0, self.clock.seconds(self.last_gradient, backward_end))
        return StepStats(loss=total_loss, tokens=tokens, comm_s=comm_s)

    def _replay_step_ops(self) -> None:
        """CUDA: learn the step's ops on the first step, then switch the logger off."""
        from deepspeed.comm.comm import comms_logger

        if self.step_ops is None:
            self.step_ops = [(name, nbytes) for name, nbytes, _ in _logged_ops()]
            comms_logger.enabled = False  # no per-op device synchronise from here on
        for name, nbytes in self.step_ops:
            self.comm.record(name, nbytes, 0.0)


def per_op_seconds(comms_dict: dict) -> list[tuple[str, int, float]]:
    """DeepSpeed's comms-logger dict {name: {bytes: [count, latencies_ms, ...]}} as
    (name, bytes, seconds) per op.

    The logger appends, per call, its op timer's CUMULATIVE milliseconds since the timer's
    last reset (`timers(name).elapsed(reset=False)`, deepspeed/comm/comm.py), not the
    call's own. One name's values, over all its sizes, are that timer's running total, so
    sorted they give each call's own time as the difference from the previous value
    (callers reset the timers with the log: see `reset_comms_log`).
    """
    ops = []
    for name, by_size in comms_dict.items():
        calls = sorted((ms, int(nbytes)) for nbytes, (count, latencies_ms, *_) in by_size.items()
                       for ms in latencies_ms[:count])
        previous = 0.0
        for ms, nbytes in calls:
            ops.append((name, nbytes, max(0.0, ms - previous) / 1e3))
            previous = ms
    return ops


def release_deepspeed_state() -> None:
    """Drop DeepSpeed's module-level references to this engine's process groups and model
    parallel unit, so another engine built later in the same process (the combination
    matrix, `commbench doctor`) does not inherit them."""
    from deepspeed.utils import groups

    groups._release_process_group_references(None)


def reset_comms_log() -> None:
    """Empty DeepSpeed's comms log and reset its op timers (their totals restart at 0)."""
    from deepspeed.comm.comm import comms_logger, timers

    for name in comms_logger.comms_dict:
        timers(name).reset()
    comms_logger.reset_data()


def _logged_ops():
    """(name, bytes, seconds) of every op DeepSpeed logged since the last reset; resets."""
    from deepspeed.comm.comm import comms_logger

    ops = per_op_seconds(comms_logger.comms_dict)
    reset_comms_log()
    return ops


def _drain_comms_log(comm) -> float:
    """Copy DeepSpeed's logged ops into the ledger; return their summed seconds."""
    ops = _logged_ops()
    for name, nbytes, seconds in ops:
        comm.record(name, nbytes, seconds)
    return sum(seconds for _, _, seconds in ops)


# ---------------------------------------------------------------------- traffic (what-if)

BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default gradient bucket (ZeRO-0's `buffered_allreduce_fallback`
elements_per_buffer, ZeRO-1/2's reduce_bucket_size), in elements; this engine keeps it."""
ALIGNMENT = 2
"""ZeRO-1/2 pad each parameter group's flat buffer to a multiple of ALIGNMENT x the
data-parallel ranks elements (stage_1_and_2 `nccl_start_alignment_factor`)."""


def zero_traffic(cfg, facts, stage: int):
    """What this engine's DeepSpeed records each step (module docstring: its comms
    logger's name and logical bytes, over the world, which is the data-parallel group):
    the gradients all-reduced in buckets of BUCKET_ELEMENTS, once a step (ZeRO-2: after
    every microbatch's backward) (ZeRO-0: parameters in
    registration order, a bucket closing once past it; ZeRO-1/2: parameter groups in
    order, a bucket closing before a parameter would pass it), then the gradient norm's
    scalar all-reduce (ZeRO-0: only with optim.grad_clip > 0; ZeRO-1/2: two scalars, the
    norm and the overflow check), and ZeRO-1/2 the updated partition of each parameter
    group all-gathered (`all_gather_into_tensor`: this rank's share of the group's flat
    buffer, padded). Parameter groups are bench/optim.py's (>= 2-D tensors, then the
    rest). Checked against 4-rank runs of the tiny model (one bucket); the split of
    models past 5e8 parameters follows DeepSpeed 0.19's code, not checked by a run."""
    from algorithms.traffic import Traffic, Transfer

    world = cfg.parallel.world_size
    numels = [p.nbytes // 4 for p in facts.params]
    groups = [[n for p, n in zip(facts.params, numels, strict=True) if len(p.shape) >= 2],
              [n for p, n in zip(facts.params, numels, strict=True) if len(p.shape) < 2]]
    buckets, size = [], 0
    for n in (numels if stage == 0 else [n for g in groups for n in g]):
        if stage > 0 and size and size + n > BUCKET_ELEMENTS:
            buckets.append(size)
            size = 0
        size += n
        if stage == 0 and size > BUCKET_ELEMENTS:
            buckets.append(size)
            size = 0
    if size:
        buckets.append(size)
    passes = cfg.parallel.num_microbatches if stage == 2 else 1  # ZeRO-2 reduces each one
    step = [Transfer("train", "all_reduce", (b * 4,)) for b in buckets] * passes
    scalars = 2 if stage > 0 else int(cfg.optim.grad_clip > 0)
    step += [Transfer("train", "all_reduce", (4,))] * scalars
    if stage > 0 and world > 1:
        align = ALIGNMENT * world
        step += [Transfer("train", "all_gather_into_tensor", (-(-sum(g) // align) * align
                                                                // world * 4,))
                 for g in groups if g]
    return Traffic(cfg.run.steps, lambda rank, s: step,
                   notes=[f"DeepSpeed ZeRO-{stage}: its gradient all-reduce, norm scalars and "
                          "(ZeRO-1/2) partition all-gathers as its comms logger records them, "
                          "priced without overlap (as the run projections price them on CPU)"])
