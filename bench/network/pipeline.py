"""Pricing a pipeline step by replaying its schedule on the modelled link, not op by op.

Used by the pricing engine (bench/network/timeline.py: the loop's StepClock and the
what-if) for the overlap-aware projection of strategies that describe their step
(`Strategy.critical_path()`, algorithms/base.py: the pipelines); tested by
`pytest tests/test_pipeline.py -k critical_path`. The model (docs/algorithms.md,
Pipelines, "Projection"):

- Every stage runs the schedule's program for one step: forwards (`F`) and backwards
  (`B`), and batches of point-to-point sends and receives, posted and then waited on, in
  the engine's own order (`programs`: torch's `Schedule1F1B` / `ScheduleGPipe` of
  torch 2.13, our executor's `algorithms/schedule.py`).
- A message leaves when its send is posted AND the receiver's ready-to-receive has
  reached the sender (`h` after the receive was posted: gloo's handshake, one latency;
  0 on NCCL), and arrives `d` later (one message on the link, latency + S/beta + TCP
  ramp). A send is complete when its data has left (`d - h` after leaving), a receive
  when the data has arrived. So a receive posted only when the stage needs it (every
  engine here) waits `h + d`, and nothing hides it.
- On gloo (h > 0) a batch that posts its sends before its receives (torch's fused
  batches) and is posted after its peer's gets the peer's message only after its own has
  gone: its ready-to-receive notice queues behind its own payload on the pair's one TCP
  connection. It waits `h + d + (d - h)`, the two messages one after the other (measured
  on the shaped links, 2 ranks, 64-512 kB each way: docs/network-model.md, "Two-way
  exchange"). Our executor posts receives first (`Communicator.exchange`) and does not
  pay it.
- `F` = c_s / 3W and `B` = 2c_s / 3W on stage s, c_s = the measured compute of the step
  (without bubble and transfers) of the rank that runs stage s, over its W microbatch
  passes. The run's projection and the what-if gather every stage's compute of the step
  (bench/network/timeline.py `pipeline_step_s`, `pipeline_values`); given one compute,
  every stage computes it.
  Taking the slowest rank's for every stage charged the bubble at its rate and, step by
  step, the largest of the stages' jitter. On the 2-rank lab (100 Mbit/s + 1 ms, a
  traced step) the last stage computed 14.2 ms a microbatch and the first 13.0 (its
  first forward and last backward, the bubble, 11.4); the 2-stage 1F1B step, projected
  on its own compute, was 8-15% over its run at 1 ms with the slowest rank's compute
  everywhere (runs o-r), +2.5% to +4.9% with each stage's (runs t, u;
  docs/network-model.md, Results).
- The step ends when every stage has finished, plus `t_other`: every other record of the
  step (data-parallel and tied-weight all-reduces, the clipping norm) priced as the plain
  projection does, after the last backward. Without a flush (PipeDream-2BW, `delay: 1`)
  the step is the steady-state period of consecutive steps.

`d` and `h` come from the step's largest point-to-point message: `d` = the model's price of
one `send` of it, `h` = its price as a symmetric `exchange` minus `d` (gloo: one latency;
NCCL and the naive model: 0). The earlier slot model charged every slot `max(c, 2 tau)`
(transfers hidden under compute, two per slot): on latency-bound links it projected a
2-stage 1F1B step 28-69% slower than it ran (docs/network-model.md).

Cost: `simulate` is the model as an interpreter; the projections run it as straight-line
code (`compiled`: the same operations, so the same bits, about 30x faster), one replay
per distinct input (`critical_path_time`) or many as numpy lanes (`critical_path_times`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import numpy as np

from algorithms import schedule as ours
from algorithms.contract import CriticalPath
from algorithms.ledger import CommRecord
from bench.network.costs import P2P

Message = tuple[str, int, int]
"""("A" activation | "G" gradient, boundary b between stages b and b + 1, microbatch)."""
Op = tuple
"""("F",) | ("B",) | ("post", sends, recvs, sends_first) | ("wait", ...the same) | ("sync",)."""
FORWARD_SHARE = 1 / 3
"""A forward's share of a microbatch's compute (a backward costs about two forwards)."""


def critical_path_inputs(records: Iterable[CommRecord],
                         price: Callable[[CommRecord], float]) -> tuple[float, float, float]:
    """(d, h, t_other) of a step's records (module docstring; `price`:
    `bench.network.model.pricer`): one message's seconds, the handshake's, and every
    non-point-to-point record's seconds, summed."""
    largest, size, other = None, -1.0, 0.0
    for r in records:
        if r.op not in P2P:
            other += price(r)
            continue
        per_peer = (max(r.peer_nbytes) if r.peer_nbytes
                    else r.nbytes / max(1, len(r.peers or ())))
        if per_peer > size:
            largest, size = r, per_peer
    if largest is None:
        return 0.0, 0.0, other
    one = replace(largest, op="send", nbytes=int(size), peers=largest.peers[:1],
                  group_size=2, peer_nbytes=None)
    d = price(one)
    both = replace(one, op="exchange", peer_nbytes=(int(size),))
    return d, min(d, max(0.0, price(both) - d)), other


