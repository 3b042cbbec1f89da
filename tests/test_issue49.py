"""Issue 49 (the third probe): names, pages, gates and bounds.

Rows of the bad-input matrix (tests/test_bad_input.py: the real command line, the exit
code, each expected part of the message, nothing on disk changed) for the cases the probe
found late, unclear or accepted; then the cases that are not a refusal: markup through
every page writer, compare's gate on an unfinished run, track's check before sending,
the what-if's bound under a timeout.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bench.cli import main
from tests import test_bad_input as matrix
from tests.test_bad_input import SWEEP, Case, recorded_run, run_argv, spec

REPO = Path(__file__).resolve().parent.parent
SCENARIO = "{repo}/configs/whatif/llama1b-8x8.yaml"
WHATIF = ["whatif", SCENARIO, "-o", "{tmp}/wi"]

CASES = [
    # ---- one rule for names (a trailing newline passed `$` with re.match)
    Case("run-name-newline", run_argv('run.name="evil\\n"'),
         ["run.name", "'evil\\n'", "letters, digits", "run directory"]),
    Case("sweep-name-newline", SWEEP + ["--dry-run"], ["name", "'evil\\n'", "letters, digits"],
         files=spec('name: "evil\\n"\n')),
    Case("variant-name-newline", SWEEP + ["--dry-run"],
         ["variant name", "'x\\n'", "letters, digits"],
         files=spec('variants: {"x\\n": {strategy.name: ddp}}\n')),
    Case("whatif-name-escape", WHATIF + ["--set", "name=../x"],
         ["name", "'../x'", "letters, digits", "output folder"]),
    Case("whatif-name-deep-escape", WHATIF + ["--set", "name=../../../../tmp/x"],
         ["name", "'../../../../tmp/x'", "letters, digits"]),
    # ---- whatif -o into a run record (report -o refuses it)
    Case("whatif-into-run-dir", WHATIF[:2] + ["-o", "{tmp}/r"],
         ["whatif -o", "{tmp}/r", "is a run directory", "elsewhere"], files=recorded_run()),
    Case("whatif-out-under-file", WHATIF[:2] + ["-o", "{tmp}/file/wi"],
         ["whatif -o", "{tmp}/file", "is a file"], files={"file": "x"}),
    # ---- the planner's bounds
    Case("whatif-10-6-replicas", WHATIF + ["--set", "world.replicas=1000000"],
         ["world.replicas x world.gpus_per_replica", "8,000,000 GPUs", "at most 1,024"]),
    Case("whatif-10-5-gpus", WHATIF + ["--set", "world.replicas=12500"],
         ["100,000 GPUs", "at most 1,024", "MAX_GPUS"]),
    Case("whatif-points", WHATIF + ["--set", "network.points=100000"],
         ["network.points", "100000", "from 1 to 1000"]),
    Case("whatif-num-params-negative", WHATIF + ["--set", "model_size.num_params=-5"],
         ["model_size.num_params", "-5", "a parameter count >= 1"]),
    Case("whatif-replica-over-odd-nodes",
         WHATIF + ["--set", "world.gpus_per_replica=8", "--set", "world.gpus_per_node=3"],
         ["world.gpus_per_replica (8)", "world.gpus_per_node (3)", "divide"]),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_issue49_bad_input(case, tmp_path, capsys):
    matrix.test_bad_input_fails_cleanly_and_changes_nothing(case, tmp_path, capsys)


@pytest.mark.timeout(30)
def test_a_whatif_of_10_5_gpus_answers_within_10_s(tmp_path, capsys):
    """A world people plan (10^5 GPUs) is answered (here: refused, naming the bound) in
    seconds, not the minutes it ran for; so is a sweep of 10^5 points."""
    for setting in ("world.replicas=12500", "network.points=100000"):
        start = time.monotonic()
        code = main(["whatif", str(REPO / "configs/whatif/llama1b-8x8.yaml"), "--set",
                     setting, "-o", str(tmp_path / "wi")])
        assert code == 2 and time.monotonic() - start < 10
    assert "at most" in capsys.readouterr().err
    assert not (tmp_path / "wi").exists()


def test_the_plan_refuses_more_rank_steps_than_its_bound():
    from bench.whatif.report import method_plan
    from bench.whatif.scenario import base_profile, load_scenario

    s = load_scenario(str(REPO / "configs/whatif/llama1b-8x8.yaml"),
                      ["methods={d: {strategy: {name: diloco, inner_steps: 100000}}}"])
    with pytest.raises(ValueError, match=r"methods\.d: .*rank-steps.*MAX_RANK_STEPS"):
        method_plan(s, "d", base_profile(s)[0])

