"""The network model against shaped links: a rank per namespace, tbf + receive delay.

    tox -e netlab          (root; tools/netlab/setup.sh installs iptables, gcc, libnfq)
    NETLAB_REPS=3 NETLAB_OUT=netlab.md NETLAB_DIR=netlab-runs pytest -m netlab tests/netlab -s
    NETLAB_RANKS=2 ...                     (only the 2-rank cases: one rank per core)
    NETLAB_STRATEGIES=diloco,gasloc ...   (only those strategies' cases)
    NETLAB_CC=bbr ...                      (TCP congestion control in the namespaces; cubic)
    NETLAB_DELAYER_RT=0 ...                (the delayers' real-time priority; 50, 0: default policy)
    NETLAB_PHASES=3 ...                    (compared windows each way per run)

tests/netlab/experiment.py says what is compared: each case is one run switched between
unshaped and shaped links inside it (the in-run A/B, tests/netlab/traced.py), the compute
measured on the first, the step on the second. Replicates are interleaved (every case
once, then every case again) so that slow drift of the machine lands on every case alike;
the assertion is on the MEDIAN over replicates of the step-time error of the aware model
(gloo formulas, overlap-aware: what reports show). GASLoC's exchange is also compared op by
op, on the textbook profile and on netprobe's (which carries the exchange as it measured
it). netprobe fits a profile on the shaped links themselves (2 ranks: at every setting;
4 ranks: two settings) and the unshaped windows project onto it too (the calibration
loop): every step time within 20%, and DDP's communication per step on the shaped
windows' own compute within 20%. Every row carries the load the machine ran under. Rows
go to $NETLAB_OUT (markdown), run directories to $NETLAB_DIR (default: pytest's tmp dir).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import pytest

from bench.network import get_profile
from tests.netlab.experiment import (
    CASES,
    ZERO_PROFILE,
    Case,
    exchange_per_op,
    load_note,
    naive_comm_per_step,
    netprobe_in_lab,
    steps_of,
    summarize,
    train,
)
from tests.netlab.lab import Lab, build_delayer, missing_requirements

pytestmark = [pytest.mark.netlab, pytest.mark.timeout(10800)]
REPS = int(os.environ.get("NETLAB_REPS", "3"))
ONLY = [s for s in os.environ.get("NETLAB_STRATEGIES", "").split(",") if s]
"""Run only these strategies' cases (default: all)."""
WORLDS = [int(w) for w in os.environ.get("NETLAB_RANKS", "2,4").split(",") if w]
"""Run only these world sizes' cases (default: 2 and 4)."""
CC = os.environ.get("NETLAB_CC", "cubic")
"""TCP congestion control of every rank's namespace (tests/netlab/lab.py)."""
SELECTED = [c for c in CASES if (not ONLY or c.strategy in ONLY) and c.world in WORLDS]
PROBED = [c for c in CASES if c.strategy == "ddp" and c.world == 2]
PROBED += [Case("ddp", (100,) * 4, (10,) * 4), Case("ddp", (1000,) * 4, (1,) * 4)]
"""The settings netprobe is fitted on: every 2-rank one, two of the 4-rank ones."""


