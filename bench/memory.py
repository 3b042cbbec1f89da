"""Memory you can plan: each rank's bytes before launch, and the measured peak after.

    commbench config show configs/llama-7b.yaml                       # the plan, no allocation
    commbench config show configs/llama-7b.yaml --set parallel.num_stages=4 \
        --set strategy.name=pipeline
    pytest tests/test_memory.py

`plan(cfg)` builds the model on the meta device (nothing allocated), measures what each
rank holds, and asks the strategy for its terms (its class's `memory_terms`, algorithms/base.py
`strategy_of(cfg).memory_terms(cfg, facts)`; algorithms/memory.py):
- parameters and gradients: fp32, 4 bytes each, of the rank's module (a pipeline stage's
  layers; the tied embedding on both end stages), divided by the shard count under FSDP;
- optimizer state (`optimizer_terms`): adamw 2 moments; sgd 1 momentum (0 without);
  muon 1 momentum on the hidden matrices + AdamW's 2 on the rest; lion 1; adan 4 (three
  moments and the previous gradient); soap 2 moments + per 2-D tensor the two
  Kronecker factors and their eigenbases (m^2 + n^2 each, dims <= 10000); nadamw 2; the
  one-step delay wrapper's stored gradient (the pipeline profile's: each parameter's
  size x its delay); a delay correction's previous update (the emulation's or
  PipeDream-2BW's);
- activations: one microbatch's forward through the rank's layers on the meta device,
  counting every distinct storage autograd saves for backward (parameters excluded);
  attention counted as a fused kernel keeps it (q, k, v, output, log-sum-exp: no T x T
  matrix). Backward's working set is one block's activations (the gradients of the block
  being differentiated). With `activation_checkpointing: blocks` a block keeps its input
  only, plus one block's activations while it is recomputed. The logits (B x T x V) and
  their gradient are counted on the rank holding the head. bf16: the forward runs under
  an emulation of autocast on the meta device (`_MetaAutocast`; torch has no autocast
  there): the matmuls and attention save bf16 copies of their inputs, the residual
  stream and what follows it by type promotion stay fp32, as under CUDA's autocast (until
  2026-11-27 fp32's count was halved: an H100's eager peak was 1.12 x that plan,
  docs/gpu.md). The weights' bf16 copies are a term of their own: autocast caches one per
  weight for its region, which is a step for DDP and torch's pipelines (one region around
  the schedule) and a microbatch for PipeDream-2BW (`PipelineStrategy.autocast_regions` in
  algorithms/pipeline_base.py);
- the strategy's own terms: DDP buckets, the outer step's copies (DiLoCo/Pier global θ and
  momentum, the pseudo-gradient buffer, the evaluation copy), GASLoC's anchor and round
  buffers, pipeline weight versions and microbatches in flight, receive buffers.
Not counted: the CUDA context and NCCL's buffers (outside `max_memory_allocated`), the
allocator's fragmentation, the interpreter and torch's own memory (on the CPU, the
measured figure subtracts the process's footprint before the model was built).

`check_fits(cfg, plan)` refuses a run whose largest rank does not fit the device it will
run on (CUDA total memory; on the CPU, physical RAM shared by the node's ranks), naming
the largest term. After a run, summary.json holds `memory_estimate_bytes_per_rank` beside
`peak_memory_bytes_per_rank` and `peak_memory_above_start_bytes_per_rank` (bench/run/train.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from algorithms.base import strategy_of
from algorithms.delay import stage_delays
from algorithms.memory import HOST, MemoryFacts
from algorithms.partition import stage_bounds

GIB = 1 << 30
SOAP_MAX_PRECONDITION_DIM = 10000
"""pytorch-optimizer SOAP's default `max_precondition_dim`: larger dims get no factor."""


@dataclass(frozen=True)
class RankMemory:
    """The plan of one kind of rank (every rank of a data-parallel run, or one stage)."""

    role: str
    terms: dict[str, int]

    def total(self, on_cpu: bool = False) -> int:
        return sum(v for k, v in self.terms.items() if on_cpu or not k.startswith(HOST))

    def largest(self) -> tuple[str, int]:
        return max(self.terms.items(), key=lambda kv: kv[1])


