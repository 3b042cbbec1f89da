"""The network model against shaped links: 4 ranks in 4 namespaces, tbf + receive delay.

    tox -e netlab          (root; tools/netlab/setup.sh installs iptables, gcc, libnfq)
    NETLAB_OUT=netlab.md pytest -m netlab tests/netlab -s

For each case a tiny DDP / DiLoCo / GASLoC run trains with one rank per namespace, gloo
bound to the lab interface, and the measured step time and per-op communication are
compared (mean step_s / comm_s of the metric windows after the first, over ranks)
with the projection for a profile describing the shaped links (written as a
YAML file and loaded by path): compute from an unshaped run of the same config plus
- naive: the textbook alpha-beta formulas (backend None), no overlap;
- aware: gloo's formulas (2 alpha per ring step), overlap-aware where records carry lead_s.
alpha = delay + 50 us, beta = rate x 1448/1514 / 8 (docs/network-model.md). Rows go to
$NETLAB_OUT (markdown) as they finish. Single runs on a shared 2-core machine are noisy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.network import get_profile, project
from tests.netlab.lab import ROOT, Lab, build_delayer, missing_requirements

pytestmark = [pytest.mark.netlab, pytest.mark.timeout(1800)]
WORLD = 4
STEPS = int(os.environ.get("NETLAB_STEPS", "30"))
TRAIN_PHASES = ("train", "inner", "outer", "gossip")
CONFIGS = {"ddp": "configs/ddp-tiny.yaml", "diloco": "configs/diloco-tiny.yaml",
           "gasloc": "configs/gasloc-tiny.yaml"}
# (strategy, rates Mbit/s per rank, one-way delays ms per rank)
CASES = [(s, [r] * WORLD, [d] * WORLD) for s in CONFIGS for r in (1000, 100) for d in (1, 10)]
CASES.append(("diloco", [100, 100, 100, 20], [1] * WORLD))  # one slow node


@pytest.fixture(scope="module")
def delayer(tmp_path_factory):
    why = missing_requirements()
    if why:
        pytest.skip(f"netlab {why}")
    return build_delayer(tmp_path_factory.mktemp("netlab"))


def train_in_lab(lab: Lab, strategy: str, run_dir: Path, port: int) -> dict:
    """One run, rank i in namespace i; returns summary.json plus the comm.jsonl rows."""
    from bench.config import load_config, to_yaml

    cfg = load_config(ROOT / CONFIGS[strategy], [f"run.steps={STEPS}", "run.val_every=1000",
                                                 "run.log_every=10", "run.val_batches=1"])
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    base = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lab0",
            "MASTER_ADDR": lab.addr(0), "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD),
            "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "HOME": os.environ.get("HOME", "/root")}
    procs = [lab.popen(i, [sys.executable, "-m", "bench.train", str(run_dir)],
                       {**base, "RANK": str(i)}, stdout=subprocess.DEVNULL,
                       stderr=open(run_dir / "logs" / f"rank{i}.log", "w"))
             for i in range(WORLD)]
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * WORLD, (run_dir / "logs" / "rank0.log").read_text()[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "comm.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [m for m in metrics if "step_s" in m]
    later = windows[1:] or windows  # the first window pays connection set-up and warm-up
    mean = {k: sum(w[k] for w in later) / len(later) for k in ("step_s", "compute_s", "comm_s")}
    return {**summary, "rows": rows, "window": mean}


def profile_yaml(rates, delays, path: Path) -> str:
    """The profile describing the shaped links; a pair's link is the slower endpoint's."""
    def tier(i, j):
        rate = min(rates[i], rates[j]) * 1e6 * 1448 / 1514 / 8
        return f"{{latency_s: {max(delays[i], delays[j]) / 1e3 + 50e-6}, bandwidth_Bps: {rate}}}"
    lines = ["intra: {latency_s: 5.0e-06, bandwidth_Bps: 1.0e+10}", f"inter: {tier(0, 1)}",
             "links:"]
    lines += [f"  - {{nodes: [{i}, {j}], tier: {tier(i, j)}}}"
              for i in range(WORLD) for j in range(i + 1, WORLD)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def projected_comm_per_step(rows, profile, backend, overlap) -> float:
    """The slowest rank's modelled train-phase comm per step, from comm.jsonl aggregates.

    Every formula is affine in nbytes, so a row of `count` records costs `count` records of
    its mean size. p2p rows lose their peers in the aggregate: they are priced to the
    rank's slowest peer (exact on homogeneous links).
    """
    from algorithms.comm import CommRecord

    per_rank: dict[int, float] = {}
    for row in rows:
        if row["phase"] not in TRAIN_PHASES or not row["count"]:
            continue
        rank, n = row["rank"], row["group_size"]
        peers = None
        if row["op"] in ("send", "recv", "exchange"):
            others = [p for p in range(WORLD) if p != rank]
            peers = tuple(sorted(others, key=lambda p: profile.link(rank, p).bandwidth_Bps)
                          [:n - 1])
        rec = CommRecord(0, row["phase"], row["op"], n, peers, row["bytes"] / row["count"],
                         0.0, row["tier"])
        cost = project([rec], profile, rank, 1, backend=backend, overlap=overlap)
        per_rank[rank] = per_rank.get(rank, 0.0) + row["count"] * cost
    return max(per_rank.values()) / STEPS


RESULTS: dict[str, dict] = {}


def _report(line: str) -> None:
    out = os.environ.get("NETLAB_OUT")
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
    print(line)


@pytest.mark.parametrize("strategy, rates, delays", CASES,
                         ids=[f"{s}-{'/'.join(map(str, sorted(set(r))))}mbit-{d[0]}ms"
                              for s, r, d in CASES])
def test_projection_on_shaped_links(delayer, tmp_path, strategy, rates, delays):
    if strategy not in RESULTS:  # the unshaped baseline: compute per step
        with Lab([0] * WORLD, [0] * WORLD, delayer) as lab:
            RESULTS[strategy] = train_in_lab(lab, strategy, tmp_path / "unshaped", 29510)
    base = RESULTS[strategy]
    compute = base["window"]["compute_s"]
    with Lab(rates, delays, delayer) as lab:
        run = train_in_lab(lab, strategy, tmp_path / "shaped", 29520)
    profile = get_profile(profile_yaml(rates, delays, tmp_path / "lab.yaml"))
    measured_step, measured_comm = run["window"]["step_s"], run["window"]["comm_s"]
    naive = projected_comm_per_step(run["rows"], profile, None, False)
    aware = projected_comm_per_step(run["rows"], profile, "gloo", True)
    err = {k: (compute + c - measured_step) / measured_step for k, c in
           (("naive", naive), ("aware", aware))}
    _report(f"| {strategy} | {'/'.join(map(str, rates))} | {delays[0]} | {measured_step:.3f} | "
            f"{compute + naive:.3f} ({err['naive']:+.0%}) | {compute + aware:.3f} "
            f"({err['aware']:+.0%}) | {measured_comm:.3f} | {naive:.3f} | {aware:.3f} |")
    assert abs(err["aware"]) <= 0.10, err