def critical_path_time(compute_s: float | Sequence[float], d: float, h: float,
                       other: float, path: CriticalPath) -> float:
    """The step's modelled seconds: its schedule replayed (`simulate`) with each stage's
    compute (`compute_s`: one per stage, or one for every stage), plus `other` once per
    step. Priced once per distinct input (a run's identical steps, the robust
    projection's medians, the what-if's rank classes meet the cache)."""
    computes = ((float(compute_s),) * path.num_stages if isinstance(compute_s, (int, float))
                else tuple(compute_s))
    if len(computes) != path.num_stages:
        raise ValueError(f"critical path: need one compute per stage ({path.num_stages}), "
                         f"got {len(computes)}")
    if min(computes) < 0 or d < 0 or h < 0 or h > d:
        raise ValueError(f"critical path: need compute_s, d >= 0 and 0 <= h <= d, got "
                         f"compute_s={compute_s}, d={d}, h={h}")
    return _replayed(computes, d, h, other, path)


@functools.lru_cache(maxsize=4096)
def _replayed(computes: tuple[float, ...], d: float, h: float, other: float,
              path: CriticalPath) -> float:
    steps = replayed_steps(path)
    f = [c * FORWARD_SHARE / path.passes for c in computes]
    b = [c * (1 - FORWARD_SHARE) / path.passes for c in computes]
    ends = compiled(path.schedule, path.num_stages, path.passes, steps)(f, b, d, h, other)
    return ends[-1] - (ends[-2] if steps > 1 else 0.0)


LANES_AT_ONCE = 64
"""From this many replays on, `critical_path_times` runs them as numpy lanes."""


def critical_path_times(computes, d, h, other, path: CriticalPath):
    """`critical_path_time` of many steps at once, bit for bit (the same operations, lane
    by lane): `computes` [lanes, stages], `d`, `h`, `other` [lanes] (numpy float64)
    -> [lanes]. The settle point's replay of a window's replicas and profiles."""
    computes = np.asarray(computes, dtype=np.float64)
    d, h, other = (np.asarray(x, dtype=np.float64) for x in (d, h, other))
    if computes.ndim != 2 or computes.shape[1] != path.num_stages:
        raise ValueError(f"critical path: need one compute per stage ({path.num_stages}), "
                         f"got shape {computes.shape}")
    bad = (computes < 0).any(axis=1) | (d < 0) | (h < 0) | (h > d)
    if bad.any():
        i = int(bad.argmax())
        raise ValueError(f"critical path: need compute_s, d >= 0 and 0 <= h <= d, got "
                         f"compute_s={computes[i].tolist()}, d={d[i]}, h={h[i]}")
    if len(d) < LANES_AT_ONCE:  # numpy's per-call overhead outweighs a few replays
        return np.array([_replayed(tuple(c), *x, path) for c, *x in zip(
            computes.tolist(), d.tolist(), h.tolist(), other.tolist(), strict=True)])
    steps = replayed_steps(path)
    f = [c * FORWARD_SHARE / path.passes for c in computes.T]
    b = [c * (1 - FORWARD_SHARE) / path.passes for c in computes.T]
    ends = compiled(path.schedule, path.num_stages, path.passes, steps, lanes=True)(
        f, b, d, h, other)
    return ends[-1] - (ends[-2] if steps > 1 else 0.0)


