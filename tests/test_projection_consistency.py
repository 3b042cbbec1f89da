"""One model per record: every projected figure of a run comes from one pricing of one
timeline (issue 27, "One model per record"; bench/run/meter.py, Projected time).

Per stretch between coupled steps (as `coupled_max` cuts them), the rank whose compute +
modelled comm ends the stretch last is the timeline: its compute is the projection's
`compute_s`, the rest its `comm_s`. So, per profile and per overlap mode (and for
`projected_robust`): step_s == compute_s + comm_s, total_s == step_s x steps, the steady
rate is the same totals', the projected time to target is the projected clock at the
target validation (that row's `projected_elapsed_s`), and the last metrics row's
projected clock is total_s.

One 2-rank launch runs a tiny real run of every strategy family; the oracle re-cuts the
ranks' per-step priced values (captured from `StepClock.add` as the loop made them) into
stretches and picks each stretch's slowest rank, independently of `StepClock.settle`. A
pipeline's overlap-aware values are the replica's schedule replayed with each stage's own
compute (`critical_path_time` on the captured (d, h, other) of both ranks), as settle
prices them (bench/network/timeline.py, `pipeline_values`).
"""

from pathlib import Path

import pytest

from bench.network.timeline import OVERLAP_MODES
from bench.run.meter import LoopState, StepClock
from tests import strategies
from tests.distributed import run_distributed
from tests.local_updates import make_trainer

PROFILES = ["nvlink", "eth-10g", "wan-1g", "two-sites"]
COMMON = ["run.steps=6", "run.log_every=4", "run.val_every=3", "run.target_loss=100",
          "run.warmup_steps=1", f"network.profiles=[{', '.join(PROFILES)}]"]
FAMILIES = {  # (config, overrides): tests/strategies.py `projection`
    name: (strategies.config_of(entry, case), list(case.overrides))
    for name, (entry, case) in strategies.cases("projection").items()}


def run_and_capture(rank, world_size, base):
    """Every family's run; per run the summary, this rank's per-step log: (compute_s,
    coupled, priced values per column, (d, h, other) per column) for each `StepClock.add`,
    None at each settle; the metrics rows and the strategy's critical path."""
    log: list = []
    add, settle = StepClock.add, StepClock.settle

    def logged_add(self, step_s, stats, step_records, samples=None, compute_s=None):
        before, inputs = len(self.projected), len(self.robust)
        add(self, step_s, stats, step_records, samples, compute_s)
        log.append((step_s - stats.comm_s if compute_s is None else compute_s,
                    bool(step_records), self.projected[before:], self.robust[inputs + 2:]))

    def logged_settle(self):
        if self.num_steps:
            log.append(None)
        return settle(self)

    StepClock.add, StepClock.settle = logged_add, logged_settle
    out = {}
    try:
        for name, (config, overrides) in FAMILIES.items():
            log.clear()
            trainer = make_trainer(world_size, config, [*COMMON, *overrides],
                                   Path(base) / name)
            summary = trainer.run()
            trainer.strategy.close()
            out[name] = (summary, list(log), trainer.records.read_metrics(),
                         trainer.strategy.critical_path())
    finally:
        StepClock.add, StepClock.settle = add, settle
    return out


