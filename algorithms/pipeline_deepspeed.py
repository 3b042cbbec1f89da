"""DeepSpeed's pipeline engine (1F1B with a flush) behind `strategy.backend: deepspeed`.

Run it with `commbench run configs/deepspeed-pp-tiny.yaml`; tested by
`pytest tests/test_pipeline.py -k deepspeed`. The stages are OUR partition
(algorithms/partition.py): each stage's layers become one `nn.Sequential`, and
`PipelineModule(layers=[stage_0, ..., stage_{S-1}], partition_method="uniform")` puts
exactly one on each stage, so every backend runs the same cut. The topology is
`(data, pipe)`: rank = replica * S + stage, our grid's layout. The tied token-embedding
weight (a copy on the first and on the last stage) is declared to the engine as a tied
weight over our `tied` group, so the engine all-reduces its gradient itself.

DeepSpeed's traffic bypasses our Communicator. Its p2p sends and receives (activations,
gradients, shape metadata) are wrapped during the step (`deepspeed.runtime.pipe.p2p`) and
recorded with their peer and their time on the device's clock (algorithms/ddp.py: CUDA
events, since an NCCL send or receive returns to the host before it has happened); that
time is the step's idle. Its collectives (data-parallel and tied all-reduces, the loss
broadcast) come from its comms logger (without their group: priced as world-wide), as in
algorithms/zero.py:
- CPU (gloo): the logger stays on; each op is copied into the ledger after every step with
  its own time, and their sum is the step's exposed collective time.
- CUDA: the logger synchronises the device after every op, so it is on for the first step
  only, to learn the step's ops and sizes; later steps replay them with `seconds = 0`. The
  exposed collective time is then the engine's gradient reductions (ReduceGrads,
  ReduceTiedGrads: after the last backward, not overlapped), bracketed by clock marks.
  Not measured on CUDA: the final loss broadcast (one scalar).
The engine owns the optimizer step (and clipping).
"""

from __future__ import annotations

import time

import torch
import torch.distributed
from torch import nn

from algorithms.clocks import HostClock, clock_for
from algorithms.partition import split_layers


