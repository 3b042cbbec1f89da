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
state) is re-bound to whichever holds the newest weights, so never more than two weight
versions exist. Requires M >= S - 1 (the previous minibatch must finish within a step).

`delay: 0` runs the same executor with a flush every step (synchronous 1F1B, one version):
its parameters equal torch's Schedule1F1B and one process with gradient accumulation.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass

import torch
from torch import nn

from algorithms.base import CriticalPath, TrainSetup
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

    def in_flight(self, facts) -> float:
        """delay 1: S - s (the warm-up microbatches stay in flight across steps)."""
        if self.delay:
            return facts.num_stages - facts.stage
        return super().in_flight(facts)

    def memory_terms(self, cfg, facts) -> dict[str, int]:
        """delay 1: + the second weight version and its gradients."""
        terms = super().memory_terms(cfg, facts)
        if self.delay:
            terms["2BW: second weight version"] = facts.param_bytes
            terms["2BW: second version's gradients"] = facts.param_bytes
        return terms

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

    def __init__(self, config: PipeDreamConfig, setup: TrainSetup):
        super().__init__(config, setup)
        self.delay = config.delay
        if self.delay and self.num_microbatches < self.grid.num_stages - 1:
            raise ValueError(f"parallel.num_microbatches ({self.num_microbatches}) must be "
                             f">= parallel.num_stages - 1 ({self.grid.num_stages - 1})")
        self.versions = [self.stage_module]
        if self.delay:
            self.versions.append(copy.deepcopy(self.stage_module))
        self.bound = 0
        """Index of the version module the optimizer's param_groups hold."""
        self.inflight: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Microbatch -> (its stage input, its output or scaled loss): stashed activations."""
        self.pending: tuple[int, torch.Tensor] | None = None
        """A send not yet issued: (peer, tensor); fused with the next receive from peer."""
        self.losses: list[torch.Tensor] = []
        self.idle_s = 0.0

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
        return self.versions[self.newest_index()]

    def newest_index(self) -> int:
        # after the update at the end of step k-1 (k = step_index), W(k-1) is the newest
        return 0 if not self.delay else (self.step_index - 1) % 2

    # ------------------------------------------------------------------ schedule

    def actions(self, k: int) -> list[tuple[str, int]]:
        """Step k's ("F"|"B", microbatch) sequence on this stage."""
        M, s, S = self.num_microbatches, self.grid.stage, self.grid.num_stages
        warm = S - 1 - s
        if self.delay:
            out = []
            for j in range(k * M, (k + 1) * M):
                out.append(("F", j))
                if j - warm >= 0:
                    out.append(("B", j - warm))
            return out
        warm = min(warm, M)
        out = [("F", k * M + i) for i in range(warm)]
        for i in range(M - warm):
            out += [("F", k * M + warm + i), ("B", k * M + i)]
        return out + [("B", k * M + i) for i in range(M - warm, M)]

    def run_schedule(self, batch) -> tuple[float | None, float]:
        x, y = batch
        k = self.step_index
        M = self.num_microbatches
        xs, ys = x.chunk(M), y.chunk(M)
        self.losses, self.idle_s = [], 0.0
        for kind, j in self.actions(k):
            if kind == "F":
                self.forward(j, xs[j - k * M], ys[j - k * M])
            else:
                self.backward(j)
        if not (self.delay and self.pending is not None and self.pending[0] == self.grid.prev):
            self.flush_send()  # a held gradient goes out with the next step's first receive
        loss = torch.stack(self.losses).sum().item() if self.grid.is_last else None
        return loss, self.idle_s

    def forward(self, j: int, x_mb: torch.Tensor, y_mb: torch.Tensor) -> None:
        if self.grid.is_first:
            h = x_mb
        else:
            h = self.receive(self.activation_buffer(x_mb.shape[0]), self.grid.prev)
            h.requires_grad_(True)
        autocast = self.setup.autocast
        with autocast() if autocast else contextlib.nullcontext():
            out = self.version_of(j)(h)
            if self.grid.is_last:
                out = self.loss_fn(out, y_mb) / self.num_microbatches
        if self.grid.is_last:
            self.losses.append(out.detach())
        else:
            self.send(out.detach(), self.grid.next)
        self.inflight[j] = (h, out)

    def backward(self, j: int) -> None:
        h, out = self.inflight.pop(j)
        if self.grid.is_last:
            out.backward()
        else:
            grad = self.receive(torch.empty_like(out), self.grid.next)
            torch.autograd.backward(out, grad)
        if not self.grid.is_first:
            self.send(h.grad, self.grid.prev)

    # ------------------------------------------------------------------ p2p

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        self.flush_send()
        self.pending = (peer, tensor)

    def flush_send(self) -> None:
        if self.pending is not None:
            peer, tensor = self.pending
            self.pending = None
            self.comm.send(tensor, peer)

    def receive(self, buffer: torch.Tensor, peer: int) -> torch.Tensor:
        start = time.perf_counter()
        if self.pending is not None and self.pending[0] == peer:
            self.comm.exchange({peer: self.pending[1]}, {peer: buffer})
            self.pending = None
        else:
            self.flush_send()
            self.comm.recv(buffer, peer)
        self.idle_s += time.perf_counter() - start
        return buffer

    # ------------------------------------------------------------------ update

    def apply_update(self) -> float:
        if not self.delay:
            return super().apply_update()
        k = self.step_index
        if k == 0:
            return 0.0  # W(0) = W(-1): no gradient is due yet
        target, newest = self.versions[k % 2], self.versions[(k - 1) % 2]
        comm_s = self.sync_gradients(target)  # g_{k-1}, computed on W(k-2)
        with torch.no_grad():
            for p_target, p_newest in zip(target.parameters(), newest.parameters(),
                                          strict=True):
                p_target.copy_(p_newest)
        self.rebind(k % 2)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return comm_s

    def rebind(self, index: int) -> None:
        """Point the optimizer (param_groups and state) at version module `index`."""
        if index == self.bound:
            return
        old = list(self.versions[self.bound].parameters())
        new = list(self.versions[index].parameters())
        mapping = {id(a): b for a, b in zip(old, new, strict=True)}
        for group in self.optimizer.param_groups:
            group["params"] = [mapping[id(p)] for p in group["params"]]
        for a, b in zip(old, new, strict=True):
            if a in self.optimizer.state:
                self.optimizer.state[b] = self.optimizer.state.pop(a)
        self.bound = index


    def bubble_theory(self) -> float:
        """delay 0: the flushed 1F1B's (S-1)/(M+S-1); delay 1: 0 (no flush: the pipeline
        fills once, at the start of the run, not every step)."""
        return super().bubble_theory() if not self.delay else 0.0

    def critical_path(self) -> CriticalPath:
        """delay 1: M slots, no exposed hops (the next step's forwards fill the drain)."""
        if not self.delay:
            return super().critical_path()
        M = self.num_microbatches
        return CriticalPath(slots=M, work_slots=M, hops=0)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Both versions, their accumulated gradients, the stashed inputs, the held send."""
        return {
            "versions": [v.state_dict() for v in self.versions],
            "grads": [[None if p.grad is None else p.grad.clone() for p in v.parameters()]
                      for v in self.versions],
            "optimizer": self.optimizer.state_dict(),
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
        self.step_index = state["step_index"]
        self.pending = state["pending"]
        self.inflight = {}
        # rebuild the stashed activations' graphs: same input, same version -> same output
        autocast = self.setup.autocast
        for j, h in state["inflight"].items():
            h = h.requires_grad_(h.is_floating_point())
            with autocast() if autocast else contextlib.nullcontext():
                self.inflight[j] = (h, self.version_of(j)(h))
