"""DeepSpeed's pipeline engine (1F1B with a flush) behind `strategy.backend: deepspeed`.

Run it with `commbench run configs/deepspeed-pp-tiny.yaml`; tested by
`pytest tests/test_pipeline.py -k deepspeed`. The stages are OUR partition
(algorithms/partition.py): each stage's layers become one `nn.Sequential`, and
`PipelineModule(layers=[stage_0, ..., stage_{S-1}], partition_method="uniform")` puts
exactly one on each stage, so every backend runs the same cut. The topology is
`(data, pipe)`: rank = replica * S + stage, our grid's layout. The tied token-embedding
weight (a copy on the first and on the last stage) is declared to the engine as a tied
weight over our `tied` group, so the engine all-reduces its gradient itself.

DeepSpeed's traffic (p2p activations and gradients, the data-parallel all-reduce, the tied
all-reduce, the loss broadcast) bypasses our Communicator; its comms logger times each
op and the entries are copied into the ledger after every step (as algorithms/zero.py
does for ZeRO). The engine owns the optimizer step (and clipping).
"""

from __future__ import annotations

import torch
import torch.distributed
from torch import nn

from algorithms.partition import split_layers
from algorithms.zero import _drain_comms_log


class DeepSpeedPipe:
    """Builds the engine for a `Pipeline` strategy and runs its steps."""

    def __init__(self, strategy):
        import deepspeed
        import deepspeed.ops
        from deepspeed.pipe import PipelineModule
        from deepspeed.runtime.pipe.topology import ProcessTopology

        from algorithms.base import unwrap

        # the shared-memory comm op JIT-compiles (~30 s) on first use; gloo is enough here
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        # wraps the already-initialised torch process group (PipelineModule needs it)
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
        self.strategy = strategy
        grid, setup = strategy.grid, strategy.setup
        parts = split_layers(unwrap(setup.model).as_layers(), grid.num_stages,
                             getattr(setup, "partition", "layers"))
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
        }
        self.engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=strategy.optimizer, config=config,
            dist_init_required=False)
        from deepspeed.comm.comm import comms_logger

        comms_logger.reset_data()  # the engine's start-up broadcasts are not training traffic

    def run(self, batch) -> tuple[float | None, float]:
        x, y = batch
        M = self.strategy.num_microbatches
        data = iter(list(zip(x.chunk(M), y.chunk(M), strict=True)))
        loss = self.engine.train_batch(data_iter=data)
        last = self.strategy.grid.is_last
        return (float(loss) if last else None), 0.0

    def update(self) -> float:
        """The engine already stepped; copy its logged traffic into the ledger."""
        return _drain_comms_log(self.strategy.comm)

    def close(self) -> None:
        self.engine = None


def _tied(module: nn.Module) -> torch.nn.Parameter:
    from algorithms.pipeline_base import _tied_parameter

    return _tied_parameter(module)