class DeepSpeedPipe:
    """Builds the engine for a `Pipeline` strategy and runs its steps."""

    def __init__(self, strategy):
        import deepspeed
        import deepspeed.ops
        from deepspeed.pipe import PipelineModule
        from deepspeed.runtime.pipe.topology import ProcessTopology

        from algorithms.base import unwrap
        from algorithms.zero import autocast_config

        # the shared-memory comm op JIT-compiles (~30 s) on first use; gloo is enough here
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        # wraps the already-initialised torch process group (PipelineModule needs it)
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
        self.strategy = strategy
        grid, setup = strategy.grid, strategy.setup
        parts = split_layers(unwrap(setup.model).as_layers(), grid.num_stages,
                             setup.partition)
        layers = [strategy.stage_module if s == grid.stage else nn.Sequential(*part)
                  for s, part in enumerate(parts)]
        topology = ProcessTopology(axes=["data", "pipe"], dims=[grid.num_replicas,
                                                                 grid.num_stages])
        module = PipelineModule(layers=layers, topology=topology, loss_fn=strategy.loss_fn,
                                partition_method="uniform")
        tied = [] if grid.tied is None else [(_tied(strategy.stage_module), grid.tied.pg)]
        module.get_tied_weights_and_groups = lambda: tied
        M = strategy.num_microbatches
        config = {
            "train_micro_batch_size_per_gpu": strategy.micro_batch,
            "gradient_accumulation_steps": M,
            "train_batch_size": strategy.micro_batch * M * grid.num_replicas,
            "gradient_clipping": setup.grad_clip,
            "steps_per_print": 2**31 - 1,
            "comms_logger": {"enabled": True, "verbose": False, "prof_all": True,
                             "debug": False},
            **autocast_config(setup.precision),  # bf16: as torch's pipelines run it
        }
        self.engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=strategy.optimizer, config=config,
            dist_init_required=False)
        from algorithms.zero import reset_comms_log

        reset_comms_log()  # start-up broadcasts are not training traffic
        self.clock = clock_for(strategy.comm.device)
        self.step_ops: list[tuple[str, int]] | None = None
        """CUDA: the collectives (op, bytes) of one step, learnt on the first step."""
        self.marks: list[tuple[object, object]] = []
        """This step's p2p and (CUDA) gradient-reduction (start, end) clock marks."""
        self.p2p: list[tuple[str, int, int, object, object]] = []
        """This step's p2p ops: (op, bytes, peer, start mark, end mark)."""
        if not isinstance(self.clock, HostClock):
            self._time_reductions()

    def _time_reductions(self) -> None:
        """CUDA: bracket the engine's gradient reductions with clock marks (their exposed
        time, the comms logger being off after the first step)."""
        from deepspeed.runtime.pipe import schedule

        engine, reductions = self.engine, []
        instructions = dict(type(engine)._INSTRUCTION_MAP)  # the engine looks it up on self
        for kind in (schedule.ReduceGrads, schedule.ReduceTiedGrads):
            original = instructions[kind]

            def timed(engine_self, *args, _original=original, **kwargs):
                start = self.clock.mark()
                result = _original(engine_self, *args, **kwargs)
                reductions.append((start, self.clock.mark()))
                return result

            instructions[kind] = timed
        engine._INSTRUCTION_MAP = instructions
        self.reductions = reductions

    def run(self, batch) -> tuple[float | None, float]:
        from deepspeed.runtime.pipe import p2p

        x, y = batch
        M = self.strategy.num_microbatches
        data = iter(list(zip(x.chunk(M), y.chunk(M), strict=True)))
        originals = p2p.send, p2p.recv
        p2p.send, p2p.recv = self.recorded(p2p, "send"), self.recorded(p2p, "recv")
        try:
            loss = self.engine.train_batch(data_iter=data)
        finally:
            p2p.send, p2p.recv = originals
        self.clock.synchronize()  # the marks can be read from here on
        comm, idle_s = self.strategy.comm, 0.0
        for op, nbytes, peer, start, end in self.p2p:
            seconds = self.clock.seconds(start, end)
            idle_s += seconds
            comm.record(op, nbytes, seconds, peers=(peer,))
        self.p2p = []
        last = self.strategy.grid.is_last
        return (float(loss) if last else None), idle_s

    def recorded(self, p2p, op: str):
        """p2p.send / p2p.recv timed on the device's clock and recorded (by `run`) with
        their peer (the comms logger knows sizes, not peers, which the network model
        needs). Emulation holds each op on the host until its modelled time."""
        original = getattr(p2p, op)
        comm = self.strategy.comm

        def call(tensor, stage, async_op=False):
            host_start, start = time.perf_counter(), self.clock.mark()
            result = original(tensor, stage, async_op=async_op)
            peer = p2p._grid.stage_to_global(stage_id=stage)
            nbytes = tensor.numel() * tensor.element_size()
            comm.hold(op, nbytes, host_start, peers=(peer,))  # emulation, if any
            self.p2p.append((op, nbytes, peer, start, self.clock.mark()))
            return result

        return call

    def update(self) -> float:
        """The engine already stepped; copy its collectives into the ledger and return
        their exposed seconds (module docstring: logged on CPU, each with its own seconds,
        algorithms/zero.py `per_op_seconds`; on CUDA learnt once, then replayed)."""
        from deepspeed.comm.comm import comms_logger

        from algorithms.zero import per_op_seconds, reset_comms_log

        comm = self.strategy.comm
        if isinstance(self.clock, HostClock):
            ops = per_op_seconds(comms_logger.comms_dict)
        else:
            if self.step_ops is None:
                self.step_ops = [(name, nbytes) for name, nbytes, _ in
                                 per_op_seconds(comms_logger.comms_dict)
                                 if name not in ("send", "recv")]
                comms_logger.enabled = False  # no per-op device synchronise from here on
            ops = [(name, nbytes, 0.0) for name, nbytes in self.step_ops]
        total_s = 0.0
        for name, nbytes, seconds in ops:
            if name in ("send", "recv"):  # recorded with their peers in `run`
                continue
            comm.record(name, nbytes, seconds)
            total_s += seconds
        reset_comms_log()
        if not isinstance(self.clock, HostClock):
            total_s = sum(self.clock.seconds(a, b) for a, b in self.reductions)
            self.reductions.clear()
        return total_s

    def close(self) -> None:
        if self.step_ops is not None:  # the logger is DeepSpeed's, global: switch it back
            from deepspeed.comm.comm import comms_logger

            comms_logger.enabled = True
        from algorithms.zero import release_deepspeed_state

        self.engine = None
        release_deepspeed_state()


def _tied(module: nn.Module) -> torch.nn.Parameter:
    from algorithms.pipeline_base import _tied_parameter

    return _tied_parameter(module)
