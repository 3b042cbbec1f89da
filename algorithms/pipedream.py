"""PipeDream-2BW: 1F1B without flushes, two weight versions per stage (arXiv 2006.09503).

Run it with `commbench run configs/2bw-tiny.yaml`; tested by `pytest tests/test_pipeline.py`.
Our own executor over the Communicator's send/recv/exchange (docs/algorithms.md,
Pipelines).

Schedule. Stage s (of S) runs the endless microbatch stream j = k*M + i of minibatches
k = 0, 1, ... in 1F1B order: `w_s = S-1-s` warm-up forwards once at the start, then
"forward j, backward j - w_s" pairs. Step k of the loop runs the M forwards of minibatch
k and the backwards paired with them, so at the end of step k the last `w_s`
microbatches of minibatch k are still in flight (their activations stashed) and finish
in step k+1. Every message crossing the stage boundary s/s+1 inside a step is matched
inside the same step, except the gradient of the step's last backward, which is held and
sent fused with the next step's first activation receive (deadlock-free on NCCL too).

Weights (`delay: 1`). Minibatch k's microbatches run forward AND backward on version
W(k-1) (weight stashing); its accumulated gradient g_k = grad f_k(W(k-1)) is applied to
the newest version at the end of step k+1, when every stage has finished it:
`W(k+1) = W(k) - opt(g_{k-1})` evaluated at the end of step k, i.e. a constant delay of
one step. Reconstruction choices (ours): W(-1) = W(0), so step 0 applies no update and
the last minibatch's gradient is never applied; the update at the end of step k uses
step k's learning rate. Two version modules alternate roles; the optimizer (and its
state, whatever the optimizer's structure: `algorithms.delay.rebind_parameters`) is
re-bound to whichever holds the newest weights, so never more than two weight versions
exist. Requires M >= S - 1 (the previous minibatch must finish within a step).

Corrections (`optim.delay_correction`): the same `algorithms.delay.DelayCorrection` as the
`optim.delay: 1` emulation, applied around the update: `ef` corrects the update itself;
`predict` makes the version module hold the extrapolated weights W(k) + u(k) that the next
minibatch runs on (the true W(k) = stash - u(k) is rebuilt before the next update, and for
evaluation in a separate copy). Each equals the emulation with the same correction on the
same data (tests/test_pipeline.py).

`delay: 0` runs the same executor with a flush every step (synchronous 1F1B, one version):
its parameters equal torch's Schedule1F1B and one process with gradient accumulation.

Point-to-point (algorithms/schedule.py `p2p_plan`): a message is batched with the
receive that follows its send only when both neighbours cross there (each sends to the
other, then receives from it); every other message is sent and received plain, so each
message is sent and received with the same kind of op on NCCL, for every stage and
microbatch count (with fewer microbatches than stages a one-sided batch used to hang).
Each is started without a device synchronise (`Communicator.start_p2p`) and waited for at
once; its wait is idle time and its record are timed on the device's clock by the same
`P2PRecorder` as torch's 1F1B and GPipe (algorithms/pipeline.py), which synchronises the
device once, at the end of the step. Synchronising around every op, as the blocking
`Communicator.send`/`recv` do, kept the host from queueing ahead on CUDA and understated
2BW's throughput against torch's schedules.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
from torch import nn

from algorithms import schedule
from algorithms.contract import CriticalPath, TrainSetup
from algorithms.delay import DelayCorrection, rebind_parameters
from algorithms.pipeline import P2PRecorder
from algorithms.pipeline_base import PipelineConfigBase, PipelineStrategy


@dataclass
class PipeDreamConfig(PipelineConfigBase):
    name: str = "pipedream-2bw"
    """PipeDream-2BW: asynchronous 1F1B with two weight versions (arXiv 2006.09503)."""
    delay: int = 1
    """Weight delay in steps: 1 = PipeDream-2BW; 0 = synchronous 1F1B with a flush."""
    backend: str = "ours"
    """Only our own executor implements 2BW (DeepSpeed and torch have no 2BW schedule)."""

    def __post_init__(self):
        if self.delay not in (0, 1):
            raise ValueError(f"strategy.delay must be 0 or 1, got {self.delay!r}")
        if self.backend != "ours":
            raise ValueError(f"strategy.backend for pipedream-2bw must be 'ours' (neither "
                             f"torch nor deepspeed has a 2BW schedule), got {self.backend!r}")

    def update_delay(self, cfg) -> int:
        return self.delay

    def critical_path(self, num_stages: int, num_microbatches: int) -> CriticalPath:
        """Our executor's order (algorithms/schedule.py); delay 1 has no flush."""
        return CriticalPath("2bw" if self.delay else "ours-1f1b", num_stages,
                            num_microbatches)

    def check(self, cfg) -> None:
        super().check(cfg)
        if getattr(cfg.optim, "delay", 0):
            raise ValueError(f"optim.delay must be 0 for pipedream-2bw (its weight versions "
                             f"already delay the update by strategy.delay={self.delay}), "
                             f"got {cfg.optim.delay}")
        p = cfg.parallel
        if self.delay and p.num_microbatches < p.num_stages - 1:
            raise ValueError(f"parallel.num_microbatches ({p.num_microbatches}) must be >= "
                             f"parallel.num_stages - 1 ({p.num_stages - 1}) for "
                             f"pipedream-2bw with delay 1")


