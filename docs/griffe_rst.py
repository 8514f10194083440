"""Griffe extension for the API reference: the packages' docstrings are plain text with a few
reStructuredText habits (read in a terminal with ``help()``); this turns them into the Markdown
mkdocstrings renders, without changing the source.

- ``:class:`~pkg.Name``` and the other Python roles: a cross-reference to ``pkg.Name`` when it
  names one of the documented packages (``--strict`` then fails the build if it does not
  resolve), else inline code; ``:mod:`` too is inline code, as the reference documents each
  package's public API (its ``__all__``), not its modules;
- RST simple tables (``====  ====`` borders) become Markdown tables;
- a paragraph ending in ``::`` before an indented block ends in ``:`` (the block is code
  either way).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

PACKAGES = ("slurmclock", "ddpkit", "ckptstore", "parquetlm")
_ROLE = re.compile(
    r":(class|func|meth|attr|data|mod|exc|obj|const):`(~?)([^`<]+?)(?:\s*<([^>]+)>)?`"
)
_BORDER = re.compile(r"^(\s*)(=+)(\s+=+)+\s*$")


def _role(match: re.Match[str]) -> str:
    role, short, target, explicit = match.group(1, 2, 3, 4)
    path = (explicit or target).strip().lstrip(".").removesuffix("()")
    text = path.rsplit(".", 1)[-1] if short else path
    if role != "mod" and path.split(".")[0] in PACKAGES:
        return f"[`{text}`][{path}]"
    return f"`{text}`"


def _cells(line: str, starts: list[int]) -> list[str]:
    bounds = [*starts[1:], None]
    return [line[a:b].strip() for a, b in zip(starts, bounds, strict=True)]


def _tables(text: str) -> str:
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        m = _BORDER.match(lines[i])
        if m is None:
            out.append(lines[i])
            i += 1
            continue
        starts = [s.start() for s in re.finditer(r"=+", lines[i])]
        rows, i = [], i + 1
        while i < len(lines) and not _BORDER.match(lines[i]):
            rows.append(lines[i])
            i += 1
        header, i = rows, i + 1  # the border after the header
        body = []
        while i < len(lines) and not _BORDER.match(lines[i]):
            body.append(lines[i])
            i += 1
        i += 1  # the closing border
        table = [_cells(r, starts) for r in header if r.strip()]
        width = len(starts)
        md = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * width]
        for row in body:
            if not row.strip():
                continue
            cells = _cells(row, starts)
            if not cells[0] and len(md) > 2:  # a continuation line: join with the row above
                above = md[-1].strip("| ").split(" | ")
                cells = [f"{a} {c}".strip() for a, c in zip(above, cells, strict=False)]
                md.pop()
            md.append("| " + " | ".join(cells) + " |")
        out.extend(["", *md, ""])
    return "\n".join(out)


class RstToMarkdown(griffe.Extension):
    """Rewrites each docstring once, when its object is loaded (griffe calls ``on_object`` for
    every member, ``on_package`` for the package itself)."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None:
            return
        text = _tables(obj.docstring.value)
        text = _ROLE.sub(_role, text)
        text = re.sub(r"(\S)::\n\n", r"\1:\n\n", text)
        obj.docstring.value = text

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self.on_object(obj=pkg)
