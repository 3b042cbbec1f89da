"""The `slurm_cluster` fixture: tests/slurm/test_*.py marked `slurm` need a running cluster
(tools/slurm/start-cluster.sh); without one they skip, except under COMMBENCH_SLURM=1,
where they fail."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _node_states() -> set[str]:
    if not shutil.which("sinfo"):
        return {"no sinfo on PATH"}
    done = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True)
    return set(done.stdout.split()) or {done.stderr.strip()}


@pytest.fixture
def slurm_cluster(monkeypatch):
    states = _node_states()
    if not states <= {"idle", "mixed", "allocated"}:
        message = (f"no idle Slurm nodes here ({', '.join(sorted(states))}); start them: "
                   "tools/slurm/start-cluster.sh")
        if os.environ.get("COMMBENCH_SLURM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    # jobs inherit the environment (sbatch --export=ALL): the repo and the hang list
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("COMMBENCH_TEST_HANG", raising=False)
