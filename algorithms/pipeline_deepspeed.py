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
time is the step's idle. Its collectives are tapped where deepspeed.comm hands them to its
backend (`CollectiveTap`: `cdb.all_reduce`, `cdb.broadcast`), so each is recorded with its
group's ranks and a phase named after the engine instruction that ran it: "tied"
(ReduceTiedGrads: the tied weight's gradient summed between the end stages), "dp"
(ReduceGrads: the stage's gradients averaged over its replicas, flat buckets of up to
5e8 elements), "clip" (OptimizerStep: the clipping norm summed over the pipe, then
averaged over the stage's replicas), "loss" (the loss averaged over the last stage's
replicas, broadcast down the pipe). Their seconds:
- CPU (gloo): from DeepSpeed's comms logger, which stays on (algorithms/zero.py
  `per_op_seconds`), matched call for call to the tapped ops (a logged op the tap did
  not see stops the run: its group would be unknown); their sum is the step's exposed
  collective time.
- CUDA: the logger would synchronise the device after every op, so it is off; the ops
  are recorded with `seconds = 0` and the exposed collective time is the engine's
  gradient reductions (ReduceGrads, ReduceTiedGrads: after the last backward, not
  overlapped), bracketed by clock marks. Not measured on CUDA: the clipping norms and
  the loss's scalars.
The engine owns the optimizer step (and clipping).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed
from torch import nn

from algorithms.clocks import HostClock, clock_for
from algorithms.comm import Group
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
        from deepspeed.comm.comm import comms_logger

        from algorithms.zero import reset_comms_log

        reset_comms_log()  # start-up broadcasts are not training traffic
        self.clock = clock_for(strategy.comm.device)
        self.logged = isinstance(self.clock, HostClock)
        """Whether the comms logger times the collectives (CPU; on CUDA it is off)."""
        if not self.logged:
            comms_logger.enabled = False  # no per-op device synchronise
        self.tap = CollectiveTap()
        self.p2p: list[tuple[str, int, int, object, object]] = []
        """This step's p2p ops: (op, bytes, peer, start mark, end mark)."""
        self.reductions: list[tuple[object, object]] = []
        """CUDA: this step's gradient reductions' (start, end) clock marks."""
        self._name_instructions()

    def _name_instructions(self) -> None:
        """Run the engine's reduction and optimizer instructions (and its loss aggregation)
        under their ledger phase; on CUDA bracket the gradient reductions with clock marks
        (their exposed time)."""
        from deepspeed.runtime.pipe import schedule

        engine, timed = self.engine, not self.logged
        instructions = dict(type(engine)._INSTRUCTION_MAP)  # the engine looks it up on self
        for kind, phase in ((schedule.ReduceTiedGrads, "tied"), (schedule.ReduceGrads, "dp"),
                            (schedule.OptimizerStep, "clip")):
            original, reduction = instructions[kind], kind is not schedule.OptimizerStep

            def named(engine_self, *args, _original=original, _phase=phase,
                      _timed=timed and reduction, **kwargs):
                start = self.clock.mark() if _timed else None
                with self.tap.phase(_phase):
                    result = _original(engine_self, *args, **kwargs)
                if _timed:
                    self.reductions.append((start, self.clock.mark()))
                return result

            instructions[kind] = named
        engine._INSTRUCTION_MAP = instructions
        aggregate = engine._aggregate_total_loss

        def aggregate_loss(*args, **kwargs):
            with self.tap.phase("loss"):
                return aggregate(*args, **kwargs)

        engine._aggregate_total_loss = aggregate_loss

    def run(self, batch) -> tuple[float | None, float]:
        from deepspeed.runtime.pipe import p2p

        x, y = batch
        M = self.strategy.num_microbatches
        data = iter(list(zip(x.chunk(M), y.chunk(M), strict=True)))
        originals = p2p.send, p2p.recv
        p2p.send, p2p.recv = self.recorded(p2p, "send"), self.recorded(p2p, "recv")
        try:
            with self.tap.active():
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
        """The engine already stepped; record its collectives (tapped with their groups and
        phases) and return their exposed seconds (module docstring: CPU, each op's own
        logged seconds, algorithms/zero.py `per_op_seconds`; CUDA, the reductions' marks)."""
        from deepspeed.comm.comm import comms_logger

        from algorithms.zero import per_op_seconds, reset_comms_log

        comm, ops = self.strategy.comm, self.tap.take()
        seconds = [0.0] * len(ops)
        if self.logged:
            logged = [op for op in per_op_seconds(comms_logger.comms_dict)
                      if op[0] not in ("send", "recv")]  # recorded with their peers in `run`
            seconds = match_logged(ops, logged)
        reset_comms_log()
        for (name, nbytes, ranks, phase), op_s in zip(ops, seconds, strict=True):
            group = None if len(ranks) == comm.world_size else Group(ranks, None)
            with comm.phase(phase):
                comm.record(name, nbytes, op_s, group)
        if self.logged:
            return sum(seconds)
        total_s = sum(self.clock.seconds(a, b) for a, b in self.reductions)
        self.reductions.clear()
        return total_s

    def close(self) -> None:
        if not self.logged:  # the logger is DeepSpeed's, global: switch it back
            from deepspeed.comm.comm import comms_logger

            comms_logger.enabled = True
        from algorithms.zero import release_deepspeed_state

        self.engine = None
        release_deepspeed_state()