def replayed_steps(path: CriticalPath) -> int:
    """Steps replayed: three without a flush (the steady state's period), else one."""
    return 3 if path.schedule == "2bw" else 1


def simulate(stages: tuple[tuple[Op, ...], ...], f: Sequence[float], b: Sequence[float],
             d: float, h: float, other: float) -> list[float]:
    """Run every stage's program on one clock each (module docstring's link), stage s's
    forward taking f[s] and its backward b[s]: the time at which each step ended (every
    stage at the step's `sync`, plus `other`)."""
    num = len(stages)
    clock, at = [0.0] * num, [0] * num
    sent: dict[Message, float] = {}  # message -> when its send was posted
    ready: dict[Message, float] = {}  # message -> when its receive was posted
    ends: list[float] = []
    while True:
        moved = False
        for s, program in enumerate(stages):
            while at[s] < len(program):
                op = program[at[s]]
                if op[0] == "F":
                    clock[s] += f[s]
                elif op[0] == "B":
                    clock[s] += b[s]
                elif op[0] == "post":
                    sent.update(dict.fromkeys(op[1], clock[s]))
                    ready.update(dict.fromkeys(op[2], clock[s]))
                elif op[0] == "wait":
                    if not all(m in ready for m in op[1]) or not all(m in sent for m in op[2]):
                        break  # the peer has not posted its side yet
                    leaves = [max(sent[m], ready[m] + h) for m in (*op[1], *op[2])]
                    done = [t + d - h for t in leaves[:len(op[1])]]
                    for m, t in zip(op[2], leaves[len(op[1]):], strict=True):
                        # gloo: posted sends first after its peer, a batch's notice for
                        # the peer's message waits behind its own (module docstring)
                        late = h > 0 and op[3] and op[1] and sent[m] <= ready[m] + h
                        done.append(t + d + (d - h if late else 0.0))
                    clock[s] = max(clock[s], *done)
                else:  # sync: wait for every stage
                    break
                at[s] += 1
                moved = True
        if all(at[s] == len(p) for s, p in enumerate(stages)):
            return ends
        if all(at[s] < len(p) and p[at[s]][0] == "sync" for s, p in enumerate(stages)):
            end = max(clock) + other
            ends.append(end)
            clock = [end] * num
            at = [i + 1 for i in at]
        elif not moved:
            raise RuntimeError(f"pipeline schedule deadlocks at ops {at} "
                               f"(a bug in bench/network/pipeline.py's programs)")


@functools.lru_cache(maxsize=64)
def compiled(schedule: str, num_stages: int, passes: int, steps: int,
             lanes: bool = False) -> Callable:
    """`simulate` of these programs as straight-line code: (f, b, d, h, other) -> the
    step ends, the same floating-point operations in the same order (so the same bits),
    without the interpreter's bookkeeping. Which stage runs which op when depends only on
    the programs (a wait blocks until its peer has POSTED, whenever that was), so the
    order `simulate` visits the ops in is fixed once here (`_trace`) and written out as
    Python; only the times and gloo's late-batch test are left to run. `lanes`: every
    value a numpy array, many replays at once (`critical_path_times`)."""
    num, lines, names = num_stages, [], {}

    def var(kind: str, m: Message) -> str:
        return names.setdefault((kind, m), f"{kind}{len(names)}")

    def maximum(target: str, terms: list[str]) -> list[str]:
        """`target = max(*terms)`: Python's max keeps the first of equal values."""
        if lanes:
            out = terms[0]
            for term in terms[1:]:
                out = f"np.maximum({out}, {term})"
            return [f"{target} = {out}"]
        return [f"{target} = {terms[0]}", *(f"if {t} > {target}: {target} = {t}"
                                            for t in terms[1:])]

    for s, op in _trace(programs(schedule, num_stages, passes, steps)):
        if op[0] in ("F", "B"):
            lines.append(f"c{s} = c{s} + {op[0].lower()}{s}")
        elif op[0] == "post":
            lines += [f"{var('S', m)} = c{s}" for m in op[1]]
            lines += [f"{var('R', m)} = c{s}" for m in op[2]]
        elif op[0] == "wait":
            done = []
            for m in (*op[1], *op[2]):
                sent, x = var("S", m), f"x{len(done)}"
                lines += [f"u = {var('R', m)} + h", *maximum("t", [sent, "u"])]
                if m in op[1]:
                    lines.append(f"{x} = t + d - h")
                elif op[3] and op[1]:  # gloo's late batch (`simulate`): decided per replay
                    lines.append(f"{x} = t + d + np.where({sent} <= u, dh, 0.0)" if lanes
                                 else f"{x} = t + d + (dh if hpos and {sent} <= u else 0.0)")
                else:
                    lines.append(f"{x} = t + d")
                done.append(x)
            lines += maximum(f"c{s}", [f"c{s}", *done])
        else:  # every stage at its sync
            lines += maximum("end", [f"c{i}" for i in range(num)])
            lines += ["end = end + other", "ends.append(end)",
                      *(f"c{i} = end" for i in range(num))]
    head = ["def replay(f, b, d, h, other):",
            f"    {', '.join(f'f{i}' for i in range(num))}, = f",
            f"    {', '.join(f'b{i}' for i in range(num))}, = b",
            "    hpos, ends = h > 0, []",
            # late lanes add d - h, the others 0 (d - h where h > 0: the late test's first half)
            "    dh = np.where(hpos, d - h, 0.0) if hasattr(d, 'shape') else d - h",
            f"    {' = '.join(f'c{i}' for i in range(num))} = 0.0"]
    source = "\n".join([*head, *("    " + line for line in lines), "    return ends"])
    scope = {"np": np}
    exec(compile(source, f"<pipeline replay {schedule} {num_stages}x{passes}x{steps}>",
                 "exec"), scope)
    return scope["replay"]


