"""`commbench doctor`'s overlap check: does DDP's first gradient bucket overlap the backward?

    python -m torch.distributed.run ... -m bench.node.doctor_overlap OUT CONFIG [KEY=VALUE ...]

DDP hides its all-reduce behind the backward only if buckets are handed to the network
while autograd still has gradients to make. Under `torch.compile` that depends on the
compiled backward being split at bucket boundaries (dynamo's DDPOptimizer); compiled as
one graph, every gradient appears at its end and every bucket launches after the
backward: the run is correct but its communication is all exposed.

The evidence is what algorithms/ddp.py `DDPCommHook` records for each bucket: its
ledger record's `lead_s`, from the bucket's launch to the last bucket's launch (the end of
backward compute), on the clock a step's compute is measured on. `worker` trains a few
steps through the real loop (`bench.run.train.Trainer`, records kept) under torchrun and
writes rank 0's bucket records and per-step compute seconds to OUT; `first_bucket_overlap`
(a pure function, tested on constructed records in tests/test_doctor.py) decides.
"""

from __future__ import annotations

import json
import statistics
import sys
from datetime import timedelta
from pathlib import Path

MIN_LEAD_FRACTION = 0.05
"""The first bucket must launch at least this share of the step's compute seconds before
the backward's end. Overlapped, k buckets spread over a backward of about 2/3 of the step
put the first (k-1)/k of that backward ahead (a third of the step or more for k >= 2);
not overlapped, its lead is only the time to launch the others back to back."""


def first_bucket_overlap(buckets: list[dict], compute_s: dict[int, float],
                         skip_steps: int = 0) -> str:
    """The verdict on DDP's bucket records: a pass's detail, or a RuntimeError.

    `buckets`: one dict per DDP bucket all-reduce in launch order, with `step` and
    `lead_s` (algorithms/ledger.py CommRecord); `compute_s`: step -> that step's compute
    seconds; steps before `skip_steps` (warm-up: compilation) are left out. Fails when
    no step is left, when a step has a single bucket (nothing can overlap: lower
    strategy.bucket_cap_mb or use a larger model), or when the median step's first
    bucket launched less than MIN_LEAD_FRACTION of its compute before the backward ended.
    """
    steps: dict[int, list[float]] = {}
    for b in buckets:
        if b["step"] >= skip_steps and b.get("lead_s") is not None:
            steps.setdefault(b["step"], []).append(b["lead_s"])
    steps = {s: leads for s, leads in steps.items() if s in compute_s}
    if not steps:
        raise RuntimeError(f"no DDP bucket records after the {skip_steps} warm-up steps: "
                           "nothing to judge the overlap on")
    single = sorted(s for s, leads in steps.items() if len(leads) < 2)
    if single:
        raise RuntimeError(f"one DDP bucket in step(s) {single}: a single bucket cannot "
                           "overlap the backward (lower strategy.bucket_cap_mb, or a larger "
                           "model)")
    fractions = [leads[0] / compute_s[s] if compute_s[s] > 0 else 0.0
                 for s, leads in sorted(steps.items())]
    leads = [leads[0] for _, leads in sorted(steps.items())]
    fraction, lead = statistics.median(fractions), statistics.median(leads)
    counts = sorted({len(v) for v in steps.values()})
    seen = (f"first of {'-'.join(map(str, counts))} buckets launched {lead * 1e3:.2f} ms "
            f"({fraction:.0%} of the step's compute) before the backward ended, median of "
            f"{len(steps)} steps")
    if fraction < MIN_LEAD_FRACTION:
        raise RuntimeError(f"no overlap: {seen}; every bucket waits for the whole backward "
                           f"(needs >= {MIN_LEAD_FRACTION:.0%})")
    return seen


def worker(out: str, config: str, overrides: list[str]) -> int:
    """One rank under torchrun: a few DDP steps through the real loop, records kept; rank 0
    writes {"buckets", "compute_s", "warmup_steps", "summary"} to `out`."""
    import torch.distributed as dist

    from bench.config import load_config
    from bench.env import resolve_device
    from bench.run.train import Trainer

    cfg = load_config(config, overrides)
    device, backend = resolve_device(cfg)
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.parallel.timeout_s))
    try:
        run_dir = Path(out).parent / f"overlap-rank{dist.get_rank()}"
        run_dir.mkdir(parents=True, exist_ok=True)
        trainer = Trainer(cfg, run_dir, device, backend, keep_records=True)
        compute: dict[int, float] = {}
        timed = trainer.timed_step

        def timed_step(step: int):
            stats, step_s, compute_s, records = timed(step)
            compute[step] = compute_s
            return stats, step_s, compute_s, records

        trainer.timed_step = timed_step
        summary = trainer.run()
        trainer.strategy.close()
        buckets = [{"step": r.step, "lead_s": r.lead_s, "seconds": r.seconds,
                    "nbytes": r.nbytes} for r in trainer.ledger.records
                   if r.phase == "train" and r.op == "all_reduce" and r.lead_s is not None]
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps({
                "buckets": buckets, "compute_s": compute, "warmup_steps": cfg.run.warmup_steps,
                "summary": {k: summary.get(k) for k in ("status", "steps",
                                                        "throughput_tokens_per_s")}}))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def read_verdict(out: Path) -> str:
    """The worker's file judged: `first_bucket_overlap`'s detail with the run's tok/s."""
    found = json.loads(out.read_text())
    compute = {int(step): s for step, s in found["compute_s"].items()}
    detail = first_bucket_overlap(found["buckets"], compute, found["warmup_steps"])
    rate = found["summary"].get("throughput_tokens_per_s") or 0
    return f"{detail}; {found['summary'].get('steps')} steps, {rate:,.0f} tok/s steady"


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: (torchrun ...) -m bench.node.doctor_overlap OUT CONFIG [KEY=VALUE ...]")
    sys.exit(worker(sys.argv[1], sys.argv[2], sys.argv[3:]))
