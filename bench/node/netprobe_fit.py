"""`commbench netprobe`'s fit: a network profile fitted to the measured rows, and its YAML.

    pytest tests/test_netprobe.py   (the fit recovers known alpha and beta)

Rank 0 fits the rows bench/node/netprobe_measure.py measured, per tier, by least squares on
relative errors with the SAME formulas the projection uses for `--backend`
(bench/network/costs.py):
- alpha and beta on the barrier-synchronised ops: linear least squares on (alpha, 1/beta),
  refined on the formulas themselves where they are not linear in them (gloo's
  segment-level all_reduce);
- the exchange is measured, not fitted: its time against the projection's formula at
  each size is the tier's `exchange_scale` ([bytes, ratio] pairs), which the projection
  multiplies gossip's exchanges by (interpolated between the sizes). On TCP links whose
  round trip is short and whose messages span several windows it is above 1: the
  congestion window stays below the bandwidth-delay product (1.2-2 at 1 Gbit/s + 1 ms
  in the shaped-link lab, docs/network-model.md), which the alpha-beta formula lacks;
- the drift: the latency every message of a step's op pays on top of alpha because the
  ranks come to it from compute (their communication threads wake, slower ranks are
  waited for) on the in-step points. The profile's latency is alpha + drift: what runs
  see; alpha and the drift are kept under `fit:`.
The fit's residuals are printed and stored under each tier's `fit:` in the YAML, which
`get_profile(path)` loads.
With one rank per node (the default locally) only `inter` is measured and `intra` is a copy.
With gloo the tiers also get TCP's initial window, the measured round trip (`tcp_rtt`) and
standing queue (`tcp_queue`): the ramp after an idle (bench/network/costs.py
`slow_start_extra_s`) runs on them, not on the fitted alpha, which holds the backend's
per-message cost as well (1.2-1.6 ms against a 1.05 ms one-way link at 1 Gbit/s + 1 ms
in the shaped-link lab, docs/network-model.md).
numpy and scipy are imported inside the fitting functions.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

import yaml

from bench.network import costs
from bench.network.profiles import LINUX_TCP_INITIAL_WINDOW_B, Tier, parse_tier
from bench.node.netprobe_measure import EXCHANGE, IN_STEP, OPS, QUEUE, ROUND_TRIP, SYNCED_OPS


def model_s(op: str, n: int, nbytes: float, tier: Tier, algorithm: str) -> float:
    """The projection's seconds for one measured point (p2p: one message; the exchange on
    a warm connection: a gossip round is shorter than TCP's idle restart)."""
    if op == "p2p":
        return costs.p2p_s(nbytes, tier, algorithm)
    if op == EXCHANGE:
        return costs.exchange_s([nbytes], tier, algorithm)
    return costs.COLLECTIVES["all_reduce" if op == IN_STEP else op](n, nbytes, tier, algorithm)


def coefficients(op: str, n: int, nbytes: float, algorithm: str) -> tuple[float, float]:
    """(k_a, k_b): the formula's seconds for `nbytes` at (alpha = 1, beta = inf) and, per
    byte, at (alpha = 0, beta = 1). For a formula k_a * alpha + k_b * S / beta these are
    exact; for gloo's all_reduce (a max-plus recurrence) they are its two limits (its
    latencies depend on the size: a one-element buffer skips empty segments)."""
    k_a = model_s(op, n, nbytes, Tier(1.0, 1e300), algorithm)
    k_b = model_s(op, n, nbytes, Tier(0.0, 1.0), algorithm) / nbytes if nbytes else 0.0
    return k_a, k_b


def _residuals(rows: list[dict], tier: Tier, algorithm: str) -> list[dict]:
    out = []
    for r in rows:
        m = model_s(r["op"], r["n"], r["nbytes"], tier, algorithm)
        out.append(dict(op=r["op"], n=r["n"], nbytes=int(r["nbytes"]),
                        measured_s=float(r["seconds"]), model_s=float(m),
                        rel_residual=float((r["seconds"] - m) / r["seconds"])))
    return out


