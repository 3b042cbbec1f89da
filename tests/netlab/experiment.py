"""The shaped-link experiment behind `tox -e netlab`: runs, projections, the table.

A user with a fast network projects a run onto a slow one; this checks that projection
against the same training on the slow one. Two sizes of world: 2 ranks (one per core of
this machine: the validated mode) and 4 ranks (two per core: oversubscribed, reported
with the load they ran under).

Each case is ONE run, switched between the unshaped and the shaped links inside it (the
in-run A/B, tests/netlab/traced.py): phases of two metrics windows alternate after a
warm-up window, and the last window of each phase is compared. The unshaped windows (a
namespace per rank, plain veths without tbf, the case's delay on: it costs no CPU, and
TCP must not see its round trip change) give what the user has: the compute, and the
run's own projection onto the case's profile (`network.profiles`, `network.model=gloo`:
step-wise, max over ranks, overlap-aware, exactly as a report would). The shaped windows
(tbf-shaped, delayed links) give the measured step time. Every figure is read from the
train rows as (clock at a window's row - clock at the row before) / its steps, summed
over the phase's compared windows. The naive projection (textbook formulas, no overlap)
is priced after the fact from the run's ledger aggregates plus the unshaped windows'
compute-only projection.

Why one run and not two: the same unshaped run repeated minutes apart moved its compute
by -29% to +32% on this machine (the control of runs t and u, docs/network-model.md),
more than the network costs being checked; two runs compared that drift with the model.

`netprobe_in_lab` runs `python -m bench.node.netprobe` one rank per namespace on a shaped lab,
so a profile fitted on the links themselves can be projected onto the same way.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path

from bench.network.profiles import LINUX_TCP_INITIAL_WINDOW_B
from tests.netlab.lab import QUEUE_S, ROOT, Lab
from tests.netlab.traced import AB_ENV, PHASE_WINDOWS, counted_window, shaped_window

INNER_STEPS = {"gasloc": 5}
"""Local steps per gossip round in the lab: GASLoC 5 (its config: 10). A round of 10 steps
(0.19-0.29 s) sat on the kernel's RTO (0.2 s + the smoothed RTT: 224-228 ms measured at
1 Gbit/s + 10 ms), where whether an exchange restarts slow start depends on when the
sender last sent (gloo's ready-to-receive, the arrival order), which no trace records:
warm and ramped exchanges overlapped across 0.22-0.26 s of idle. At 5 steps (0.09-0.17 s
of idle, under the 0.2 s floor) the model prices every exchange warm, and 170 of 171 were
(docs/network-model.md, Results)."""


LOG_EVERY = {"gasloc": 50}
"""Steps per metrics row: 10, GASLoC 50. A metrics row runs GASLoC's consensus all-reduce
(harness traffic, the model's size, over the exchange's connection): one on every round
kept TCP's window open for the next exchange, which the model, pricing the training
traffic alone, did not know (docs/network-model.md, Results)."""
AB_PHASES = int(os.environ.get("NETLAB_PHASES", "3"))
"""Compared windows each way (shaped, unshaped) per run; $NETLAB_PHASES sets it."""


def log_every(strategy: str) -> int:
    return LOG_EVERY.get(strategy, 10)


def steps_of(strategy: str) -> int:
    """Steps of a case's run: the warm-up window, then `AB_PHASES` phases each way."""
    return log_every(strategy) * (1 + 2 * AB_PHASES * PHASE_WINDOWS)


CONFIGS = {"ddp": "configs/ddp-tiny.yaml", "diloco": "configs/diloco-tiny.yaml",
           "gasloc": "configs/gasloc-tiny.yaml", "pipeline": "configs/pipeline-1f1b-tiny.yaml"}

ZERO_PROFILE = "intra: {latency_s: 0.0, bandwidth_Bps: 1.0e+14}\n" \
               "inter: {latency_s: 0.0, bandwidth_Bps: 1.0e+14}\n"


@dataclass(frozen=True)
class Case:
    strategy: str
    rates_mbit: tuple[float, ...]
    delays_ms: tuple[float, ...]

    @property
    def world(self) -> int:
        return len(self.rates_mbit)

    @property
    def setting(self) -> str:
        """The links, without the strategy: e.g. 2r-100mbit-10ms."""
        rates = "/".join(f"{r:g}" for r in sorted(set(self.rates_mbit), reverse=True))
        return f"{self.world}r-{rates}mbit-{self.delays_ms[0]:g}ms"

    @property
    def id(self) -> str:
        return f"{self.strategy}-{self.setting}"

    def profile_yaml(self) -> str:
        """The profile describing the shaped links (docs/network-model.md): alpha = delay +
        50 us, beta = rate x 1448/1514 / 8, TCP's initial window 10 x 1448 B (Linux), the
        tbf's queue as the buffer; a pair's link is its slower endpoint's."""
        def tier(i, j):
            rate = min(self.rates_mbit[i], self.rates_mbit[j]) * 1e6 * 1448 / 1514 / 8
            delay = max(self.delays_ms[i], self.delays_ms[j]) / 1e3 + 50e-6
            return (f"{{latency_s: {delay!r}, bandwidth_Bps: {rate!r}, "
                    f"tcp_initial_window: {LINUX_TCP_INITIAL_WINDOW_B}, "
                    f"tcp_queue: {QUEUE_S!r}}}")
        lines = ["intra: {latency_s: 5.0e-06, bandwidth_Bps: 1.0e+10}", f"inter: {tier(0, 1)}",
                 "links:"]
        lines += [f"  - {{nodes: [{i}, {j}], tier: {tier(i, j)}}}"
                  for i in range(self.world) for j in range(i + 1, self.world)]
        return "\n".join(lines) + "\n"


SETTINGS = [(r, d) for r in (1000, 100) for d in (1, 10)]
"""(Mbit/s, ms) of the 2 x 2 link settings; 1 Gbit/s + 1 ms is the first."""
CASES = [Case(s, (r,) * 2, (d,) * 2) for s in CONFIGS for r, d in SETTINGS]
"""2 ranks, one per core: every strategy (the pipeline in 2 stages) at every setting."""
CASES += [Case(s, (r,) * 4, (d,) * 4) for s in ("ddp", "diloco", "gasloc") for r, d in SETTINGS]
CASES.append(Case("diloco", (100, 100, 100, 20), (1,) * 4))  # one slow node
"""4 ranks, two per core (oversubscribed), one intra-op thread each."""


def load_note() -> str:
    """The machine's load as a table cell: 1-minute load average / cores."""
    return f"{os.getloadavg()[0]:.1f}/{os.cpu_count()}"


def launch(lab: Lab, module_args: list[str], log_dir: Path, port: int,
           timeout: float = 900, env: dict | None = None) -> None:
    """`python -m <module_args>` as rank i in namespace i, gloo on the lab interface."""
    log_dir.mkdir(parents=True, exist_ok=True)
    world = lab.n
    base = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lab0",
            "MASTER_ADDR": lab.addr(0), "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
            "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "HOME": os.environ.get("HOME", "/root"), **(env or {})}
    logs = [open(log_dir / f"rank{i}.log", "w") for i in range(world)]
    procs = [lab.popen(i, [sys.executable, "-m", *module_args], {**base, "RANK": str(i)},
                       stdout=logs[i], stderr=subprocess.STDOUT) for i in range(world)]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()
    if codes != [0] * world:
        raise RuntimeError(f"ranks exited with {codes}; rank 0's log:\n"
                           + (log_dir / "rank0.log").read_text()[-3000:])


@dataclass
class Phases:
    """An A/B run's figures, each summed over one phase's compared windows and divided by
    their steps (True: the shaped phase, False: the unshaped one)."""
    step_s: dict[bool, float]
    """Measured seconds per step (the run's step-synchronised clock)."""
    projected_step_s: dict[bool, dict[str, float]]
    """Per profile path: the run's own projected seconds per step."""
    steps: dict[bool, list[int]]
    """The compared steps (0-based, as the ledger numbers them)."""
    comm_rows: list[dict]
    """comm.jsonl: every rank's ledger aggregates over the whole run."""
    emulation_s: float = 0.0
    """CPU seconds the lab's link emulation took per step of the run, both phases
    (`Lab.emulation_cpu_s` over the whole launch / its steps): taken from the ranks'
    cores on this machine."""


def read_phases(run_dir: Path, every: int) -> Phases:
    """The A/B run's phases from its train rows (one every `every` steps): each compared
    window (`counted_window`) as the difference of its row and the row before."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in rows if "step_s" in r}
    sums = {p: {"elapsed": 0.0, "projected": {}, "steps": []} for p in (True, False)}
    for step, row in sorted(by_step.items()):
        window, rem = divmod(step, every)
        if rem or not counted_window(window):
            continue
        before = by_step.get(step - every)
        if before is None:
            raise ValueError(f"{run_dir}: no train row at step {step - every}, the start of "
                             f"window {window} (rows at {sorted(by_step)})")
        acc = sums[shaped_window(window)]
        acc["elapsed"] += row["elapsed_s"] - before["elapsed_s"]
        for k, v in row["projected_elapsed_s"].items():
            change = v - before["projected_elapsed_s"][k]
            acc["projected"][k] = acc["projected"].get(k, 0.0) + change
        acc["steps"] += range(step - every, step)
    for shaped, acc in sums.items():
        if not acc["steps"]:
            raise ValueError(f"{run_dir}: no compared {'shaped' if shaped else 'unshaped'} "
                             f"window in the train rows at {sorted(by_step)} (every {every})")
    comm = [json.loads(line) for line in (run_dir / "comm.jsonl").read_text().splitlines()]
    return Phases({p: a["elapsed"] / len(a["steps"]) for p, a in sums.items()},
                  {p: {k: v / len(a["steps"]) for k, v in a["projected"].items()}
                   for p, a in sums.items()},
                  {p: a["steps"] for p, a in sums.items()}, comm)


def train(lab: Lab, strategy: str, run_dir: Path, port: int, profiles: list[str]) -> Phases:
    """One A/B run on `lab` (built unshaped: `Lab(..., shaped=False)`), rank i in namespace
    i, projecting onto `profiles` (YAML paths); every rank's ledger records also go to
    RUN_DIR/trace-rank*.jsonl (tests/netlab/traced.py)."""
    from bench.config import load_config, to_yaml

    if lab.shaped:
        raise ValueError("an A/B run starts on the unshaped links: Lab(..., shaped=False)")
    sets = [f"run.steps={steps_of(strategy)}", "run.val_every=100000",
            f"run.log_every={log_every(strategy)}", f"parallel.world_size={lab.n}",
            *([f"strategy.inner_steps={INNER_STEPS[strategy]}"] if strategy in INNER_STEPS else []),
            "run.val_sequences=8", "checkpoint.every=0", "checkpoint.final=false",
            "network.model=gloo", f"network.profiles=[{','.join(profiles)}]",
            # the lab holds the model against wall steps on its own shared cores (and the
            # delayers' CPU): the compute beside them must be wall too (bench/run/meter.py)
            "run.compute_clock=wall"]
    cfg = load_config(ROOT / CONFIGS[strategy], sets)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    ab = run_dir / "ab.json"
    ab.write_text(json.dumps({"lab": lab.description(), "log_every": log_every(strategy),
                              "steps": steps_of(strategy)}))
    emulated = lab.emulation_cpu_s()
    launch(lab, ["tests.netlab.traced", str(run_dir)], run_dir / "logs", port,
           env={AB_ENV: str(ab)})
    emulated = lab.emulation_cpu_s() - emulated
    return replace(read_phases(run_dir, log_every(strategy)),
                   emulation_s=emulated / steps_of(strategy))


def netprobe_in_lab(lab: Lab, out: Path, port: int,
                    sizes: tuple[str, ...] = ("64KiB", "512KiB", "2MiB"),
                    step_compute_s: float = 0.02) -> Path:
    """Fit a profile on the lab's links with `commbench netprobe`'s worker, one rank per
    namespace (how a user runs it multi-node); `step_compute_s` about the tiny runs'
    compute per step (the exchange keeps netprobe's default gap, under the RTO)."""
    launch(lab, ["bench.node.netprobe", "--out", str(out), "--iters", "5", "--step-compute",
                 str(step_compute_s), "--sizes", *sizes], out.parent / f"{out.stem}-logs", port)
    return out


@dataclass
class Exchanges:
    """GASLoC's exchanges in one run, each timed on the rank that arrived last (its seconds
    hold no wait for the other) and priced by the model with the idle its connection had."""
    steady: tuple[float, float]
    """(measured, modelled) mean seconds of the exchanges on a connection used before."""
    cold: tuple[float, float] | None
    """The same for the exchanges on a connection never used before (TCP slow start from
    the initial window), None if none was traced."""
    count: int
    """How many exchanges `steady` averages."""


def exchange_per_op(run_dir: Path, world: int, profile,
                    steps: Collection[int] | None = None) -> Exchanges:
    """GASLoC's exchange, op by op, from the ranks' traces (tests/netlab/traced.py), at
    `steps` only (an A/B run's compared shaped steps; None: every step).

    Each exchange of a pair (one peer per exchange: the lab's random matching) is
    measured on the rank that arrived last: the smaller of the pair's two seconds, the
    other rank's holding its wait for it (which the projection charges apart, as a
    stretch). It is priced by `bench.network.model.pricer` for that rank, the connection
    idle from the end of that rank's last op on it (an exchange or send/receive with the
    peer; on a world of 2 also the world's collectives, which gloo carries over the same
    connection: GASLoC's consensus all-reduce) to the exchange's start; never used: cold.
    Measuring each rank's total instead mixed in the waits whenever the later rank
    changed from round to round (docs/network-model.md, Results)."""
    from algorithms.comm import CommRecord
    from bench.network.model import pricer
    from tests.netlab.traced import trace_path

    traces = [[json.loads(line) for line in trace_path(run_dir, r).read_text().splitlines()]
              for r in range(world)]
    steps = None if steps is None else set(steps)
    pairs: dict[tuple, dict[int, dict]] = {}
    for rank, records in enumerate(traces):
        for r in records:
            if (r["phase"] == "gossip" and r["op"] == "exchange"
                    and (steps is None or r["step"] in steps)):
                if len(r["peers"]) != 1:
                    raise ValueError(f"one peer per exchange, got {r['peers']} (rank {rank})")
                pairs.setdefault((r["step"], *sorted((rank, r["peers"][0]))), {})[rank] = r
    steady: list[tuple[float, float]] = []
    cold: list[tuple[float, float]] = []
    for key, sides in sorted(pairs.items()):
        if len(sides) != 2:
            raise ValueError(f"exchange at step {key[0]} of ranks {key[1:]} traced on "
                             f"{sorted(sides)} only")
        rank, last = min(sides.items(), key=lambda kv: kv[1]["seconds"])
        peer = last["peers"][0]
        start = last["end"] - last["seconds"]
        used = [r["end"] for r in traces[rank]
                if r["end"] <= start and _uses_connection(r, peer, world)]
        idle = start - max(used) if used else math.inf
        record = CommRecord(last["step"], "gossip", "exchange", 2, (peer,), last["nbytes"],
                            0.0, "inter")
        priced = pricer(profile, rank, 1, backend="gloo", idle=idle)(record)
        (cold if math.isinf(idle) else steady).append((last["seconds"], priced))
    if not steady:
        raise ValueError(f"{run_dir}: no exchange on a used connection in the traces"
                         + ("" if steps is None else f" at steps {min(steps)}-{max(steps)}"))

    def mean(rows):
        return (statistics.fmean(m for m, _ in rows), statistics.fmean(p for _, p in rows))
    return Exchanges(mean(steady), mean(cold) if cold else None, len(steady))


def _uses_connection(record: dict, peer: int, world: int) -> bool:
    """Whether a traced op went over the world group's TCP connection to `peer` (gloo: one
    per pair of ranks in a process group)."""
    if record["op"] in ("exchange", "send", "recv"):
        return peer in record["peers"]
    return record["peers"] is None and world == 2  # a world of 2: its only connection


def naive_comm_per_step(rows: list[dict], profile, steps: int, world: int) -> float:
    """The slowest rank's textbook-formula comm per step (no overlap) from comm.jsonl
    aggregates of the run's training traffic (every window, warm-up included: each window
    carries the same traffic, so `steps` is the run's). Every formula is affine in nbytes, so a
    row of `count` records costs `count` records of its mean size; p2p rows lost their
    peers in the aggregate and are priced to the rank's slowest peers (exact on
    homogeneous links)."""
    from algorithms.comm import CommRecord
    from bench.network import project
    from bench.run.meter import TRAIN_PHASES

    per_rank: dict[int, float] = {}
    for row in rows:
        if row["phase"] not in TRAIN_PHASES or not row["count"]:
            continue
        rank, n = row["rank"], row["group_size"]
        peers = None
        if row["op"] in ("send", "recv", "exchange"):
            others = sorted((p for p in range(world) if p != rank),
                            key=lambda p: profile.link(rank, p).bandwidth_Bps)
            peers = tuple(others[:max(1, n - 1)])
        rec = CommRecord(0, row["phase"], row["op"], n, peers, row["bytes"] / row["count"],
                         0.0, row["tier"])
        per_rank[rank] = per_rank.get(rank, 0.0) + row["count"] * project([rec], profile, rank)
    return max(per_rank.values()) / steps


def summarize(values: list[float]) -> str:
    """median (min-max) of replicates."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"
