"""tools/gpu/check.sh, which runs only on a GPU node: its syntax, the families its ranks
part runs, and the table it prints of them (tools/gpu/ranks.py) from fake summaries."""

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools" / "gpu"


def ranks_module():
    spec = importlib.util.spec_from_file_location("gpu_ranks", TOOLS / "ranks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ranks_table_from_fake_summaries(tmp_path):
    ranks = ranks_module()
    ok = {"status": "ok", "world_size": 8, "throughput_tokens_per_s": 1234567.8,
          "comm_s_total": 0.4567, "comm_share": 0.123, "comm_bytes_total": 3 * 2**20,
          "final_val_loss": 4.56789}
    failed = {"status": "failed", "world_size": 2, "throughput_tokens_per_s": None,
              "error": "NCCL error | unhandled system error\nTraceback ..."}
    for name, summary in (("ddp", ok), ("1f1b", failed)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "pier").mkdir()  # started, wrote no summary
    (tmp_path / "deepspeed-zero1.skipped").write_text("deepspeed is not importable here\n")
    lines = ranks.table([tmp_path / n for n in ("ddp", "1f1b", "pier", "deepspeed-zero1")])
    assert lines.splitlines() == [
        "| run | ranks | status | tok/s steady | comm s | comm share | MiB sent | val loss |",
        "|---|---|---|---|---|---|---|---|",
        "| ddp | 8 | ok | 1,234,568 | 0.46 | 12% | 3.0 | 4.568 |",
        "| 1f1b | 2 | failed: NCCL error / unhandled system error |  |  |  |  |  |",
        "| pier | | no summary.json (see pier.log) | | | | | |",
        "| deepspeed-zero1 | | skipped: deepspeed is not importable here | | | | | |",
    ]


def test_check_sh_parses_and_runs_every_family_across_ranks():
    script = TOOLS / "check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    families = re.findall(r"^\s*many (\S+) ", script.read_text(), flags=re.M)
    assert families == ["ddp", "diloco", "pier", "gasloc", "streaming-diloco", "1f1b", "2bw",
                        "ddp-fsdp", "deepspeed-zero1"]


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_check_sh_is_shellcheck_clean():
    subprocess.run(["shellcheck", str(TOOLS / "check.sh")], check=True)
