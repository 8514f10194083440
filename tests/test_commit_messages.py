"""The commit-message habit, checked on every commit since this round's base.

A commit's subject is what ``git log --oneline``, ``git blame`` views and review tools show: at
most 72 characters, so that it reads whole in a terminal and in a merge list. A commit that is
not a merge has a body (after a blank line) that says *why*: the subject says what changed, the
diff how, and only the body keeps the reason a later reader needs. A merge's "why" is in the
commits it brings in, so a merge needs the short subject only.

Commits before :data:`BASE` (``b502c31``, "the supervisor moves into slurmclock/supervisor/")
are history and stay as they are (most are one long subject line); the rule holds from it on.
CI runs on a full clone; a checkout without git, or a shallow one that lacks the base, cannot
tell which commits are new and skips with the reason.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE = "b502c31"
SUBJECT_MAX = 72


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60, check=False
    )


def commits_since_base() -> list[tuple[str, bool, str]]:
    """``(sha, is_merge, message)`` of every commit after :data:`BASE` up to HEAD."""
    if shutil.which("git") is None or git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout: no commits to check")
    if git("cat-file", "-e", f"{BASE}^{{commit}}").returncode != 0:
        pytest.skip(f"the base commit {BASE} is not in this clone (shallow?): fetch the history")
    out = git("log", "--format=%H %P%x1f%B%x1e", f"{BASE}..HEAD")
    assert out.returncode == 0, out.stderr
    found = []
    for record in filter(str.strip, out.stdout.split("\x1e")):
        head, _, message = record.strip("\n").partition("\x1f")
        sha, *parents = head.split()
        found.append((sha, len(parents) > 1, message))
    return found


def problems(message: str, *, merge: bool) -> list[str]:
    """What is wrong with one commit message (empty: nothing)."""
    lines = message.strip("\n").splitlines()
    subject = lines[0] if lines else ""
    found = []
    if len(subject) > SUBJECT_MAX:
        found.append(f"subject is {len(subject)} characters (at most {SUBJECT_MAX})")
    if not merge and (len(lines) < 3 or lines[1].strip()):
        found.append("no body after a blank line saying why")
    return found


def test_commit_subjects_are_short_and_commits_say_why() -> None:
    bad = [
        f"{sha[:9]} {message.splitlines()[0][:60]!r}: {'; '.join(found)}"
        for sha, merge, message in commits_since_base()
        if (found := problems(message, merge=merge))
    ]
    assert not bad, (
        "commit messages since the base break the habit (subject <= 72 characters, a blank line, "
        "a body that says why; git commit --amend or rebase your own branch to fix):\n"
        + "\n".join(bad)
    )


@pytest.mark.parametrize(
    ("message", "merge", "expected"),
    [
        ("short subject\n\nwhy it was needed\n", False, 0),
        ("short subject\n", False, 1),
        ("short subject\nno blank line\nbody\n", False, 1),
        ("x" * 73 + "\n\nwhy\n", False, 1),
        ("x" * 73 + "\n", False, 2),
        ("Merge h-house: short\n", True, 0),
        ("Merge " + "x" * 80 + "\n", True, 1),
    ],
)
def test_the_check_can_fail(message: str, merge: bool, expected: int) -> None:
    assert len(problems(message, merge=merge)) == expected