@dataclass(frozen=True)
class MemoryPlan:
    ranks: list[RankMemory]
    """One entry per role: a single one for data parallelism, one per pipeline stage."""
    rank_roles: list[int]
    """For every global rank, its index into `ranks`."""

    def per_rank(self, on_cpu: bool = False) -> list[int]:
        return [self.ranks[i].total(on_cpu) for i in self.rank_roles]

    def worst(self, on_cpu: bool = False) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total(on_cpu))

    def describe(self, on_cpu: bool = False) -> str:
        """The plan as aligned text lines (`commbench config show`)."""
        lines = []
        for rank in self.ranks:
            width = max(len(k) for k in rank.terms)
            lines.append(f"# memory per rank ({rank.role}): {_gib(rank.total(on_cpu))}")
            for name, value in sorted(rank.terms.items(), key=lambda kv: -kv[1]):
                lines.append(f"#   {name:<{width}}  {_gib(value)}")
        return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / GIB:9.3f} GiB"


# ---------------------------------------------------------------------- optimizer state


def optimizer_terms(o, module: nn.Module) -> dict[str, int]:
    """Bytes of the inner optimizer's state on `module`'s parameters (optim config `o`)."""
    from bench.model import hidden_matrices

    params = _unique(p for p in module.parameters() if p.requires_grad)
    total = sum(_bytes(p) for p in params)
    name = o.name
    if name == "adamw":
        terms = {"optimizer state (AdamW: 2 moments)": 2 * total}
    elif name == "sgd":
        terms = {"optimizer state (SGD momentum)": total} if o.momentum > 0 else {}
    elif name == "muon":
        hidden = sum(_bytes(p) for p in hidden_matrices(module))
        terms = {"optimizer state (Muon momentum, hidden matrices)": hidden,
                 "optimizer state (AdamW on the rest: 2 moments)": 2 * (total - hidden)}
    elif name == "nadamw":
        terms = {"optimizer state (NAdamW: 2 moments)": 2 * total}
    elif name == "lion":
        terms = {"optimizer state (Lion momentum)": total}
    elif name == "adan":
        terms = {"optimizer state (Adan: 3 moments + previous gradient)": 4 * total}
    elif name == "soap":
        factors = sum(2 * 4 * sum(d * d for d in p.shape if d <= SOAP_MAX_PRECONDITION_DIM)
                      for p in params if p.dim() == 2)
        terms = {"optimizer state (SOAP: 2 moments)": 2 * total,
                 "optimizer state (SOAP: Kronecker factors and eigenbases)": factors}
    else:  # an optimizer this plan does not know yet: assume AdamW's two states
        terms = {f"optimizer state ({name}: assumed 2 per parameter)": 2 * total}
    if o.delay and o.delay_profile == "pipeline":  # g(t-d) kept d steps: sum of d |p|
        layers = module.as_layers() if hasattr(module, "as_layers") else list(module)
        delays = stage_delays(layers, o.delay_stages, o.delay)  # rank_facts: a ModuleList
        terms["delay (pipeline profile): stored gradients"] = sum(
            delays[id(p)] * _bytes(p) for p in params)
    elif o.delay:
        terms["one-step delay: stored gradient"] = total
    if o.delay_correction != "none":  # the emulation's or PipeDream-2BW's delayed update
        terms[f"delay correction ({o.delay_correction}): previous update"] = total
    return terms


def optimizer_step_bytes(o, module: nn.Module, on_cuda: bool) -> int:
    """Temporaries of one step: torch's foreach kernels (CUDA) allocate a copy of the state
    they combine; the per-tensor loop (CPU) one tensor at a time. The delay wrapper copies
    the fresh gradient, and a delay correction the parameters, during its step."""
    params = _unique(p for p in module.parameters() if p.requires_grad)
    total = sum(_bytes(p) for p in params)
    largest = max((_bytes(p) for p in params), default=0)
    step = total if on_cuda else 2 * largest
    if o.delay:  # the fresh gradient, copied
        step += total
    if o.delay_correction != "none":  # the weights before the update, copied
        step += total
    return step


