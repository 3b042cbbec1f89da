"""The `slurm_cluster` fixture: tests/slurm/test_*.py marked `slurm` need a running cluster
(tools/slurm/start-cluster.sh); without one they skip, except under COMMBENCH_SLURM=1,
where they fail. A node still completing a job that just ended (Slurm reaps its processes:
seconds) is waited for, up to SETTLE_S."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
READY = {"idle", "mixed", "allocated"}
SETTLE_S = 120
"""How long a test waits for the nodes to leave `completing` (the job before it, or
another user's, ending) before it fails."""


def _node_states() -> set[str]:
    if not shutil.which("sinfo"):
        return {"no sinfo on PATH"}
    done = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True)
    return set(done.stdout.split()) or {done.stderr.strip()}


@pytest.fixture
def slurm_cluster(monkeypatch):
    states, deadline = _node_states(), time.monotonic() + SETTLE_S
    while not states <= READY and states <= READY | {"completing"} and time.monotonic() < deadline:
        time.sleep(1)
        states = _node_states()
    if not states <= READY:
        message = (f"no idle Slurm nodes here ({', '.join(sorted(states))}); start them: "
                   "tools/slurm/start-cluster.sh")
        if os.environ.get("COMMBENCH_SLURM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    # jobs inherit the environment (sbatch --export=ALL): the repo and the hang list
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("COMMBENCH_TEST_HANG", raising=False)
