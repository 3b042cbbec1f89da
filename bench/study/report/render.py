"""Write a report's blocks as markdown (figures as PNG files beside it) and as one HTML file.

A report is a list of blocks: ("h1"|"h2"|"p", text), ("table", DataFrame of strings),
("figure", png path, caption). The HTML embeds figures as base64 PNG, so it is a single
self-contained file to mail or attach.
"""

from __future__ import annotations

import base64
import html
import math
import re
from pathlib import Path

import pandas as pd

CSS = """
body { font-family: -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1200px; color: #222; line-height: 1.45; padding: 0 1em; }
h1 { border-bottom: 2px solid #444; padding-bottom: .2em; }
h2 { margin-top: 1.8em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 13px; margin: .6em 0 1.2em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th { background: #f1f1f1; }
td:first-child, th:first-child { text-align: left; }
tr:nth-child(even) td { background: #fafafa; }
figure { margin: 1em 0; } figcaption { font-size: 13px; color: #555; }
img { max-width: 100%; border: 1px solid #eee; }
p.note { font-size: 13px; color: #555; }
code { background: #f4f4f4; padding: 0 3px; }
"""


# ----------------------------------------------------------------------------- numbers


def num(value, digits: int = 4) -> str:
    """`digits` significant digits; large values in full with thousands separators."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if abs(value) >= 10**digits:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def with_ci(mean, ci, digits: int = 4, suffix: str = "") -> str:
    text = num(mean, digits)
    if text == "—":
        return text
    text += suffix
    if ci is not None and isinstance(ci, float) and math.isfinite(ci):
        text += f" ± {ci:.2g}"
    return text


def bounds(low: float, high: float, digits: int = 2) -> str:
    """"[low, high]" with `digits` significant digits, or more where fewer would print the
    two ends alike (a narrow interval is not "[1.2, 1.2]": "[1.16, 1.23]")."""
    while digits < 6 and f"{low:.{digits}g}" == f"{high:.{digits}g}":
        digits += 1
    return f"[{low:.{digits}g}, {high:.{digits}g}]"


def ratio_ci(estimate, low, high, n) -> str:
    """A ratio with its (asymmetric) 95% interval: "2.47× [0.93, 6.6] n<3".

    Flags "n<3" when fewer than 3 seeds (or pairs) went in; "(n=1: no interval)" for one."""
    text = num(estimate, 3)
    if text == "—":
        return text
    text += "×"
    if low is not None and math.isfinite(low) and math.isfinite(high):
        text += f" {bounds(low, high)}"
        if n is not None and math.isfinite(n) and n < 3:
            text += " n<3"
    elif n is not None and math.isfinite(n) and n < 3:
        text += f" (n={int(n)}: no interval)"
    return text


def si(value, unit: str = "") -> str:
    """1234567 -> '1.23 M' (+unit)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()


def percent(value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{100 * value:.1f}%"


# ---------------------------------------------------------------------------- markdown


_TAG_OPEN = re.compile(r"<(?=[A-Za-z/!?])")


def md_text(text) -> str:
    """Text for markdown that renders as text: records and claim files are untrusted (a
    results directory travels), and markdown renderers keep inline HTML and follow links.
    A `<` that could open a tag, comment or autolink (followed by a letter, `/`, `!` or `?`)
    becomes `&lt;` (so "n<3" stays readable), and the link forms `](` and `]:` are
    backslash-escaped (no `[x](javascript:...)` link, no reference definition). The
    report's own `code` and **bold** are left alone."""
    text = _TAG_OPEN.sub("&lt;", str(text))
    return text.replace("](", "\\](").replace("]:", "\\]:")


def _md_cell(text) -> str:
    return md_text(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(table: pd.DataFrame) -> str:
    if table.empty:
        return "_(none)_"
    header = "| " + " | ".join(_md_cell(c) for c in table.columns) + " |"
    rule = "|" + "|".join("---" for _ in table.columns) + "|"
    body = ["| " + " | ".join(_md_cell(v) for v in row) + " |"
            for row in table.itertuples(index=False)]
    return "\n".join([header, rule, *body])


def to_markdown(blocks: list[tuple], out_dir: Path) -> str:
    parts = []
    for kind, *content in blocks:
        if kind == "h1":
            parts.append(f"# {md_text(content[0])}")
        elif kind == "h2":
            parts.append(f"## {md_text(content[0])}")
        elif kind == "p":
            parts.append(md_text(content[0]))
        elif kind == "table":
            parts.append(markdown_table(content[0]))
        elif kind == "figure":
            path, caption = content
            alt = md_text(caption).replace("[", "\\[").replace("]", "\\]")
            parts.append(f"![{alt}]({Path(path).relative_to(out_dir).as_posix()})\n\n"
                         f"_{md_text(caption)}_")
    return "\n\n".join(parts) + "\n"


# -------------------------------------------------------------------------------- HTML


def _inline_markdown(text: str) -> str:
    """The little markdown the report's paragraphs use: `code` and **bold**."""
    out = html.escape(text)
    for marker, tag in (("`", "code"), ("**", "b")):
        pieces = out.split(marker)
        if len(pieces) % 2 == 1:
            out = "".join(p if i % 2 == 0 else f"<{tag}>{p}</{tag}>"
                          for i, p in enumerate(pieces))
    return out


def to_html(blocks: list[tuple], title: str) -> str:
    parts = [f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}"
             f"</title><style>{CSS}</style></head><body>"]
    for kind, *content in blocks:
        if kind in ("h1", "h2"):
            parts.append(f"<{kind}>{html.escape(content[0])}</{kind}>")
        elif kind == "p":
            for para in content[0].split("\n\n"):
                if para.lstrip().startswith("- "):
                    items = [line.lstrip()[2:] for line in para.splitlines() if line.strip()]
                    parts.append("<ul>" + "".join(f"<li>{_inline_markdown(i)}</li>"
                                                  for i in items) + "</ul>")
                else:
                    parts.append(f"<p>{_inline_markdown(para)}</p>")
        elif kind == "table":
            table = content[0]
            parts.append("<p class='note'>(none)</p>" if table.empty
                         else table.to_html(index=False, escape=True, border=0))
        elif kind == "figure":
            path, caption = content
            data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
            parts.append(f"<figure><img alt='{html.escape(caption)}' "
                         f"src='data:image/png;base64,{data}'>"
                         f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