def _bytes(p: torch.Tensor) -> int:
    return p.numel() * 4  # parameters, gradients and optimizer state are fp32


def _unique(params) -> list[torch.Tensor]:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


# ---------------------------------------------------------------------- activations


class _FusedAttention(torch.autograd.Function):
    """Stands for scaled_dot_product_attention while counting: keeps what a fused kernel
    (flash / memory-efficient / CPU flash) keeps for backward, no T x T matrix."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):  # never run: counting only
        raise RuntimeError("_FusedAttention is for memory counting on the meta device")


class _MetaAutocast(TorchFunctionMode):
    """Autocast's casts, emulated on the meta device (torch has none there), so that what
    a bf16 forward saves for backward can be counted: autocast's lower-precision ops (the
    matmuls) get their fp32 inputs cast to `dtype`, a parameter once per forward (autocast
    caches its casts of weights), the ops CUDA's autocast runs in fp32 get fp32 inputs,
    and everything else follows type promotion as it does under autocast (an fp32 + bf16
    add is fp32: the residual stream stays fp32). Attention is cast in `_fused_attention_in`."""

    LOWER = frozenset({F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
                       torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.mm,
                       torch.Tensor.bmm})
    FP32 = frozenset({F.layer_norm, F.group_norm, F.softmax, F.log_softmax, torch.softmax,
                      torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax,
                      F.cross_entropy, F.nll_loss, F.mse_loss, torch.rsqrt, torch.exp,
                      torch.log, torch.pow, torch.Tensor.pow, torch.Tensor.rsqrt})

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.weights: dict[int, torch.Tensor] = {}

    def cast(self, t, dtype: torch.dtype):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == dtype:
            return t
        if isinstance(t, nn.Parameter):
            if id(t) not in self.weights:
                self.weights[id(t)] = t.to(dtype)
            return self.weights[id(t)]
        return t.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtype = self.dtype if func in self.LOWER else torch.float32 if func in self.FP32 else None
        if dtype is not None:
            args = tuple(self.cast(a, dtype) for a in args)
            kwargs = {k: self.cast(v, dtype) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _fused_attention_in(dtype: torch.dtype | None):
    """scaled_dot_product_attention's stand-in; under autocast (`dtype`) its inputs are
    cast first, as autocast does for attention."""

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
        if dtype is not None:
            q, k, v = (t.to(dtype) if t.is_floating_point() else t for t in (q, k, v))
        return _FusedAttention.apply(q, k, v)

    return attention


def saved_activation_bytes(layers: list[nn.Module], batch: int, seq_len: int, width: int,
                           first: bool, loss_fn=None, dtype: torch.dtype | None = None,
                           weight_copies: dict[int, int] | None = None) -> int:
    """Bytes autograd keeps for backward after `layers` forward one microbatch (meta
    device: nothing allocated), under autocast to `dtype` when given (`_MetaAutocast`).
    Distinct storages counted once, parameters excluded, and so are autocast's copies of
    the weights (one per autocast region, not per microbatch): those go into
    `weight_copies` ({id(parameter): bytes of its copy}) when given."""
    params = {p.untyped_storage()._cdata for m in layers for p in m.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params:  # _cdata: the storage's identity (views share it)
            saved[storage._cdata] = storage.nbytes()
        return t

    if first:
        x = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    else:
        x = torch.zeros(batch, seq_len, width, device="meta", requires_grad=True)
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _fused_attention_in(dtype)
    autocast = _MetaAutocast(dtype) if dtype is not None else None
    try:
        with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
              autocast or contextlib.nullcontext()):
            for layer in layers:
                x = layer(x)
            if loss_fn is not None:
                loss_fn(x, torch.zeros(batch, seq_len, dtype=torch.long, device="meta"))
    finally:
        F.scaled_dot_product_attention = original
    for key, copy in (autocast.weights if autocast else {}).items():
        saved.pop(copy.untyped_storage()._cdata, None)
        if weight_copies is not None:
            weight_copies[key] = copy.untyped_storage().nbytes()
    return sum(saved.values())


# ---------------------------------------------------------------------- the plan


def _meta_model(cfg):
    from bench.data.tokenizers import get_tokenizer
    from bench.model import build_model, config_of

    model_cfg = config_of(cfg.model, get_tokenizer(cfg.data.tokenizer).vocab_size)
    # a build draws its init seed from the global RNG: planning must not move the stream
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return build_model(model_cfg)


def _stage_chunks(cfg, layers: list[nn.Module]) -> list[list[list[nn.Module]]]:
    """Per stage, its chunks' layers (interleaved schedules hold several chunks)."""
    S = cfg.parallel.num_stages
    V = getattr(cfg.strategy, "stages_per_rank", 1)
    bounds = stage_bounds(layers, S * V, cfg.parallel.partition)
    return [[layers[a:b] for a, b in bounds[s::S]] for s in range(S)]


