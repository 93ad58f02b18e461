"""The report's HTML builder: escaping, tables, notes, figures, the page (no knowledge of runs or models).

Everything is escaped here; sections hand in plain text or markup built by these helpers.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["Doc", "figure", "markdown_html", "note", "table"]

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1200px;margin:1.5em auto;padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.8em}h3{margin-bottom:.3em}
table{border-collapse:collapse;margin:.8em 0;font-size:.9em}th,td{border:1px solid #ccc;padding:.25em .6em;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
table.headline{font-size:.92em}table.headline th,table.headline td{padding:.25em .45em}table.headline td{white-space:nowrap}table.headline td:first-child{font-weight:600;white-space:normal}table.headline td:last-child{white-space:normal}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #eee}figcaption{font-size:.9em;color:#444;margin-top:.3em}
.note{color:#7a4a00;background:#fff6e5;border-left:3px solid #f0ad4e;padding:.4em .8em}
.finding{background:#eef5ff;border-left:3px solid #4a90d9;padding:.4em .8em}
.small{font-size:.85em;color:#555}
table.config td{text-align:left;vertical-align:top}table.config td:nth-child(10){min-width:22em}
.figrow{display:flex;flex-wrap:wrap;gap:1em}.figrow figure{flex:1 1 30%;min-width:300px;margin:.5em 0}
pre{background:#f7f7f7;padding:.6em;overflow-x:auto;font-size:.82em}nav{margin:.6em 0 1em}nav a{margin-right:1em}
"""


def _md_cells(line: str) -> list[str]:
    s = line.strip()
    if s.startswith("|"):
        s = s[1:]
    if s.endswith("|"):
        s = s[:-1]
    return [c.strip() for c in s.split("|")]


def markdown_html(md: str) -> str:
    """HTML for the Markdown the tables module writes: pipe tables and plain paragraphs (all text escaped).

    Example: ``"| a | b |\\n|---|---|\\n| 1 | 2 |"`` → one ``<table>`` with header a, b and row 1, 2.
    """
    out: list[str] = []
    lines = md.splitlines()
    i = 0
    para: list[str] = []

    def flush() -> None:
        if para:
            out.append("<p>" + html.escape(" ".join(para)) + "</p>")
            para.clear()

    while i < len(lines):
        line = lines[i]
        if line.strip().startswith("|"):
            flush()
            block = []
            while i < len(lines) and lines[i].strip().startswith("|"):
                block.append(lines[i])
                i += 1
            rows = [_md_cells(b) for b in block]
            head, body = rows[0], rows[1:]
            if body and all(set(c) <= set("-: ") for c in body[0]):
                body = body[1:]
            out.append(table(head, body))
            continue
        if not line.strip():
            flush()
        elif line.startswith("#"):
            flush()
            out.append(f"<h3>{html.escape(line.lstrip('#').strip())}</h3>")
        else:
            para.append(line.strip())
        i += 1
    flush()
    return "\n".join(out)


def table(head: Sequence[str], rows: Iterable[Sequence[Any]], cls: str | None = None, raw: bool = False) -> str:
    """A ``<table>``; cells are escaped unless ``raw`` (cells already built with these helpers)."""
    cell = (lambda c: str(c)) if raw else (lambda c: html.escape(str(c)))
    attr = f' class="{html.escape(cls)}"' if cls else ""
    t = [
        f"<table{attr}>",
        "<thead><tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in head) + "</tr></thead>",
        "<tbody>",
    ]
    t += ["<tr>" + "".join(f"<td>{cell(c)}</td>" for c in r) + "</tr>" for r in rows]
    t.append("</tbody></table>")
    return "\n".join(t)


def note(text: str) -> str:
    """A highlighted remark (something missing or skipped, and why)."""
    return f'<p class="note">{html.escape(text)}</p>'


def para(text: str, cls: str | None = None) -> str:
    attr = f' class="{html.escape(cls)}"' if cls else ""
    return f"<p{attr}>{html.escape(text)}</p>"


def figure(fig_id: str, png: bytes, caption: str) -> str:
    """A figure with the PNG inlined as base64 and its caption (also the image's alt text)."""
    data = base64.b64encode(png).decode("ascii")
    return (
        f'<figure id="{html.escape(fig_id)}"><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


class Doc:
    """A page of titled sections, rendered in the order added, with a navigation bar."""

    def __init__(self, title: str):
        self.title = title
        self.sections: list[tuple[str, str, str]] = []

    def add(self, sec_id: str, title: str, body: str) -> None:
        self.sections.append((sec_id, title, body))

    def render(self, intro: str) -> str:
        nav = " ".join(f'<a href="#{html.escape(i)}">{html.escape(t)}</a>' for i, t, _ in self.sections)
        parts = [
            "<!DOCTYPE html>",
            '<html lang="en">',
            "<head>",
            '<meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{html.escape(self.title)}</title>",
            f"<style>{CSS}</style>",
            "</head>",
            "<body>",
            f"<h1>{html.escape(self.title)}</h1>",
            intro,
            f"<nav>{nav}</nav>",
        ]
        for i, t, body in self.sections:
            parts.append(f'<section id="{html.escape(i)}">\n<h2>{html.escape(t)}</h2>\n{body}\n</section>')
        parts += ["</body>", "</html>"]
        return "\n".join(parts) + "\n"
