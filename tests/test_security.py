"""Results directories travel (shared filesystems, tarballs, a paper's artefact): everything
commbench reads from one is untrusted. Nothing in it may execute or inject.

    pytest tests/test_security.py

- Markup: report.md and claims.md render record and claim-file text as text (no inline
  HTML survives, no `javascript:` link forms); the HTML pages escape everything.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from bench.claims import run_claims
from bench.report import build_report
from bench.report.render import md_text, to_markdown
from tests.test_claims import claim_data, fake_runner
from tests.test_report import DDP_VAL, _save, _sweep, write_run

HOSTILE = [
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    "[click](javascript:alert(1))",
    "[ref]: javascript:alert(1)",
]
"""Strings a crafted record or claim file carries into every text a page shows."""


def assert_inert_markdown(md: str) -> None:
    """No raw tag, and no link or reference definition whose `]` is not backslash-escaped."""
    for live in ("<script", "<img src=x"):
        assert live not in md, live
    assert not re.search(r"(?<!\\)\]\(javascript:", md)
    assert not re.search(r"(?<!\\)\]:\s*javascript:", md)


def test_markdown_text_renders_as_text():
    for text in HOSTILE:
        out = md_text(text)
        assert "<" not in out and "](" not in out.replace("\\](", "")
        assert_inert_markdown(out)
    # the report's own markup stays
    assert md_text("`code` and **bold**, 2.47× [0.93, 6.6]") == \
        "`code` and **bold**, 2.47× [0.93, 6.6]"


def test_every_block_of_a_page_is_escaped(tmp_path):
    import pandas as pd

    png = tmp_path / "f.png"
    png.write_bytes(b"\x89PNG")
    hostile = " ".join(HOSTILE)
    md = to_markdown([("h1", hostile), ("h2", hostile), ("p", hostile),
                      ("table", pd.DataFrame({hostile: [hostile]})),
                      ("figure", png, hostile)], tmp_path)
    assert_inert_markdown(md)


def test_report_of_a_crafted_results_directory_is_inert(tmp_path):
    sweep_dir, sweep = _sweep(tmp_path, "s")
    hostile = " ".join(HOSTILE)
    for seed in (0, 1):
        write_run(sweep_dir, sweep, "ddp", "ddp", seed, DDP_VAL, 1.0)
        write_run(sweep_dir, sweep, "x<script>alert(1)</script>", "diloco", seed, DDP_VAL,
                  0.5, status="failed", error=hostile)
    out = tmp_path / "out"
    html_path = build_report(_save(sweep_dir, sweep), out)
    md = (out / "report.md").read_text()
    assert "&lt;script>" in md  # the text is there, as text
    assert_inert_markdown(md)
    html = html_path.read_text()
    assert "<script>" not in html and "<img src=x" not in html


def test_claims_page_of_a_crafted_claim_file_is_inert(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    claims_dir = tmp_path / "claims"
    claims_dir.mkdir()
    base = {"run": {"name": "base", "steps": 10}, "model": {"preset": "tiny", "seq_len": 32},
            "data": {"corpus": "embedded", "batch_size": 4}, "parallel": {"world_size": 2},
            "strategy": {"name": "ddp"}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    hostile = " ".join(HOSTILE)
    data = claim_data(statement=hostile,
                      paper={"source": hostile, "where": hostile, "numbers": hostile})
    data["rules"][0]["name"] = hostile
    (claims_dir / "toy.yaml").write_text(yaml.safe_dump(data))
    page = run_claims(claims_dir=claims_dir, output_dir="results", report_dir="report",
                      runner=fake_runner)
    md = (tmp_path / "report" / "claims.md").read_text()
    assert "&lt;script>" in md
    assert_inert_markdown(md)
    assert "<script>" not in page.read_text()
    json.loads((tmp_path / "report" / "claims.json").read_text())  # still valid JSON


@pytest.mark.parametrize("text", HOSTILE)
def test_table_cells_cannot_break_out_of_the_table(text):
    import pandas as pd

    from bench.report.render import markdown_table

    table = markdown_table(pd.DataFrame({"a": [text + "|\nnext"]}))
    assert table.count("\n") == 2  # header, rule, one row
