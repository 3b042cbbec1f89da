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
recorded with their peer and measured time; its collectives (data-parallel and tied
all-reduces, the loss broadcast) come from its comms logger, copied into the ledger after
every step, each with its own time (without their group: priced as world-wide).
The engine owns the optimizer step (and clipping).
"""

from __future__ import annotations

import time

import torch
import torch.distributed
from torch import nn

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

    def run(self, batch) -> tuple[float | None, float]:
        from deepspeed.runtime.pipe import p2p

        x, y = batch
        M = self.strategy.num_microbatches
        data = iter(list(zip(x.chunk(M), y.chunk(M), strict=True)))
        self.idle_s = 0.0
        originals = p2p.send, p2p.recv
        p2p.send, p2p.recv = self.recorded(p2p, "send"), self.recorded(p2p, "recv")
        try:
            loss = self.engine.train_batch(data_iter=data)
        finally:
            p2p.send, p2p.recv = originals
        last = self.strategy.grid.is_last
        return (float(loss) if last else None), self.idle_s

    def recorded(self, p2p, op: str):
        """p2p.send / p2p.recv recorded in the ledger with their peer (the comms logger
        knows sizes, not peers, which the network model needs)."""
        original = getattr(p2p, op)
        comm = self.strategy.comm

        def call(tensor, stage, async_op=False):
            start = time.perf_counter()
            result = original(tensor, stage, async_op=async_op)
            peer = p2p._grid.stage_to_global(stage_id=stage)
            nbytes = tensor.numel() * tensor.element_size()
            elapsed = comm.hold(op, nbytes, start, peers=(peer,))  # emulation, if any
            self.idle_s += elapsed
            comm.record(op, nbytes, elapsed, peers=(peer,))
            return result

        return call

    def update(self) -> float:
        """The engine already stepped; copy its logged collectives into the ledger, each
        with its own seconds (algorithms/zero.py `per_op_seconds`: the logger keeps
        cumulative timer values), and reset the log and its timers."""
        from deepspeed.comm.comm import comms_logger

        from algorithms.zero import per_op_seconds, reset_comms_log

        comm = self.strategy.comm
        total_s = 0.0
        for name, nbytes, seconds in per_op_seconds(comms_logger.comms_dict):
            if name in ("send", "recv"):  # recorded with their peers in `run`
                continue
            comm.record(name, nbytes, seconds)
            total_s += seconds
        reset_comms_log()
        return total_s

    def close(self) -> None:
        self.engine = None


def _tied(module: nn.Module) -> torch.nn.Parameter:
    from algorithms.pipeline_base import _tied_parameter

    return _tied_parameter(module)
