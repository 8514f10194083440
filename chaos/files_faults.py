"""The faults of chaos/test_files.py: what can sit at a path one process writes and another
reads, each one row (a new fault is one entry of :data:`FAULTS`).

A fault either *writes* hostile lines into the file (appended after a good line, so a reader
must skip the bad one and go on) or *replaces* the file by something that is not a regular file
(a reader must refuse it without waiting on it). ``finishes`` runs a reader in a thread and
fails when it has not returned in time: a blocked read is a failed row, not a hung suite. It and
the file builders are slurmclock's tests' own (``untrusted_helpers.py``, loaded by path).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def load(path: Path) -> ModuleType:
    """A helper file by its path (tools and other folders' test helpers are no packages)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_shared = load(ROOT / "packages/slurmclock/tests/untrusted_helpers.py")
finishes: Callable[..., Any] = _shared.finishes
NONREGULAR: dict[str, Callable[[Path], None]] = _shared.NONREGULAR


@dataclass(frozen=True)
class Fault:
    """``lines``: hostile lines written after a good one (None: ``place`` replaces the file)."""

    name: str
    lines: tuple[bytes, ...] | None = None
    place: Callable[[Path], None] | None = None

    @property
    def writes(self) -> bool:
        return self.lines is not None

    def apply(self, path: Path, good: bytes = b"") -> None:
        """Put the fault at ``path`` (after the line ``good`` when it writes lines)."""
        if path.is_symlink() or path.exists():
            path.unlink()
        if self.lines is not None:
            path.write_bytes(good + b"".join(line + b"\n" for line in self.lines))
        else:
            assert self.place is not None
            self.place(path)


FAULTS = [
    Fault("garbage", lines=(b"\x00\xff\xfe garbage {]\x1b[2J",)),
    Fault("huge line", lines=(b'{"event": "x", "pad": "' + b"y" * (4 * 1024 * 1024) + b'"}',)),
    Fault("deep nesting", lines=(b"[" * 200_000 + b"]" * 200_000,)),
    Fault(
        "400-digit number",
        lines=(
            b'{"event": "start", "time": ' + b"9" * 400 + b', "restart": 0}',
            b'{"time": 1' + b"0" * 400 + b'.5, "rank": 1, "host": "n1", "what": "dead"}',
        ),
    ),
    Fault("2 GB sparse file", place=_shared.sparse),
    Fault("FIFO", place=NONREGULAR["fifo"]),
    Fault("/dev/zero symlink", place=NONREGULAR["dev-zero"]),
    Fault("symlink loop", place=NONREGULAR["loop"]),
    Fault("directory", place=NONREGULAR["directory"]),
    Fault(
        "forged host",
        lines=(
            b'{"time": 4000000000.0, "rank": 1, "host": "evil\\n[2026-01-01 00:00:00] '
            b'slurmclock: FORGED\\u001b[2J", "what": "dead", "reporter": 0, "event": "fault", '
            b'"restart": 0}',
        ),
    ),
]
FORGED = "[2026-01-01 00:00:00] slurmclock: FORGED"


def localslurm() -> ModuleType:
    return load(ROOT / "tools/localslurm.py")


# A stand-in trainer: it drives slurmclock's TimeLoop (which reads the job's timeline at start,
# as every trainer does), appends the fault's lines to ddpkit's fault file while it runs, and
# ends 0. The supervisor reads both files while it runs.
STEP = r"""
import os, sys, time
from slurmclock import TimeLoop
lines = open(sys.argv[1], "rb").read() if len(sys.argv) > 1 else b""
fault_file = os.environ.get("DDPKIT_FAULT_FILE")
loop = TimeLoop(watchdog=False, margin=1, initial_save_estimate=0.1)
loop.begin()
for step in range(1, 4):
    time.sleep(0.2)
    loop.after_step(step, last=step == 3)
    if step == 1 and lines and fault_file:
        try:
            fd = os.open(fault_file, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
            os.write(fd, lines)
            os.close(fd)
        except OSError:
            pass  # a FIFO, a directory...: the fault is the path itself
    time.sleep(0.5)
loop.end()
print("stand-in trainer done", flush=True)
"""
