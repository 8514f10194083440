"""README examples and the output they show, for tests (standard library only).

A README shows what an example prints in a fenced block marked with an HTML comment right above
it (invisible on GitHub), after the example's ```python block::

    ```python
    print(store.steps())
    ```

    <!-- output -->
    ```
    [3, 4]
    ```

Each package's ``tests/test_readme.py`` runs its examples and compares what one printed with the
shown output (:func:`mismatch`), so a README cannot drift from the code (issue 24: slurmclock's
README showed ``spread x1.20`` long after the code said ``x1.35``). The comparison:

- runs of whitespace (line breaks included) count as one space, so a long line may be wrapped
  in the README, and leading/trailing whitespace is ignored;
- ``...`` stands for any text (none included), for what varies from run to run: times, step
  counts, paths, digests (doctest's ELLIPSIS);
- everything else must be equal, and the shown output must cover the whole output.

Loaded by path, like the other tools (NamedTuples, not dataclasses: a module loaded by path is
not in sys.modules, which dataclasses need)::

    mdexamples = load_tool("mdexamples")            # or importlib.util.spec_from_file_location
    for ex in mdexamples.examples(README.read_text()):
        out = run(ex.code)
        assert ex.output is None or mdexamples.mismatch(ex.output, out) is None
"""

from __future__ import annotations

import re
from typing import NamedTuple

OUTPUT = "output"
_FENCE = re.compile(r"^(`{3,})([\w+-]*)[^\n]*\n(.*?)^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_MARKER = re.compile(r"<!--\s*([\w-]+)\s*-->\s*\Z")


class Block(NamedTuple):
    """A fenced block: its language (``""`` when none), text, first line of text (1-based), and
    the ``<!-- name -->`` marker right above its fence, if any."""

    lang: str
    text: str
    line: int
    marker: str | None


class Example(NamedTuple):
    """A code block and the output block shown for it (None when the README shows none)."""

    code: str
    line: int
    output: str | None
    output_line: int | None


def blocks(markdown: str) -> list[Block]:
    out = []
    for m in _FENCE.finditer(markdown):
        marker = _MARKER.search(markdown, 0, m.start())
        line = markdown.count("\n", 0, m.start(3)) + 1
        out.append(Block(m.group(2), m.group(3), line, marker.group(1) if marker else None))
    return out


def examples(markdown: str, langs: tuple[str, ...] = ("python",)) -> list[Example]:
    """Every block in ``langs``, with the ``<!-- output -->`` block that follows it (before any
    other block). An output block after no such block is an error: nothing would run it."""
    found: list[Example] = []
    open_ = False  # the last block was an example still without its output
    for b in blocks(markdown):
        if b.marker == OUTPUT:
            if not open_:
                raise ValueError(f"line {b.line}: an output block that follows no example block")
            last = found.pop()
            found.append(Example(last.code, last.line, b.text, b.line))
            open_ = False
        elif b.lang in langs:
            found.append(Example(b.text, b.line, None, None))
            open_ = True
        else:
            open_ = False
    return found


def pattern(shown: str) -> re.Pattern[str]:
    """The regular expression that ``shown`` stands for (see the module docstring)."""
    parts = [re.escape(" ".join(p.split())) for p in shown.split("...")]
    body = r".*?".join(p.replace(r"\ ", r"\s+") for p in parts)
    return re.compile(rf"\s*{body}\s*", re.DOTALL)


def mismatch(shown: str, actual: str) -> str | None:
    """None when ``actual`` is what ``shown`` shows, else a message naming the first shown line
    that was not printed (or that more was printed)."""
    if pattern(shown).fullmatch(actual) is not None:
        return None
    lines = [ln for ln in shown.splitlines() if ln.strip()]
    for n in range(1, len(lines) + 1):  # the longest shown start that still matches
        if pattern("\n".join(lines[:n]) + "...").fullmatch(actual) is None:
            return (
                f"the README shows {lines[n - 1].strip()!r} (shown line {n}), which was not "
                f"printed there; the example printed:\n{actual}"
            )
    return f"the example printed more than the README shows:\n{actual}"


def check(example: Example, printed: str) -> None:
    """Raise AssertionError (for a test) when ``printed`` is not the output ``example`` shows;
    an example that shows none passes."""
    if example.output is None:
        return
    problem = mismatch(example.output, printed)
    if problem is not None:
        raise AssertionError(f"README line {example.output_line}: {problem}")