def _report(line: str) -> None:
    out = os.environ.get("NETLAB_OUT")
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
    print(line, flush=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every selected case REPS times: {case id: [per-replicate dict]}; netprobe:
    {"netprobe:" case id: [...]}; GASLoC's exchange per op: {"exchange:" case id: [...]}."""
    why = missing_requirements()
    if why:
        pytest.skip(f"netlab {why}")
    root = Path(os.environ.get("NETLAB_DIR") or tmp_path_factory.mktemp("netlab"))
    delayer = build_delayer(tmp_path_factory.mktemp("delayer"))
    zero = root / "zero.yaml"
    root.mkdir(parents=True, exist_ok=True)
    zero.write_text(ZERO_PROFILE)
    out: dict[str, list[dict]] = {}
    port = 29600
    _report("| case | rep | load | measured step s | naive step s (err) | aware step s (err) "
            "| measured comm s | naive comm s | aware comm s |\n"
            "|---|---|---|---|---|---|---|---|---|")
    for rep in range(REPS):
        for world in WORLDS:
            mine = [c for c in SELECTED if c.world == world]
            probes = {}  # setting -> netprobe profile path, fitted this replicate
            for c in (p for p in PROBED if p.world == world and mine):
                port += 1
                path = root / f"rep{rep}" / f"netprobe-{c.setting}.yaml"
                path.parent.mkdir(parents=True, exist_ok=True)
                with Lab(list(c.rates_mbit), list(c.delays_ms), delayer, CC) as lab:
                    probes[c.setting] = netprobe_in_lab(lab, path, port,
                                                             step_compute_s=0.01 * world)
            for strategy in dict.fromkeys(c.strategy for c in mine):
                port = _strategy(root / f"rep{rep}" / f"{world}r" / strategy, rep, world,
                                 [c for c in mine if c.strategy == strategy], probes,
                                 delayer, zero, port, out)
    _report("")
    _report("| case | measured step s | naive step s | aware step s | median err naive "
            "| median err aware |\n|---|---|---|---|---|---|")
    for cid, rows in out.items():
        if ":" in cid:
            continue
        med = {k: _median_error(rows, k) for k in ("naive", "aware")}
        _report(f"| {cid} | {summarize([r['measured'] for r in rows])} | "
                f"{summarize([r['naive'] for r in rows])} | "
                f"{summarize([r['aware'] for r in rows])} | {med['naive']:+.1%} | "
                f"{med['aware']:+.1%} |")
    for cid, rows in out.items():
        if ":" in cid:
            _report(f"| {cid} | measured {summarize([r['measured'] for r in rows])} | "
                    f"projected {summarize([r['projected'] for r in rows])} | | "
                    f"median err {_median_error(rows, 'projected'):+.1%} | |")
    return out


def _strategy(rdir: Path, rep: int, world: int, cases: list[Case], probes: dict[str, Path],
              delayer: Path, zero: Path, port: int, out: dict) -> int:
    """One strategy's cases, each one A/B run (tests/netlab/traced.py) projecting onto
    compute only, the case's profile and its setting's netprobe profile; rows into `out`."""
    for c in cases:
        path = rdir / f"{c.id}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(c.profile_yaml())
        probe = probes.get(c.setting)
        port += 1
        with Lab(list(c.rates_mbit), list(c.delays_ms), delayer, CC, shaped=False) as lab:
            run = train(lab, c.strategy, rdir / c.id, port,
                        [str(zero), str(path), *([str(probe)] if probe else [])])
        load = load_note()
        profile = get_profile(str(path))
        fast, slow = run.projected_step_s[False], run.projected_step_s[True]
        compute, measured = fast[str(zero)], run.step_s[True]
        aware = fast[str(path)]
        naive = compute + naive_comm_per_step(run.comm_rows, profile, steps_of(c.strategy),
                                              world)
        row = dict(measured=measured, compute=compute, aware=aware, naive=naive, load=load)
        out.setdefault(c.id, []).append(row)
        err = {k: (row[k] - measured) / measured for k in ("naive", "aware")}
        _report(f"| {c.id} | {rep} | {load} | {measured:.3f} | {naive:.3f} "
                f"({err['naive']:+.0%}) | {aware:.3f} ({err['aware']:+.0%}) | "
                f"{measured - compute:.3f} | {naive - compute:.3f} | {aware - compute:.3f} |")
        # The same model on the shaped windows' own compute: the projection's premise (the
        # compute a fast network measured is the compute on the slow one) fails here by
        # what emulating the links costs the ranks' 2 cores, measured beside it.
        own_compute = slow[str(zero)]
        own = dict(measured=measured, projected=slow[str(path)])
        out.setdefault(f"own-compute:{c.id}", []).append(own)
        _report(f"| own-compute:{c.id} | {rep} | {load} | measured {measured:.3f} | "
                f"aware {own['projected']:.3f} "
                f"({(own['projected'] - measured) / measured:+.0%}) | compute "
                f"{own_compute:.4f} against unshaped {compute:.4f} "
                f"({own_compute / compute - 1:+.0%}) | emulation CPU "
                f"{run.emulation_s * 1e3:.1f} ms/step (both phases) | | |")
        if c.strategy == "gasloc":  # the exchange, op by op, in the compared shaped steps
            priced_by = [("exchange", "model", profile)]
            if probe is not None:
                priced_by.append(("exchange-netprobe", "netprobe", get_profile(str(probe))))
            for tag, name, prof in priced_by:
                ex = exchange_per_op(rdir / c.id, world, prof, steps=run.steps[True])
                got, modelled = ex.steady
                out.setdefault(f"{tag}:{c.id}", []).append(dict(measured=got, projected=modelled))
                _report(f"| {tag}:{c.id} | {rep} | {load} | measured {got * 1e3:.1f} ms "
                        f"| {name} {modelled * 1e3:.1f} ms ({(modelled - got) / got:+.0%})"
                        f" | {ex.count} exchanges on a used connection | | | |")
        if probe is not None:
            fitted = fast[str(probe)]
            comm = measured - compute
            out.setdefault(f"netprobe:{c.id}", []).append(
                dict(measured=comm, projected=fitted - compute, step=measured,
                     projected_step=fitted))
            _report(f"| netprobe:{c.id} | {rep} | {load} | measured comm {comm:.3f} "
                    f"| projected comm {fitted - compute:.3f}; step "
                    f"{(fitted - measured) / measured:+.0%} | | | | |")
        if probe is not None and c.strategy == "ddp":
            # netprobe's pricing of DDP's communication on the shaped windows' own compute,
            # not on the difference of two phases' compute (asserted below).
            own_comm = measured - own_compute
            own_fitted = slow[str(probe)] - own_compute
            out.setdefault(f"netprobe-own-compute:{c.id}", []).append(
                dict(measured=own_comm, projected=own_fitted))
            _report(f"| netprobe-own-compute:{c.id} | {rep} | {load} | measured comm "
                    f"{own_comm:.3f} | projected comm {own_fitted:.3f} "
                    f"({(own_fitted - own_comm) / own_comm:+.0%}) | | | | |")
    return port


def _median_error(rows: list[dict], key: str) -> float:
    return statistics.median((r[key] - r["measured"]) / r["measured"] for r in rows)


@pytest.mark.parametrize("case", SELECTED, ids=[c.id for c in SELECTED])
def test_step_time_projection_on_shaped_links(results, case):
    """The aware model's projected step time is within 10% of the shaped run's (median)."""
    err = _median_error(results[case.id], "aware")
    assert abs(err) <= 0.10, (case.id, err, results[case.id])


EXCHANGES = [c for c in SELECTED if c.strategy == "gasloc"]


WINDOW_LIMITED = {"4r-1000mbit-1ms"}
"""Settings where GASLoC's exchange (499 kB, about twice the bandwidth-delay product) ran
slower than the textbook formula, which the model puts down to TCP's window staying below
the BDP (docs/network-model.md, "TCP's window on short round trips"); netprobe's measured
exchange is what prices it there. 2 ranks at 1 Gbit/s + 1 ms left this set when the
lab's delayers ran real-time: within 10% in runs o, p and r (+1.4%, -3.1%, -8.0%; before,
-24% to -34%, the delayers waiting for a core)."""


SHARED_CORES = "ranks share cores: each exchange's wall seconds hold a peer's wait for one"
"""Why GASLoC's exchange op by op is reported, not asserted, when the lab runs more ranks
than cores (4 ranks on 2): an exchange ends when the later of its two ranks arrives and
its data are through, and with ranks descheduled in turn the wait for the later one
lands in the exchange's seconds (+14.6% against netprobe's profile at 100 Mbit/s + 10 ms,
+36% against the formula at 1 Gbit/s + 10 ms for one replicate in a quiet 3-replicate
run; every 2-rank case held). What a 4-rank case on 2 cores validates, and asserts: the
step time, projected and on the run's own wall compute (the link's cost per step, which
a peer's lateness does not move, being the same for every step); the exchanges are in
the rows ($NETLAB_OUT) for reading."""


def _exchange_marks(case: Case) -> list:
    if case.world > (os.cpu_count() or 1):
        return [pytest.mark.xfail(reason=SHARED_CORES, strict=False)]
    if case.setting in WINDOW_LIMITED:
        return [pytest.mark.xfail(reason="TCP's window below the BDP: docs/network-model.md",
                                  strict=False)]
    return []


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=_exchange_marks(c))
                                  for c in EXCHANGES])
