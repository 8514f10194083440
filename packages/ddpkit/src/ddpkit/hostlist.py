"""SLURM node-list syntax (``gpu[001-004,007],cpu3``) without calling ``scontrol``.

A node list is a comma- (or whitespace-) separated list of host patterns. A pattern is literal
text with any number of bracket groups; each group is a comma-separated list of numbers and
``lo-hi`` ranges. Several groups in one pattern expand as a cartesian product, leftmost group
slowest (``rack[1-2]-gpu[01-02]`` -> rack1-gpu01, rack1-gpu02, rack2-gpu01, rack2-gpu02). Zero
padding is kept: the width of ``lo`` is the width of every number of its range, as in SLURM.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator

# Expanding a typo like n[1-100000000] must not eat the node's memory.
MAX_HOSTS = 1_000_000

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(expr: str) -> list[str]:
    """Every host of a SLURM node list, in order (duplicates kept).

    >>> expand_hostlist("gpu[001-002,007],cpu3")
    ['gpu001', 'gpu002', 'gpu007', 'cpu3']

    Raises ValueError naming the malformed part. An empty or blank list expands to ``[]``.
    """
    parsed = [_parse_pattern(p) for p in _split_patterns(expr)]
    total = sum(math.prod(len(piece) for piece in pieces) for pieces in parsed)
    if total > MAX_HOSTS:
        raise ValueError(
            f"node list {_short(expr)!r} expands to {total:,} hosts, more than {MAX_HOSTS:,}; "
            "check the ranges for a typo"
        )
    hosts: list[str] = []
    for pieces in parsed:
        hosts.extend("".join(combo) for combo in itertools.product(*pieces))
    return hosts


def first_host(expr: str) -> str:
    """The first host of a node list, without expanding the rest (the master's address).

    Raises ValueError for a malformed list (the whole list is checked) or an empty one.
    """
    patterns = _split_patterns(expr)
    if not patterns:
        raise ValueError("node list is empty: expected something like 'gpu[001-004],cpu3'")
    for pattern in patterns[1:]:
        _parse_pattern(pattern)  # validate everything; a bad tail is still a bad list
    return next(_expand_pattern(patterns[0]))


def parse_tasks_per_node(expr: str) -> list[int]:
    """SLURM's ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"``) -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in expr.replace(" ", "").split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if m is None:
            raise ValueError(
                f"malformed part {part!r} in tasks-per-node {expr!r}: "
                "expected counts like '2(x3),1'"
            )
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _split_patterns(expr: str) -> list[str]:
    """Split at commas and whitespace outside brackets; check bracket balance."""
    patterns: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(expr):
        if ch == "[":
            if depth:
                raise ValueError(f"nested '[' at position {i} in node list {_short(expr)!r}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"unmatched ']' at position {i} in node list {_short(expr)!r}")
            depth = 0
        elif (ch == "," or ch.isspace()) and not depth:
            patterns.append(expr[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unclosed '[' in node list {_short(expr)!r}")
    patterns.append(expr[start:])
    stripped = [p.strip() for p in patterns]
    if any(not p for p in stripped) and any(stripped):
        # "a,,b" or "a," : an empty host is a typo worth naming, not something to skip.
        where = ", ".join(repr(p) for p in stripped)
        raise ValueError(f"empty host name in node list {_short(expr)!r} (parts: {_short(where)})")
    return [p for p in stripped if p]


def _parse_pattern(pattern: str) -> list[list[str]]:
    """``rack[1-2]-gpu[01,03]`` -> [["rack"], ["1", "2"], ["-gpu"], ["01", "03"]]."""
    pieces: list[list[str]] = []
    pos = 0
    while pos < len(pattern):
        open_at = pattern.find("[", pos)
        if open_at < 0:
            pieces.append([pattern[pos:]])
            break
        if open_at > pos:
            pieces.append([pattern[pos:open_at]])
        close_at = pattern.index("]", open_at)  # balance was checked by _split_patterns
        pieces.append(_expand_group(pattern[open_at + 1 : close_at], pattern))
        pos = close_at + 1
    return pieces


def _expand_group(group: str, pattern: str) -> list[str]:
    if not group.strip():
        raise ValueError(f"empty brackets '[]' in host pattern {pattern!r}")
    values: list[str] = []
    for item in group.split(","):
        m = _RANGE.match(item.strip())
        if m is None:
            raise ValueError(
                f"malformed range {item!r} in host pattern {pattern!r}: "
                "expected numbers or lo-hi ranges like [001-004,007]"
            )
        lo_text, hi_text = m.group(1), m.group(2)
        if hi_text is None:
            values.append(lo_text)
            continue
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise ValueError(f"range {item!r} in host pattern {pattern!r} runs backwards")
        if hi - lo >= MAX_HOSTS:
            raise ValueError(
                f"range {item!r} in host pattern {pattern!r} has more than {MAX_HOSTS:,} hosts"
            )
        width = len(lo_text)
        values.extend(f"{n:0{width}d}" for n in range(lo, hi + 1))
    return values


def _expand_pattern(pattern: str) -> Iterator[str]:
    pieces = _parse_pattern(pattern)
    for combo in itertools.product(*pieces):
        yield "".join(combo)