def rank_facts(cfg, on_cuda: bool = False) -> list[MemoryFacts]:
    """The measured facts of each stage (one entry without pipeline stages)."""
    from bench.model import TransformerBlock, lm_loss

    model = _meta_model(cfg)
    m, p = cfg.model, cfg.parallel
    micro = max(1, cfg.data.batch_size // p.num_microbatches)
    dtype = torch.bfloat16 if m.precision == "bf16" else None
    checkpointing = m.activation_checkpointing == "blocks"
    layers = model.as_layers()
    stages = _stage_chunks(cfg, layers) if p.num_stages > 1 else [[layers]]
    width, vocab = model.cfg.n_embd, model.cfg.vocab_size
    facts = []
    for s, chunks in enumerate(stages):
        module = nn.ModuleList([layer for chunk in chunks for layer in chunk])
        activation = 0
        blocks = [layer for chunk in chunks for layer in chunk
                  if isinstance(layer, TransformerBlock)]
        block = saved_activation_bytes(blocks[:1], micro, m.seq_len, width, False,
                                       dtype=dtype)
        copies: dict[int, int] = {}  # autocast's weight copies: one per weight on the rank
        for chunk in chunks:
            ends = (chunk[0] is layers[0], lm_loss if chunk[-1] is layers[-1] else None)
            if not checkpointing:
                activation += saved_activation_bytes(chunk, micro, m.seq_len, width, *ends,
                                                     dtype, copies)
                continue
            if dtype is not None:  # autocast caches every weight's copy through the forward
                saved_activation_bytes(chunk, micro, m.seq_len, width, *ends, dtype, copies)
            for layer in chunk:  # a checkpointed block keeps its input only
                if isinstance(layer, TransformerBlock):
                    activation += micro * m.seq_len * width * 4
                else:
                    activation += saved_activation_bytes(
                        [layer], micro, m.seq_len, width, layer is layers[0],
                        lm_loss if layer is layers[-1] else None, dtype)
        holds_head = any(chunk[-1] is layers[-1] for chunk in chunks)
        block_params = [sum(_bytes(t) for t in b.parameters()) for b in blocks]
        facts.append(MemoryFacts(
            param_bytes=sum(_bytes(t) for t in _unique(module.parameters())),
            optimizer=optimizer_terms(cfg.optim, module),
            optimizer_step_bytes=optimizer_step_bytes(cfg.optim, module, on_cuda),
            activation_bytes=activation, block_bytes=block,
            weight_copy_bytes=sum(copies.values()),
            checkpointing=checkpointing,
            logits_bytes=micro * m.seq_len * vocab * 4 if holds_head else 0,
            # the residual stream crosses a boundary, fp32 under autocast too
            boundary_bytes=micro * m.seq_len * width * 4,
            unit_param_bytes=max(block_params, default=0),
            root_param_bytes=sum(_bytes(t) for t in _unique(module.parameters()))
            - sum(block_params),
            stage=s, num_stages=p.num_stages, num_microbatches=p.num_microbatches,
            world_size=p.world_size, group_size=p.group_size))
    return facts


def plan(cfg, on_cuda: bool | None = None) -> MemoryPlan:
    """Each rank's memory terms for config `cfg` (see the module docstring)."""
    if on_cuda is None:
        on_cuda = _device_type(cfg) == "cuda"
    facts = rank_facts(cfg, on_cuda)
    S = cfg.parallel.num_stages
    ranks = [RankMemory(f"stage {f.stage} of {S}" if S > 1 else "every rank",
                        strategy_of(cfg).memory_terms(cfg, f)) for f in facts]
    return MemoryPlan(ranks, [r % S for r in range(cfg.parallel.world_size)])


# ---------------------------------------------------------------------- the device


def _device_type(cfg) -> str:
    if cfg.parallel.device != "auto":
        return cfg.parallel.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_bytes(cfg) -> tuple[int, str] | None:
    """(bytes one rank may use, what they are) on the device this machine would run the
    config on: a CUDA device's total memory, or the physical RAM over the node's ranks."""
    if _device_type(cfg) == "cuda":
        if not torch.cuda.is_available():
            return None
        total = torch.cuda.get_device_properties(0).total_memory
        return total, f"the CUDA device's {total / GIB:.1f} GiB"
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    local = cfg.parallel.world_size // cfg.launch.nnodes
    return ram // local, f"{ram / GIB:.1f} GiB of RAM shared by {local} ranks on this node"


def fit_problem(cfg, memory_plan: MemoryPlan) -> str | None:
    """Why the plan does not fit this machine's device, or None when it fits (or no
    device is known)."""
    known = device_bytes(cfg)
    if known is None:
        return None
    available, what = known
    on_cpu = _device_type(cfg) == "cpu"
    worst = memory_plan.worst(on_cpu)
    need = worst.total(on_cpu)
    if need <= available:
        return None
    name, value = worst.largest()
    return (f"memory: the plan needs {need / GIB:.2f} GiB per rank ({worst.role}) but "
            f"{what} give each rank {available / GIB:.2f} GiB; the largest term is {name!r} "
            f"({value / GIB:.2f} GiB): shard it (parallel.shard=fsdp), cut the model into "
            "more pipeline stages, use model.activation_checkpointing=blocks, a smaller "
            "data.batch_size or more parallel.num_microbatches")


def check_fits(cfg) -> None:
    """Refuse (ValueError) a config whose plan does not fit this machine's device."""
    problem = fit_problem(cfg, plan(cfg))
    if problem is not None:
        raise ValueError(problem)


def describe(cfg) -> str:
    """The plan and whether it fits, for `commbench config show`."""
    memory_plan = plan(cfg)
    on_cpu = _device_type(cfg) == "cpu"
    lines = [memory_plan.describe(on_cpu)]
    problem = fit_problem(cfg, memory_plan)
    known = device_bytes(cfg)
    if problem is not None:
        lines.append(f"# DOES NOT FIT: {problem}")
    elif known is not None:
        lines.append(f"# fits: {known[1]}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- measured


def current_bytes(device: torch.device) -> int:
    """Memory this process holds now: CUDA allocated, else the resident set (RSS)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak(device: torch.device) -> int:
    """Start measuring the peak from now (CUDA's peak statistics; on Linux the process's
    peak RSS, through /proc/self/clear_refs); returns `current_bytes(device)`."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        _release_freed_heap()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the resident set's high-water mark (Linux >= 4.0)
        except OSError:
            pass  # the peak then counts from the process's start
    return current_bytes(device)


def _release_freed_heap() -> None:
    """Hand memory the C allocator keeps after frees back to the OS (glibc), so that a
    peak measured from here counts what is allocated from here."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