def _fit_alpha_beta(rows: list[dict], algorithm: str) -> Tier:
    """alpha, beta minimising the relative squared error of the synchronised ops' points:
    linear least squares on (alpha, 1/beta) with `coefficients`, then (formulas that are
    not linear in them: gloo's all_reduce) refined by bounded least squares on the model
    itself, from there."""
    import numpy as np
    from scipy.optimize import least_squares

    a = np.array([coefficients(r["op"], r["n"], r["nbytes"], algorithm) for r in rows])
    design = np.stack([a[:, 0], a[:, 1] * [r["nbytes"] for r in rows]], axis=1)
    t = np.array([r["seconds"] for r in rows])
    weighted = design / t[:, None]
    ones = np.ones_like(t)
    (alpha, inv_beta), *_ = np.linalg.lstsq(weighted, ones, rcond=None)
    if alpha < 0 or inv_beta <= 0:
        # Non-negative least squares over 2 unknowns: the optimum lies on a boundary. beta
        # must stay finite, so the boundary is alpha = 0 (latency below the noise).
        alpha = 0.0
        inv_beta = float(np.linalg.lstsq(weighted[:, 1:], ones, rcond=None)[0][0])
    if not inv_beta > 0:
        raise ValueError(f"netprobe could not fit a positive bandwidth (1/beta = {inv_beta:.3g}); "
                         "use larger --sizes so that transfer time dominates")

    def model(x):
        tier = Tier(float(x[0]), 1.0 / float(x[1]))
        return np.array([model_s(r["op"], r["n"], r["nbytes"], tier, algorithm) for r in rows])

    scale = np.array([max(alpha, 1e-3 * float(np.min(t))), inv_beta])
    refined = least_squares(lambda x: (t - model(x * scale)) / t, [alpha / scale[0], 1.0],
                            bounds=([0.0, 1e-9], [np.inf, np.inf]), diff_step=1e-4)
    alpha, inv_beta = (float(v) for v in refined.x * scale)
    return Tier(alpha, 1.0 / inv_beta)


def _fit_drift(rows: list[dict], base: Tier, algorithm: str) -> float:
    """The drift d >= 0 minimising the relative squared error of the in-step points priced
    at latency alpha + d (bounded least squares, as `_fit_alpha_beta` refines)."""
    import numpy as np
    from scipy.optimize import least_squares

    t = np.array([r["seconds"] for r in rows])

    def rel(x):
        tier = dataclasses.replace(base, latency_s=base.latency_s + float(x[0]))
        return (t - np.array([model_s(r["op"], r["n"], r["nbytes"], tier, algorithm)
                              for r in rows])) / t

    scale = max(base.latency_s, 1e-6)  # the step least_squares takes is relative to this
    fit = least_squares(lambda x: rel(x * scale), [0.1], bounds=([0.0], [np.inf]),
                        diff_step=1e-3)
    return float(fit.x[0] * scale)


def exchange_scale(rows: list[dict], tier: Tier, algorithm: str
                   ) -> tuple[tuple[float, float], ...]:
    """The measured exchange against the projection's, per size: ((bytes, ratio), ...).

    The ratio is (measured - TCP's ramp after the probe's idle) / the warm formula on
    `tier` (alpha + drift, as the projection prices it), so that the projection, which
    scales the warm formula by it and adds the ramp of its own idle, gives back what was
    measured. TCP's congestion window is what the formula lacks: on short round trips it
    stays below the bandwidth-delay product (docs/network-model.md)."""
    plain = dataclasses.replace(tier, exchange_scale=())
    by_size: dict[int, list[float]] = {}
    for r in rows:
        ramp = costs.slow_start_extra_s(r["nbytes"], tier, r.get("idle_s", 0.0))
        warm = model_s(EXCHANGE, r["n"], r["nbytes"], plain, algorithm)
        by_size.setdefault(int(r["nbytes"]), []).append(max(r["seconds"] - ramp, 1e-9) / warm)
    return tuple((float(s), statistics.median(v)) for s, v in sorted(by_size.items()))


def fit_tier(rows: list[dict], algorithm: str, tcp_window: float | None = None
             ) -> tuple[Tier, dict]:
    """A tier fitted to one tier's measured points (`probe`'s rows) and its fit record.

    alpha, beta from the synchronised ops (`_fit_alpha_beta`); the drift from the in-step
    points; the exchange's measured ratio to its formula (`exchange_scale`). The tier's
    latency is alpha + drift (what an op inside a step sees)."""
    if algorithm == "nccl":
        algorithm = "nccl-ring"  # the fit needs one formula, not the cheaper of two
    synced = [r for r in rows if r["op"] in SYNCED_OPS]
    if not synced:
        raise ValueError("netprobe has no synchronised points to fit alpha and beta to")
    base = _fit_alpha_beta(synced, algorithm)
    base = dataclasses.replace(base, tcp_initial_window_B=tcp_window)
    if tcp_window is not None:  # the link under TCP's slow start, as measured (gloo)
        link = {r["op"]: r["seconds"] for r in rows if r["op"] in (ROUND_TRIP, QUEUE)}
        base = dataclasses.replace(base, tcp_rtt_s=link.get(ROUND_TRIP),
                                   tcp_queue_s=link.get(QUEUE, 0.0))
    in_step = [r for r in rows if r["op"] == IN_STEP]
    drift = _fit_drift(in_step, base, algorithm) if in_step else 0.0
    tier = dataclasses.replace(base, latency_s=base.latency_s + drift)
    exchanges = [r for r in rows if r["op"] == EXCHANGE]
    tier = dataclasses.replace(tier, exchange_scale=exchange_scale(exchanges, tier, algorithm))
    residuals = (_residuals(synced + exchanges, base, algorithm)
                 + _residuals(in_step, tier, algorithm))
    rel = [r["rel_residual"] for r in residuals if r["op"] != EXCHANGE]  # the fitted points
    fit = dict(points=sum(r["op"] in OPS for r in rows), algorithm=algorithm,
               link_latency_s=base.latency_s,
               drift_s=drift,
               rms_rel_residual=math.sqrt(sum(e * e for e in rel) / len(rel)),
               max_abs_rel_residual=max(abs(e) for e in rel), residuals=residuals)
    return tier, fit