class PipeDream2BW(PipelineStrategy):
    """Our 1F1B executor: 2BW with `delay: 1`, synchronous 1F1B with `delay: 0`."""

    Config = PipeDreamConfig

    # ------------------------------------------------------------- plans, before launch

    @classmethod
    def in_flight(cls, config: PipeDreamConfig, facts) -> float:
        """delay 1: S - s (the warm-up microbatches stay in flight across steps)."""
        if config.delay:
            return facts.num_stages - facts.stage
        return super().in_flight(config, facts)

    @classmethod
    def autocast_regions(cls, in_flight: float) -> float:
        """bf16: each microbatch's forward is its own autocast region (`forward` below),
        whose weight copies its graph keeps until its backward."""
        return in_flight

    @classmethod
    def memory_terms(cls, cfg, facts) -> dict[str, int]:
        """delay 1: + the second weight version and its gradients."""
        terms = super().memory_terms(cfg, facts)
        if cfg.strategy.delay:
            terms["2BW: second weight version"] = facts.param_bytes
            terms["2BW: second version's gradients"] = facts.param_bytes
        return terms

    # ------------------------------------------------------------- the run

    def __init__(self, config: PipeDreamConfig, setup: TrainSetup):
        super().__init__(config, setup)
        self.delay = config.delay
        if self.delay and self.num_microbatches < self.grid.num_stages - 1:
            raise ValueError(f"parallel.num_microbatches ({self.num_microbatches}) must be "
                             f">= parallel.num_stages - 1 ({self.grid.num_stages - 1})")
        self.versions = [self.stage_module]
        if self.delay:
            self.versions.append(copy.deepcopy(self.stage_module))
        self.correction = DelayCorrection(setup.delay_correction, setup.ef_lambda)
        self._eval_copy: nn.Module | None = None
        """`predict`: the newest version's true weights (stash - u), built for evaluation."""
        self.bound = 0
        """Index of the version module the optimizer's param_groups hold."""
        self.inflight: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Microbatch -> (its stage input, its output or scaled loss): stashed activations."""
        self.pending: tuple[int, torch.Tensor] | None = None
        """A send not yet issued: (peer, tensor); fused with the next receive from peer."""
        self.losses: list[torch.Tensor] = []
        self.recorder: P2PRecorder | None = None
        """The step's p2p waits and records (`run_schedule`)."""

    # ------------------------------------------------------------------ versions

    def weight_versions(self) -> list[nn.Module]:
        """The stage's live weight versions (one with delay 0, two with delay 1)."""
        return list(self.versions)

    def version_of(self, microbatch: int) -> nn.Module:
        """Minibatch k runs on W(k-1): the module of index (k-1) % 2 (W(-1) = W(0))."""
        if not self.delay:
            return self.versions[0]
        return self.versions[(microbatch // self.num_microbatches - 1) % 2]

    def eval_model(self) -> nn.Module:
        """The newest weights W (with `predict`, a copy: the stash holds W + u)."""
        newest = self.versions[self.newest_index()]
        if self.correction.previous is None or self.correction.kind != "predict":
            return newest
        if self._eval_copy is None:
            self._eval_copy = copy.deepcopy(newest).requires_grad_(False)
        with torch.no_grad():
            params = list(self._eval_copy.parameters())
            for p, q in zip(params, newest.parameters(), strict=True):
                p.copy_(q)
            self.correction.shift(params, -1)
        return self._eval_copy

    def newest_index(self) -> int:
        # after the update at the end of step k-1 (k = step_index), W(k-1) is the newest
        return 0 if not self.delay else (self.step_index - 1) % 2

    # ------------------------------------------------------------------ schedule

    def actions(self, k: int) -> list[tuple[str, int]]:
        """Step k's ("F"|"B", microbatch) sequence on this stage (algorithms/schedule.py)."""
        return schedule.actions(self.grid.stage, self.grid.num_stages, self.num_microbatches,
                                k, self.delay)

    def run_schedule(self, batch) -> tuple[float | None, float]:
        x, y = batch
        k = self.step_index
        M, s = self.num_microbatches, self.grid.stage
        xs, ys = x.chunk(M), y.chunk(M)
        self.losses, self.recorder = [], P2PRecorder(self.comm)
        # which messages go in a batched exchange (the same op kind on both ends)
        self.held, self.exchanged = schedule.p2p_plan(s, self.grid.num_stages, M, k,
                                                      self.delay)
        for kind, j in self.actions(k):
            if kind == "F":
                self.forward(j, xs[j - k * M], ys[j - k * M])
            else:
                self.backward(j)
        # a send still held here goes out with the next step's first receive (delay 1)
        idle_s = self.recorder.finish()  # the step's one device synchronise
        loss = torch.stack(self.losses).sum().item() if self.grid.is_last else None
        return loss, idle_s

    def forward(self, j: int, x_mb: torch.Tensor, y_mb: torch.Tensor) -> None:
        s = self.grid.stage
        if self.grid.is_first:
            h = x_mb
        else:
            h = self.receive(self.activation_buffer(x_mb.shape[0]), self.grid.prev,
                             ("A", s - 1, j))
            h.requires_grad_(True)
        autocast = self.setup.autocast
        with autocast() if autocast else contextlib.nullcontext():
            out = self.compiled(self.version_of(j))(h)
            if self.grid.is_last:
                out = self.loss_fn(out, y_mb) / self.num_microbatches
        if self.grid.is_last:
            self.losses.append(out.detach())
        else:
            self.send(out.detach(), self.grid.next, ("A", s, j))
        self.inflight[j] = (h, out)

    def backward(self, j: int) -> None:
        s = self.grid.stage
        h, out = self.inflight.pop(j)
        if self.grid.is_last:
            out.backward()
        else:
            grad = self.receive(torch.empty_like(out), self.grid.next, ("G", s, j))
            torch.autograd.backward(out, grad)
        if not self.grid.is_first:
            self.send(h.grad, self.grid.prev, ("G", s - 1, j))

    # ------------------------------------------------------------------ p2p

    def send(self, tensor: torch.Tensor, peer: int, message: schedule.Message) -> None:
        """Send now, or hold the tensor for the exchange the plan batches it in."""
        if message in self.held:
            assert self.pending is None, f"two held sends: {self.pending[0]} and {peer}"
            self.pending = (peer, tensor)
        else:
            self.transfer({peer: tensor}, {})

    def receive(self, buffer: torch.Tensor, peer: int, message: schedule.Message) -> torch.Tensor:
        """Receive into `buffer` from `peer` (in an exchange with the held send when the
        plan says so)."""
        if message in self.exchanged:
            assert self.pending is not None and self.pending[0] == peer, (message, peer)
            self.transfer({peer: self.pending[1]}, {peer: buffer})
            self.pending = None
        else:
            self.transfer({}, {peer: buffer})
        return buffer

    def transfer(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> None:
        """Start the transfers and wait for them: the waits are idle time (the bubble),
        marked on the device's clock, so neither the rank's own queued compute nor a
        host that returned early counts (module docstring, Point-to-point)."""
        ops, works = self.comm.start_p2p(sends, recvs)
        for work in self.recorder.track(ops, works):
            work.wait()

    # ------------------------------------------------------------------ update

    def apply_update(self) -> float:
        if not self.delay:
            return super().apply_update()
        k = self.step_index
        if k == 0:
            return 0.0  # W(0) = W(-1): no gradient is due yet
        target, newest = self.versions[k % 2], self.versions[(k - 1) % 2]
        comm_s = self.sync_gradients(target)  # g_{k-1}, computed on W(k-2)
        params = list(target.parameters())
        with torch.no_grad():
            for p_target, p_newest in zip(params, newest.parameters(), strict=True):
                p_target.copy_(p_newest)
        self.rebind(k % 2)
        self.correction.shift(params, -1)  # predict: the stash held W + u; update W
        self.correction.step(params, self.optimizer.step)
        self.correction.shift(params, +1)  # predict: the next minibatch runs at W + u
        self.optimizer.zero_grad(set_to_none=True)
        return comm_s

    def rebind(self, index: int) -> None:
        """Point the optimizer (param_groups and state) at version module `index`."""
        if index == self.bound:
            return
        old = self.versions[self.bound].parameters()
        new = self.versions[index].parameters()
        rebind_parameters(self.optimizer, dict(zip(old, new, strict=True)))
        self.bound = index


    def bubble_theory(self) -> float:
        """delay 0: the flushed 1F1B's (S-1)/(M+S-1); delay 1: 0 (no flush: the pipeline
        fills once, at the start of the run, not every step)."""
        return super().bubble_theory() if not self.delay else 0.0

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Both versions, their accumulated gradients, the stashed inputs, the held send."""
        return {
            "versions": [v.state_dict() for v in self.versions],
            "grads": [[None if p.grad is None else p.grad.clone() for p in v.parameters()]
                      for v in self.versions],
            "optimizer": self.optimizer.state_dict(),
            "correction": self.correction.state_dict(),
            "bound": self.bound,
            "step_index": self.step_index,
            "inflight": {j: h.detach().clone() for j, (h, _) in self.inflight.items()},
            "pending": None if self.pending is None else
            (self.pending[0], self.pending[1].clone()),
        }

    def load_state_dict(self, state: dict) -> None:
        for v, sd, grads in zip(self.versions, state["versions"], state["grads"], strict=True):
            v.load_state_dict(sd)
            for p, g in zip(v.parameters(), grads, strict=True):
                p.grad = g
        self.rebind(state["bound"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.correction.load_state_dict(state["correction"],
                                        [p.device for p in self.stage_module.parameters()])
        self.step_index = state["step_index"]
        self.pending = state["pending"]
        self.inflight = {}
        # rebuild the stashed activations' graphs: same input, same version -> same output
        autocast = self.setup.autocast
        for j, h in state["inflight"].items():
            h = h.requires_grad_(h.is_floating_point())
            with autocast() if autocast else contextlib.nullcontext():
                self.inflight[j] = (h, self.version_of(j)(h))