def _trace(stages: tuple[tuple[Op, ...], ...]) -> list[tuple[int, Op]]:
    """The (stage, op) order in which `simulate` runs `stages` (a sync as (-1, ("sync",)),
    once every stage has reached it): its loop with the times left out."""
    at, order = [0] * len(stages), []
    sent: set[Message] = set()
    ready: set[Message] = set()
    while True:
        moved = False
        for s, program in enumerate(stages):
            while at[s] < len(program):
                op = program[at[s]]
                if op[0] == "post":
                    sent.update(op[1])
                    ready.update(op[2])
                elif op[0] == "wait":
                    if not all(m in ready for m in op[1]) or not all(m in sent for m in op[2]):
                        break
                elif op[0] == "sync":
                    break
                order.append((s, op))
                at[s] += 1
                moved = True
        if all(at[s] == len(p) for s, p in enumerate(stages)):
            return order
        if all(at[s] < len(p) and p[at[s]][0] == "sync" for s, p in enumerate(stages)):
            order.append((-1, ("sync",)))
            at = [i + 1 for i in at]
        elif not moved:
            raise RuntimeError(f"pipeline schedule deadlocks at ops {at} "
                               f"(a bug in bench/network/pipeline.py's programs)")


@functools.lru_cache(maxsize=64)
def programs(schedule: str, num_stages: int, passes: int,
             steps: int) -> tuple[tuple[Op, ...], ...]:
    """Every stage's ops for `steps` consecutive steps of `passes` microbatches."""
    if schedule not in PROGRAMS:
        raise ValueError(f"critical path: schedule must be one of {sorted(PROGRAMS)}, "
                         f"got {schedule!r}")
    return tuple(tuple(PROGRAMS[schedule](s, num_stages, passes, steps))
                 for s in range(num_stages))


class _Stage:
    """The messages of stage `s` of `n`, and its program under construction."""

    def __init__(self, s: int, n: int, sends_first: bool):
        self.s, self.n, self.ops = s, n, []
        self.sends_first = sends_first
        """Whether the engine posts a batch's sends before its receives."""

    def fwd_recv(self, j: int) -> tuple[Message, ...]:
        return (("A", self.s - 1, j),) if self.s > 0 else ()

    def fwd_send(self, j: int) -> tuple[Message, ...]:
        return (("A", self.s, j),) if self.s < self.n - 1 else ()

    def bwd_recv(self, j: int) -> tuple[Message, ...]:
        return (("G", self.s, j),) if self.s < self.n - 1 else ()

    def bwd_send(self, j: int) -> tuple[Message, ...]:
        return (("G", self.s - 1, j),) if self.s > 0 else ()

    def post(self, sends=(), recvs=()) -> tuple:
        """An asynchronous batch (nothing for an empty one): its wait op, to add later."""
        if not sends and not recvs:
            return ()
        self.ops.append(("post", tuple(sends), tuple(recvs), self.sends_first))
        return (("wait", tuple(sends), tuple(recvs), self.sends_first),)

    def blocking(self, sends=(), recvs=()) -> None:
        self.ops.extend(self.post(sends, recvs))


