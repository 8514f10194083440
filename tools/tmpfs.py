"""A small tmpfs for "the disk is full" tests (standard library only; needs root or
CAP_SYS_ADMIN). Loaded by path like the other tools::

    tmpfs = load("tools/tmpfs.py")
    try:
        with tmpfs.mounted(tmp_path / "tiny", "8m") as mnt:
            ...                        # writes under mnt fail with ENOSPC past 8 MiB
    except tmpfs.Unavailable as e:
        pytest.skip(str(e))

The mount is lazily unmounted on exit, also when the block raises.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


class Unavailable(RuntimeError):
    """The tmpfs could not be mounted here (the message says why)."""


@contextlib.contextmanager
def mounted(path: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (e.g. ``"16m"``) at ``path`` (created if missing)."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise Unavailable(
            f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}); needs root"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