class CollectiveTap:
    """The collectives deepspeed.comm hands its backend (`cdb`) while `active`: per call
    (logged name, bytes as its comms logger counts them: the tensor's, ranks of its group,
    the phase set by `phase`), in call order. The pipeline engine without ZeRO calls
    `all_reduce` and `broadcast` only (its p2p goes through `send`/`recv`, recorded with
    their peers); on CPU `match_logged` checks that against the logger's own list."""

    OPS = {"all_reduce": ("tensor", "op", "group", "async_op"),
           "broadcast": ("tensor", "src", "group", "async_op")}
    """Each tapped op's parameters, in order (deepspeed/comm/torch.py `TorchBackend`; its
    methods are wrapped without their signatures)."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, int, tuple[int, ...], str]] = []
        self._phase = "train"

    @contextlib.contextmanager
    def phase(self, name: str):
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous

    @contextlib.contextmanager
    def active(self):
        from deepspeed.comm import comm as ds_comm

        backend = ds_comm.cdb
        for name in self.OPS:
            setattr(backend, name, self._tapped(name, getattr(backend, name)))
        try:
            yield
        finally:
            for name in self.OPS:
                delattr(backend, name)  # the class's method again

    def _tapped(self, name: str, original):
        names = self.OPS[name]

        def call(*args, **kwargs):
            bound = {**dict(zip(names, args, strict=False)), **kwargs}
            tensor, group = bound["tensor"], bound.get("group")
            ranks = tuple(sorted(torch.distributed.get_process_group_ranks(group))) \
                if group is not None else tuple(range(torch.distributed.get_world_size()))
            self.ops.append((name, tensor.numel() * tensor.element_size(), ranks,
                             self._phase))
            return original(*args, **kwargs)

        return call

    def take(self) -> list[tuple[str, int, tuple[int, ...], str]]:
        ops, self.ops = self.ops, []
        return ops


def match_logged(ops: list[tuple[str, int, tuple[int, ...], str]],
                 logged: list[tuple[str, int, float]]) -> list[float]:
    """Each tapped op's seconds from the comms logger's (name, bytes, seconds), which lists
    one name's calls in call order: the k-th logged call of a name is the k-th tapped
    one. A logged op the tap did not see (or bytes that differ) is an error: its group
    would be unknown and the ledger would price it over the world."""
    by_name: dict[str, list[tuple[int, float]]] = {}
    for name, nbytes, seconds in logged:
        by_name.setdefault(name, []).append((nbytes, seconds))
    tapped: dict[str, list[int]] = {}
    for name, nbytes, _, _ in ops:
        tapped.setdefault(name, []).append(nbytes)
    if {k: [n for n, _ in v] for k, v in by_name.items()} != tapped:
        raise RuntimeError(
            "DeepSpeed's pipeline engine ran collectives the ledger cannot give groups to: "
            f"its comms logger saw {sorted((k, [n for n, _ in v]) for k, v in by_name.items())}"
            f", the tap of {list(CollectiveTap.OPS)} saw {sorted(tapped.items())} "
            "(algorithms/pipeline_deepspeed.py CollectiveTap)")
    seen: dict[str, int] = {}
    out = []
    for name, _, _, _ in ops:
        out.append(by_name[name][seen.get(name, 0)][1])
        seen[name] = seen.get(name, 0) + 1
    return out


def _tied(module: nn.Module) -> torch.nn.Parameter:
    from algorithms.pipeline_base import _tied_parameter

    return _tied_parameter(module)


# ---------------------------------------------------------------------- traffic (what-if)

META_BYTES = 256 * 4
"""The shape metadata a stage sends ahead of its first activations (deepspeed/runtime/pipe/
engine.py `_send_tensor_meta`: TENSOR_META_SIZE int32s), once per engine."""


def deepspeed_pipe_traffic(cfg, facts):
    """What this wrapper records of DeepSpeed's pipeline engine in a step (module
    docstring), rank = replica * S + stage: the schedule's p2p, each message its own
    record (no batching into exchanges): to the next stage M activations sent and M
    gradients received, from the previous one M activations received and M gradients
    sent, plus in step 0 the `META_BYTES` of shape metadata each stage sends to the next;
    then "tied": the tied weight's gradient over (first, last) of the replica; "dp": the
    stage's gradients, every parameter it holds (the tied copy too), over its replicas (a
    group of one without replicas: the engine still calls it) in flat buckets of up to
    `algorithms.zero.BUCKET_ELEMENTS`, a bucket closing once past it
    (`allreduce_no_retain`); "clip" (optim.grad_clip > 0): the norm's scalar summed over
    the replica's stages, then averaged over the stage's replicas; "loss": the last stage
    averages the loss's scalar over its replicas (only with replicas) and broadcasts two
    scalars (8 bytes) to its pipe. A group that is the world is None, as recorded.
    Compute shares and the critical path are the torch pipelines' (`pipeline_traffic`).
    Checked against runs of 2 stages x 2 replicas, 2 stages and 3 stages
    (tests/test_whatif.py); the bucket split past 5e8 elements follows DeepSpeed 0.19's
    code, not a run."""
    from dataclasses import replace

    from algorithms.partition import bounds_of
    from algorithms.traffic import Transfer, pipeline_traffic
    from algorithms.zero import BUCKET_ELEMENTS

    p = cfg.parallel
    S, world, M = p.num_stages, p.world_size, p.num_microbatches
    replicas, boundary = world // S, facts.boundary_bytes
    base = pipeline_traffic(cfg.strategy, cfg, facts)
    by_layer: dict[int, list[int]] = {}
    for param in facts.params:  # the tied weight once, in its first layer
        by_layer.setdefault(param.layer, []).append(param.nbytes // 4)
    buckets = []
    for a, b in bounds_of([n // 4 for n in facts.layer_bytes], S, p.partition):
        numels = [n for i in range(a, b) for n in by_layer.get(i, [])]
        if facts.tied_bytes and facts.tied_layers[-1] in range(a, b) \
                and facts.tied_layers[0] not in range(a, b):
            numels.append(facts.tied_bytes // 4)  # the head's copy, after its norm
        stage, size = [], 0
        for n in numels:
            size += n
            if size > BUCKET_ELEMENTS:
                stage.append(size * 4)
                size = 0
        buckets.append((*stage, size * 4) if size else tuple(stage))
    cache: dict[tuple[int, bool], list[Transfer]] = {}

    def transfers(rank: int, step: int) -> list[Transfer]:
        key = (rank, step == 0)
        if key in cache:
            return cache[key]
        replica, stage = divmod(rank, S)
        first, last = replica * S, replica * S + S - 1
        pipe, dp = tuple(range(first, last + 1)), tuple(range(stage, world, S))
        pipe, ends = (None, None) if replicas == 1 else (pipe, (first, last))  # the world
        out = []
        for peer, ahead in ((rank + 1, True), (rank - 1, False)):
            if not first <= peer <= last:
                continue
            if step == 0:
                out.append(Transfer("train", "send" if ahead else "recv", (META_BYTES,),
                                    peers=(peer,)))
            for kind in ("send", "recv"):
                out += [Transfer("train", kind, (boundary,), peers=(peer,))] * M
        if S > 1 and facts.tied_bytes and stage in (0, S - 1):
            out.append(Transfer("tied", "all_reduce", (facts.tied_bytes,),
                                ends if S == 2 else (first, last)))
        out.append(Transfer("dp", "all_reduce", buckets[stage], dp))
        if cfg.optim.grad_clip > 0:
            out += [Transfer("clip", "all_reduce", (4,), pipe),
                    Transfer("clip", "all_reduce", (4,), dp)]
        if stage == S - 1 and replicas > 1:
            out.append(Transfer("loss", "all_reduce", (4,), dp))
        out.append(Transfer("loss", "broadcast", (8,), pipe))
        cache[key] = out
        return out

    return replace(base, transfers=transfers, notes=[
        *base.notes, "DeepSpeed's pipeline engine: its p2p one message per record (no "
        "exchanges), its scalars (clipping norm, loss) as their own collectives"])