def _torch_1f1b(s: int, n: int, m: int, steps: int) -> list[Op]:
    """torch 2.13 `Schedule1F1B._step_microbatches`, op for op (a flush every step; its
    fused batches list the sends first)."""
    st = _Stage(s, n, sends_first=True)
    for k in range(steps):
        base, warm = k * m, min(m, n - s)
        fwd = bwd = 0
        send_work, fwd_sends = (), ()
        for _ in range(warm):
            st.blocking(recvs=st.fwd_recv(base + fwd))
            st.ops.append(("F",))
            st.ops.extend(send_work)
            fwd_sends = st.fwd_send(base + fwd)
            send_work = st.post(fwd_sends) if fwd != warm - 1 else ()
            fwd += 1
        while True:
            st.blocking(fwd_sends, st.bwd_recv(base + bwd))
            st.ops.append(("B",))
            bwd_sends = st.bwd_send(base + bwd)
            bwd += 1
            if fwd == m:
                break
            st.blocking(bwd_sends, st.fwd_recv(base + fwd))
            st.ops.append(("F",))
            fwd_sends = st.fwd_send(base + fwd)
            fwd += 1
        send_work = st.post(bwd_sends)
        while bwd < m:
            st.blocking(recvs=st.bwd_recv(base + bwd))
            st.ops.append(("B",))
            st.ops.extend(send_work)
            send_work = st.post(st.bwd_send(base + bwd))
            bwd += 1
        st.ops.extend(send_work)
        st.ops.append(("sync",))
    return st.ops


def _torch_gpipe(s: int, n: int, m: int, steps: int) -> list[Op]:
    """torch 2.13 `ScheduleGPipe._step_microbatches`: every forward (sends waited after the
    last), then every backward."""
    st = _Stage(s, n, sends_first=True)
    for k in range(steps):
        for recv, compute, send in ((st.fwd_recv, "F", st.fwd_send),
                                    (st.bwd_recv, "B", st.bwd_send)):
            pending = []
            for j in range(k * m, (k + 1) * m):
                st.blocking(recvs=recv(j))
                st.ops.append((compute,))
                pending.extend(st.post(send(j)))
            st.ops.extend(pending)
        st.ops.append(("sync",))
    return st.ops


def _ours(delay: int) -> Callable[[int, int, int, int], list[Op]]:
    def program(s: int, n: int, m: int, steps: int) -> list[Op]:
        """Our executor (algorithms/pipedream.py): blocking sends and receives, a send
        held for the exchange that `schedule.p2p_plan` batches it in (receive first:
        `Communicator.exchange`)."""
        st, held = _Stage(s, n, sends_first=False), ()
        for k in range(steps):
            to_hold, exchanged = ours.p2p_plan(s, n, m, k, delay)
            for kind, j in ours.actions(s, n, m, k, delay):
                recv, out = ((st.fwd_recv(j), st.fwd_send(j)) if kind == "F"
                             else (st.bwd_recv(j), st.bwd_send(j)))
                for message in recv:  # with the held send, or alone
                    sends, held = (held, ()) if message in exchanged else ((), held)
                    st.blocking(sends, (message,))
                st.ops.append((kind,))
                for message in out:
                    if message in to_hold:
                        held = (message,)
                    else:
                        st.blocking(sends=(message,))
            st.ops.append(("sync",))
        return st.ops
    return program


PROGRAMS: dict[str, Callable[[int, int, int, int], list[Op]]] = {
    "1f1b": _torch_1f1b, "gpipe": _torch_gpipe, "ours-1f1b": _ours(0), "2bw": _ours(1)}
"""Schedule name (`CriticalPath.schedule`) -> (stage, stages, microbatches, steps) -> ops."""