def fit_profile(rows: list[dict], backend: str, name: str, description: str) -> dict:
    """The profile YAML document (tiers + profiles) for `rows` measured by `probe`."""
    costs.check_algorithm(backend)
    # gloo runs over TCP: slow start on idle connections (the probe itself times warm
    # ones, after a warm-up round)
    window = LINUX_TCP_INITIAL_WINDOW_B if backend == "gloo" else None
    tiers, fits = {}, {}
    for tier in ("intra", "inter"):
        mine = [r for r in rows if r["tier"] == tier]
        if mine:
            tiers[tier], fits[tier] = fit_tier(mine, backend, window)
    if not tiers:
        raise ValueError("netprobe measured nothing: it needs at least 2 ranks")
    doc_tiers = {}
    for tier in ("intra", "inter"):
        source = tier if tier in tiers else next(iter(tiers))
        t = tiers[source]
        doc_tiers[f"{name}-{tier}"] = dict(
            latency_s=t.latency_s, bandwidth_Bps=t.bandwidth_Bps,
            **({"tcp_initial_window": t.tcp_initial_window_B} if window else {}),
            **({"tcp_rtt": t.tcp_rtt_s} if t.tcp_rtt_s is not None else {}),
            **({"tcp_queue": t.tcp_queue_s} if window and t.tcp_rtt_s is not None else {}),
            **({"exchange_scale": [[int(b), round(r, 4)] for b, r in t.exchange_scale]}
               if t.exchange_scale else {}),
            fit=fits[source] if source == tier else f"not measured: copy of {source}")
    profile = dict(description=description, intra=f"{name}-intra", inter=f"{name}-inter")
    return dict(tiers=doc_tiers, profiles={name: profile})


def format_fit(doc: dict) -> str:
    """A human-readable table of the fitted tiers and their residuals."""
    lines = []
    for tname, spec in doc["tiers"].items():
        fit = spec["fit"]
        head = (f"{tname}: latency = {spec['latency_s'] * 1e6:.1f} us, beta = "
                f"{spec['bandwidth_Bps'] / 1e6:.1f} MB/s")
        if isinstance(fit, str):
            lines.append(f"{head} ({fit})")
            continue
        exchange = ("; exchange x " + ", x ".join(f"{r:.2f} at {b} B" for b, r in
                                                  spec["exchange_scale"])
                    if spec.get("exchange_scale") else "")
        tcp = (f"; TCP round trip {spec['tcp_rtt'] * 1e3:.2f} ms, standing queue "
               f"{spec.get('tcp_queue', 0) * 1e3:.2f} ms" if "tcp_rtt" in spec else "")
        lines.append(f"{head} (alpha {fit['link_latency_s'] * 1e6:.1f} us + drift "
                     f"{fit['drift_s'] * 1e6:.1f} us{exchange}{tcp}); {fit['algorithm']} formulas, "
                     f"{fit['points']} points, rms relative residual "
                     f"{fit['rms_rel_residual']:.1%}")
        for r in fit["residuals"]:
            lines.append(f"    {r['op']:<11} n={r['n']} {r['nbytes']:>10} B  measured "
                         f"{r['measured_s'] * 1e3:9.3f} ms  model {r['model_s'] * 1e3:9.3f} ms  "
                         f"{r['rel_residual']:+.1%}")
    return "\n".join(lines)


def write_profile(doc: dict, out: Path) -> None:
    for spec in doc["tiers"].values():  # what get_profile will read back must parse
        parse_tier({k: v for k, v in spec.items()}, str(out), {})
    out.parent.mkdir(parents=True, exist_ok=True)
    header = "# network profile written by `commbench netprobe` (docs/network-model.md)\n"
    out.write_text(header + yaml.safe_dump(doc, sort_keys=False))