def replayed(entries: tuple, path) -> list[list[float]]:
    """Every rank's values of one step of a 2-stage pipeline (one replica): the
    overlap-aware columns (the first half) are the schedule replayed with each rank's
    compute, the larger d (with its h) and the larger other."""
    from bench.network.pipeline import critical_path_time

    assert len(entries) == path.num_stages == 2
    values = [list(v) for _, _, v, _ in entries]
    for c in range(len(values[0]) // len(OVERLAP_MODES)):
        triples = [inputs[3 * c:3 * c + 3] for _, _, _, inputs in entries]
        d, h, _ = max(triples, key=lambda t: t[0])
        seconds = critical_path_time([compute for compute, _, _, _ in entries], d, h,
                                     max(t[2] for t in triples), path)
        for v in values:
            v[c] = seconds
    return values


def timeline(logs: list[list], path=None) -> tuple[list[float], list[float]]:
    """(total, compute) per column: per stretch (cut at each coupled step and each settle),
    the rank with the largest summed priced seconds, and that rank's compute; a
    pipeline's (`path`) values `replayed` per step."""
    ranks = len(logs)
    width = len(next(e for e in logs[0] if e is not None)[2])
    totals, compute = [0.0] * width, [0.0] * width
    sums = [[0.0] * width for _ in range(ranks)]
    own = [0.0] * ranks

    def close():
        for c in range(width):
            slowest = max(range(ranks), key=lambda r: sums[r][c])  # first on a tie
            totals[c] += sums[slowest][c]
            compute[c] += own[slowest]
        for r in range(ranks):
            sums[r], own[r] = [0.0] * width, 0.0

    assert len({len(log) for log in logs}) == 1  # the same steps and settles everywhere
    for entries in zip(*logs, strict=True):
        if entries[0] is None:
            close()
            continue
        step_values = ([v for _, _, v, _ in entries] if path is None
                       else replayed(entries, path))
        for r, ((c, _, _, _), values) in enumerate(zip(entries, step_values, strict=True)):
            own[r] += c
            sums[r] = [s + v for s, v in zip(sums[r], values, strict=True)]
        if any(coupled for _, coupled, _, _ in entries):
            close()
    return totals, compute


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(run_and_capture, 2, str(tmp_path_factory.mktemp("consistency")),
                           timeout=280)


def assert_consistent(p: dict, steps: int, tokens: int, warmup_tokens: int, where: str):
    """The identities of one `Projection`."""
    assert p["compute_s"] + p["comm_s"] == pytest.approx(p["step_s"], rel=1e-12), where
    assert p["step_s"] * steps == pytest.approx(p["total_s"], rel=1e-12), where
    assert p["comm_s"] >= -1e-12 and p["compute_s"] > 0, where
    steady = p["total_s"] - p["warmup_s"]
    assert p["throughput_tokens_per_s"] == pytest.approx((tokens - warmup_tokens) / steady,
                                                         rel=1e-12), where


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_projected_figure_prices_one_timeline(runs, family):
    summary, _, rows, path = runs[0][family]
    steps, tokens = summary["steps"], summary["total_tokens"]
    assert steps == 6 and summary["status"] == "ok"
    totals, compute = timeline([result[family][1] for result in runs], path)
    val = next(r for r in rows if "val_loss" in r)  # the first: target_loss 100 reached
    columns = [("projected" if overlap else "projected_no_overlap", name)
               for overlap in OVERLAP_MODES for name in PROFILES]
    recorded = [summary[key][name] for key, name in columns]
    # the oracle's timeline: its total, and its comm and compute per step, every column
    assert [p["total_s"] for p in recorded] == pytest.approx(totals, rel=1e-9)
    assert [p["comm_s"] for p in recorded] == pytest.approx(
        [(t - c) / steps for t, c in zip(totals, compute, strict=True)], rel=1e-9, abs=1e-12)
    assert [p["compute_s"] for p in recorded] == pytest.approx(
        [c / steps for c in compute], rel=1e-9)
    for (key, name), p in zip(columns, recorded, strict=True):
        where = f"{family} {key}[{name}]"
        assert_consistent(p, steps, tokens, summary["warmup_tokens"], where)
        if key == "projected":
            assert rows[-1]["projected_elapsed_s"][name] == pytest.approx(p["total_s"],
                                                                          rel=1e-12), where
            at_target = summary["projected_time_to_target_s"][name]
            assert at_target == val["projected_elapsed_s"][name], where
            assert at_target <= p["total_s"], where
    # the projection's own cost, recorded as harness time (bench/run/meter.py, Projection cost)
    assert summary["projection_s_total"] > 0
    assert summary["projection_s_per_step"] == pytest.approx(
        summary["projection_s_total"] / steps, rel=1e-12)
    for name, p in summary["projected_robust"].items():
        assert_consistent(p, steps, tokens, 0, f"{family} projected_robust[{name}]")


def test_a_checkpoint_without_the_projections_compute_is_refused_on_resume():
    """A loop state saved before `projected_compute_s` (it had `projected_comm_s`, the
    maximum of each rank's comm) cannot continue the projection on one timeline."""
    from dataclasses import asdict

    saved = asdict(LoopState(step=3))
    assert LoopState.restore(dict(saved)) == LoopState(step=3)
    old = {k: v for k, v in saved.items() if not k.startswith("projected_compute")}
    old.update(projected_comm_s={"nvlink": 0.1}, projected_comm_no_overlap_s={"nvlink": 0.2})
    with pytest.raises(RuntimeError, match=r"resume: .*another version.*projected_comm_s.*"
                                           r"missing: \['projected_compute_no_overlap_s'"):
        LoopState.restore(old)


def test_a_checkpoint_with_the_old_stretch_layout_is_refused_on_resume():
    """The robust projection's stretches hold a pipeline column's (d, h) link since the
    schedule replay (bench/network/pipeline.py), and its stages are priced each at its own
    compute since format 3: a state without `stretch_format`, or with another one, would
    continue its clocks on another pricing and is refused."""
    from dataclasses import asdict

    saved = asdict(LoopState(step=3))
    old = {k: v for k, v in saved.items() if k != "stretch_format"}
    with pytest.raises(RuntimeError, match=r"missing: \['stretch_format'\]"):
        LoopState.restore(old)
    for older in (1, 2):
        with pytest.raises(RuntimeError, match=f"stretch_format {older}"):
            LoopState.restore({**saved, "stretch_format": older})