def test_gasloc_exchange_per_op(results, case):
    """GASLoC's exchange, op by op, is within 10% of the textbook profile's price (median)
    where the window covers the path."""
    rows = results[f"exchange:{case.id}"]
    err = _median_error(rows, "projected")
    assert abs(err) <= 0.10, (case.id, err, rows)


@pytest.mark.parametrize("case", SELECTED, ids=[c.id for c in SELECTED])
def test_step_time_on_the_runs_own_compute(results, case):
    """The aware model, given the shaped windows' own compute (their projection onto their
    link), is within 10% of its measured step (median): the network model apart from the
    CPU that emulating the links takes from the ranks (reported beside it)."""
    rows = results[f"own-compute:{case.id}"]
    err = _median_error(rows, "projected")
    assert abs(err) <= 0.10, (case.id, err, rows)


MEASURED_EXCHANGES = [c for c in EXCHANGES if any(p.setting == c.setting for p in PROBED)]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[
    pytest.mark.xfail(reason=SHARED_CORES, strict=False)] if c.world > (os.cpu_count() or 1)
    else []) for c in MEASURED_EXCHANGES])
def test_gasloc_exchange_per_op_with_netprobes_measurement(results, case):
    """GASLoC's exchange, op by op, is within 10% of the price of a profile netprobe fitted
    on the same links (its measured exchange, `Tier.exchange_scale`), at every setting."""
    rows = results[f"exchange-netprobe:{case.id}"]
    err = _median_error(rows, "projected")
    assert abs(err) <= 0.10, (case.id, err, rows)


NETPROBED = [c for c in SELECTED if any(p.setting == c.setting for p in PROBED)]


@pytest.mark.parametrize("case", NETPROBED, ids=[c.id for c in NETPROBED])
def test_netprobe_profile_predicts_the_run(results, case):
    """A profile netprobe fitted on the shaped links predicts the run: every strategy's
    step time, projected from the unshaped windows, within 20% (median); DDP's
    communication per step within 20%, measured and priced on the shaped windows
    themselves (their step minus their own compute). The communication as the shaped step
    minus the UNSHAPED windows' compute (the `netprobe:` rows' comm, reported) holds the
    two phases' compute difference, which at 1 ms is as large as the communication (run p,
    two runs at 1 Gbit/s + 1 ms: 0-7 ms measured that way against 10-11 priced;
    docs/network-model.md, Results)."""
    rows = results[f"netprobe:{case.id}"]
    err = statistics.median((r["projected_step"] - r["step"]) / r["step"] for r in rows)
    assert abs(err) <= 0.20, (case.id, err, rows)
    if case.strategy == "ddp":
        own = results[f"netprobe-own-compute:{case.id}"]
        err = _median_error(own, "projected")
        assert abs(err) <= 0.20, (case.id, err, own)
