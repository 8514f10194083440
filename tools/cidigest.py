"""Why a CI run failed, in its last lines (standard library only).

CI keeps only the tail of a run's output, and the tail is the last session's: a failure in an
earlier session showed there as ``nox > * parquetlm: failed`` and nothing else. ``.ci/run``
tees the test command's output to a file and, when the command fails, ends with this digest::

    python3 tools/cidigest.py LOG

It prints, per nox session that failed, the lines that say why: pytest's ``FAILED``/``ERROR``
summary lines, its first ``E`` lines, tempguard's leftovers, and a failed command (an install
that did not work). The log is read line by line, each line cut to :data:`WIDTH` characters and
at most :data:`PER_SESSION` lines are kept per session, so a huge or garbled log stays a short
digest. Exit 0 always: the digest only explains; the command's own exit code is CI's.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable

WIDTH = 300
PER_SESSION = 40
FIRST_E_LINES = 12  # pytest's "E   ..." lines kept per session (the first failure's detail)
_SESSION = re.compile(r"^nox > Running session (\S+)")
_FAILED = re.compile(r"^nox > Session (\S+) (?:failed|aborted|raised)")
_WHY = re.compile(r"^(?:FAILED |ERROR |tempguard: |nox > Command .* failed|E\s{2,}\S)")


def digest(lines: Iterable[str]) -> list[str]:
    """The digest's lines: for each session that failed, its name and the lines that say why."""
    kept: dict[str, list[str]] = {}
    e_lines: dict[str, int] = {}
    failed: list[str] = []
    session = "(before any session)"
    for raw in lines:
        line = raw.rstrip("\r\n")[:WIDTH]
        if m := _SESSION.match(line):
            session = m.group(1)
            continue
        if m := _FAILED.match(line):
            if m.group(1) not in failed:
                failed.append(m.group(1))
            continue
        if not _WHY.match(line):
            continue
        if line.startswith("E "):
            e_lines[session] = e_lines.get(session, 0) + 1
            if e_lines[session] > FIRST_E_LINES:
                continue
        got = kept.setdefault(session, [])
        if len(got) < PER_SESSION:
            got.append(line)
    out = [f"CI digest: {len(failed)} session(s) failed: {', '.join(failed) or 'none named'}"]
    for name in failed or list(kept):
        out.append(f"--- {name}")
        out += [f"  {ln}" for ln in kept.get(name, ["(no FAILED/ERROR line: see its log)"])]
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 tools/cidigest.py LOG", file=sys.stderr)
        return 2
    try:
        with open(argv[0], encoding="utf-8", errors="replace") as f:
            print("\n".join(digest(f)))
    except OSError as e:
        print(f"cidigest: cannot read {argv[0]!r} ({e.strerror}); no digest", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
