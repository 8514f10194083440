"""Run a command with a private temp folder and fail when it leaves anything behind there.

Standard library only. nox runs every test session through it, so a test that leaks a temp file
(a ``mkdtemp`` never removed, a server's log, torchrun's ``torchelastic_*`` folder) fails the
session with the names of what it left, instead of filling the system temp folder run after run::

    python tools/tempguard.py -- python -m pytest packages/parquetlm/tests

The command (and every process it starts, which inherits ``TMPDIR``) gets a fresh folder
``$TMPDIR/tg-XXXXXXXX`` as its temp folder, and ``SLURMCLOCK_DIR`` points inside it: a test whose
runs write slurmclock job timelines without a folder of their own would otherwise fill the
user's ``~/.cache/slurmclock``; here they are leftovers like any other. Afterwards:

- the command failed: its exit code is returned and the folder is kept for inspection (pytest
  keeps the ``tmp_path`` of failed tests there);
- it passed and left nothing: exit 0. Two per-user folders with a fixed name count as nothing
  while they hold no file: pytest's ``pytest-of-USER`` (the root pyproject sets
  ``tmp_path_retention_policy = "failed"``, so a passing run empties it) and torch's
  ``torchinductor_USER`` (created empty on import of parts of torch, reused by every run);
- it passed but left something: one line per entry, the folder is removed, exit 1.

Being private, the folder also keeps the check exact on a shared machine where other users'
programs write to ``/tmp`` at the same time.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence

PREFIX = "tg-"  # short: sockets made under it must stay within 108 characters
# Fixed-name folders that tools create once and reuse: fine while they hold no file.
EMPTY_IS_NOTHING = ("pytest-of-", "torchinductor_")
LEAK_EXIT = 1
# SLURMCLOCK_DIR of the command: slurmclock's job timelines that no test pointed elsewhere.
TIMELINES = "slurmclock-timelines"


def _size(path: str) -> int:
    if not os.path.isdir(path) or os.path.islink(path):
        return os.lstat(path).st_size
    return sum(_lsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def _lsize(path: str) -> int:
    with contextlib.suppress(OSError):  # removed while we walked
        return os.lstat(path).st_size
    return 0


def _holds_files(path: str) -> bool:
    """True when the tree under ``path`` has anything but (nested) empty folders."""
    return any(files for _, _, files in os.walk(path))


def leftovers(folder: str) -> list[str]:
    """What a run left in ``folder``: every entry but the EMPTY_IS_NOTHING folders without files."""
    out = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.startswith(EMPTY_IS_NOTHING) and os.path.isdir(path) and not _holds_files(path):
            continue
        out.append(name)
    return out


def describe(folder: str, names: Sequence[str]) -> str:
    lines = [
        f"the tests left {len(names)} entr{'y' if len(names) == 1 else 'ies'} in their temp "
        "folder; each test must remove what it creates (use pytest's tmp_path, or point a "
        "child's TMPDIR at it):"
    ]
    for name in names:
        path = os.path.join(folder, name)
        kind = "folder" if os.path.isdir(path) and not os.path.islink(path) else "file"
        hint = "; job timelines: set SLURMCLOCK_DIR to the test's tmp_path" * (name == TIMELINES)
        lines.append(f"  {name}  ({kind}, {_size(path):,} bytes{hint})")
    return "\n".join(lines)


def run(argv: Sequence[str], *, parent: str | None = None) -> int:
    """Run ``argv`` with a private TMPDIR under ``parent`` (default: the system temp folder)."""
    if not argv:
        raise ValueError("tempguard needs a command: python tools/tempguard.py -- CMD [ARGS...]")
    folder = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
    env = dict(os.environ, TMPDIR=folder, TEMP=folder, TMP=folder)
    env["SLURMCLOCK_DIR"] = os.path.join(folder, TIMELINES)  # never the user's, in a test run
    try:
        code = subprocess.call(list(argv), env=env)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    if code != 0:
        print(f"tempguard: the command failed; its temp folder is kept: {folder}", file=sys.stderr)
        return code
    names = leftovers(folder)
    if names:
        print(f"tempguard: {describe(folder, names)}", file=sys.stderr)
    shutil.rmtree(folder, ignore_errors=True)
    return LEAK_EXIT if names else 0


def main(args: Sequence[str]) -> int:
    argv = list(args)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0] + "\nusage: python tools/tempguard.py -- CMD [ARGS...]")
        return 0 if argv else 2
    return run(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
