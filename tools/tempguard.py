"""Run a command with a private temp folder and fail when it leaves anything behind there.

Standard library only. nox runs every test session through it, so a test that leaks a temp file
(a ``mkdtemp`` never removed, a server's log, torchrun's ``torchelastic_*`` folder) fails the
session with the names of what it left, instead of filling the system temp folder run after run::

    python tools/tempguard.py -- python -m pytest packages/parquetlm/tests

The command (and every process it starts, which inherits ``TMPDIR``) gets a fresh folder
``$TMPDIR/tgPID-XXXX`` (PID in base 36: short, sockets are made under it) as its temp folder,
and ``SLURMCLOCK_DIR`` points inside it: a test whose runs write slurmclock job timelines
without a folder of their own would otherwise fill the
user's ``~/.cache/slurmclock``; here they are leftovers like any other. Afterwards:

- it passed and left nothing: exit 0. Two per-user folders with a fixed name count as nothing
  while they hold no file: pytest's ``pytest-of-USER`` (the root pyproject sets
  ``tmp_path_retention_policy = "failed"``, so a passing run empties it) and torch's
  ``torchinductor_USER`` (created empty on import of parts of torch, reused by every run);
- it passed but left something: one line per entry, the folder is removed, exit 1;
- it failed: its exit code is returned and the folder is kept for inspection (pytest keeps the
  ``tmp_path`` of failed tests there) as ``$TMPDIR/tg-failed-DATE-PID``, with its path on
  stderr. Failed runs' folders are bounded: the next run removes all but the newest
  ``KEEP_FAILED`` (a failing session's folder held 137-163 MB in issue 24);
- it was interrupted (SIGINT, SIGTERM, SIGHUP to tempguard): the command gets one SIGINT --
  pytest then tears its fixtures down (local SLURM clusters, S3 servers) -- and the folder is
  removed once nothing runs in it any more; so it is when a signal killed the command (their
  reapers stop the servers a killed pytest left).

The command runs in its own process group, so a Ctrl-C reaches it once, through tempguard,
however often it is pressed, and whatever nox adds (SIGTERM to tempguard 0.3 s after a Ctrl-C,
SIGKILL 0.2 s later). Should tempguard itself be killed, a janitor it started (in a
session of its own) removes the folder once no process started with that ``TMPDIR`` is left; a
run that finds the folder of a killed run with nothing running in it removes it too.

Being private, the folder also keeps the check exact on a shared machine where other users'
programs write to ``/tmp`` at the same time.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from types import FrameType

PREFIX = "tg"
FAILED = "tg-failed-"
KEEP_FAILED = 3
# Fixed-name folders that tools create once and reuse: fine while they hold no file.
EMPTY_IS_NOTHING = ("pytest-of-", "torchinductor_")
LEAK_EXIT = 1
# SLURMCLOCK_DIR of the command: slurmclock's job timelines that no test pointed elsewhere.
TIMELINES = "slurmclock-timelines"
SETTLE_S = 180.0  # how long daemons torn down after a failed command may still take to exit
SETTLE_PASSED_S = 15.0  # after a passing one nothing should run: a process still there leaked
# tg<pid in base 36>-<4 random>: as short as the old tg-XXXXXXXX. Sockets are made under it
# (slurmd's in a test's tmp_path) and a socket's path has at most 108 characters.
_OWNED = re.compile(rf"{PREFIX}([0-9a-z]+)-[0-9a-z]{{4}}")
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


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


# -- who still runs in a folder ----------------------------------------------------------------


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot): with the pid, who it is; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None if not _exists(pid) else "?"


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def users(folder: str) -> list[int]:
    """Processes started with ``folder`` as their TMPDIR (they inherit it: servers, daemons,
    SLURM jobs) or working inside it. Linux (/proc); elsewhere none are known."""
    key, found = f"TMPDIR={folder}".encode(), []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            env = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")  # noqa: SIM115
            cwd = os.readlink(f"/proc/{entry}/cwd")
            if key in env or any(e.startswith(key + b"/") for e in env) or cwd.startswith(folder):
                found.append(int(entry))
    return found


def _named(pids: list[int]) -> str:
    def name(pid: int) -> str:
        with contextlib.suppress(OSError):
            return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:80]  # noqa: SIM115
        return "?"

    return ", ".join(f"pid {pid} ({name(pid).strip()})" for pid in pids[:5])


def wait_unused(folder: str, timeout: float) -> list[int]:
    """Wait until nothing runs in ``folder`` (at most ``timeout`` s); who still does."""
    end = time.monotonic() + timeout
    while (busy := users(folder)) and time.monotonic() < end:
        time.sleep(0.5)
    return busy


# -- the folders of earlier runs ---------------------------------------------------------------


def sweep(parent: str) -> list[str]:
    """Remove what earlier runs could not: the folders of killed runs (their tempguard is gone
    and nothing runs in them) and all but the newest KEEP_FAILED failed runs' folders. Returns
    one line per removed folder."""
    said = []
    names = sorted(os.listdir(parent))
    for name in names:
        m = _OWNED.fullmatch(name)
        path = os.path.join(parent, name)
        if m and not _exists(int(m.group(1), 36)) and os.path.isdir(path) and not users(path):
            said.append(f"removed the temp folder of a killed run: {path} ({_size(path):,} bytes)")
            shutil.rmtree(path, ignore_errors=True)
    failed = [n for n in names if n.startswith(FAILED) and os.path.isdir(os.path.join(parent, n))]
    for name in failed[: max(0, len(failed) - KEEP_FAILED)]:  # the names sort by date
        path = os.path.join(parent, name)
        said.append(f"removed an older failed run's temp folder: {path}")
        shutil.rmtree(path, ignore_errors=True)
    return said


def keep_failed(folder: str) -> str:
    """Move a failed run's folder to its kept name and drop the oldest beyond KEEP_FAILED."""
    parent = os.path.dirname(folder)
    kept = os.path.join(parent, f"{FAILED}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    os.rename(folder, kept)
    sweep(parent)
    return kept


# -- the janitor: removes the folder when tempguard is killed ----------------------------------


def janitor(folder: str, owner: int, owner_start: str | None) -> int:
    """Wait while ``owner`` (tempguard) lives; if it died without deciding about ``folder``
    (killed: the folder is still there), remove the folder once nothing runs in it."""
    while os.path.isdir(folder) and _start_time(owner) == owner_start:
        time.sleep(0.5)
    if os.path.isdir(folder) and not wait_unused(folder, 3600):
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def _start_janitor(folder: str) -> subprocess.Popen[bytes]:
    me = str(os.getpid())
    return subprocess.Popen(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--janitor",
            folder,
            me,
            str(_start_time(os.getpid())),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C or nox's kill of tempguard must not reach it
        env={k: v for k, v in os.environ.items() if k not in ("TMPDIR", "TEMP", "TMP")},
    )


# -- running the command -----------------------------------------------------------------------


class _Interrupts:
    """Signals to tempguard while the command runs: the first becomes one SIGINT to the
    command's process group; the repeats within seconds (a second Ctrl-C, nox's SIGTERM) are
    dropped, a later one (the user insists) becomes SIGTERM."""

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        self.first: float | None = None
        self._old = {s: signal.signal(s, self._on) for s in _SIGNALS}

    def _on(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.child is None or self.child.poll() is not None:
            self.first = self.first or now
            return
        if self.first is None:
            self.first = now
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.child.pid, signal.SIGINT)  # pytest: teardown, then exit 2
        elif now - self.first > 5:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.child.pid, signal.SIGTERM)

    def restore(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)


def owned_name(pid: int) -> str:
    """A fresh folder name that says which tempguard process owns it."""
    digits = ""
    while pid:
        pid, d = divmod(pid, 36)
        digits = _DIGITS[d] + digits
    return f"{PREFIX}{digits or '0'}-{''.join(random.choices(_DIGITS, k=4))}"


def _make_folder(parent: str) -> str:
    for _ in range(100):
        folder = os.path.join(parent, owned_name(os.getpid()))
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
            return folder
    raise FileExistsError(f"no free temp folder name under {parent}")


def run(argv: Sequence[str], *, parent: str | None = None) -> int:
    """Run ``argv`` with a private TMPDIR under ``parent`` (default: the system temp folder)."""
    if not argv:
        raise ValueError("tempguard needs a command: python tools/tempguard.py -- CMD [ARGS...]")
    parent = parent or tempfile.gettempdir()
    for line in sweep(parent):
        print(f"tempguard: {line}", file=sys.stderr)
    folder = _make_folder(parent)
    env = dict(os.environ, TMPDIR=folder, TEMP=folder, TMP=folder)
    env["SLURMCLOCK_DIR"] = os.path.join(folder, TIMELINES)  # never the user's, in a test run
    janitor_proc = _start_janitor(folder)
    interrupts = _Interrupts()  # before the command starts: it gets default signal actions
    try:
        # Its own process group: a signal reaches it once, through _Interrupts.
        interrupts.child = subprocess.Popen(list(argv), env=env, preexec_fn=os.setpgrp)
        code = interrupts.child.wait()
        # Killed by a signal (code < 0), as much as interrupted: nothing to keep for a look.
        return _verdict(folder, code, interrupted=interrupts.first is not None or code < 0)
    finally:
        interrupts.restore()
        janitor_proc.terminate()
        janitor_proc.wait()


def _verdict(folder: str, code: int, *, interrupted: bool) -> int:
    # Servers and clusters still stopping (a killed command's reapers): wait for them.
    busy = wait_unused(folder, SETTLE_S if code else SETTLE_PASSED_S)
    if busy:
        print(f"tempguard: still running with TMPDIR={folder}: {_named(busy)}", file=sys.stderr)
        code = code or LEAK_EXIT
    if interrupted:
        shutil.rmtree(folder, ignore_errors=True)
        print(f"tempguard: interrupted; removed its temp folder {folder}", file=sys.stderr)
        return code if code > 0 else 128 - code if code < 0 else 130
    if code != 0:
        kept = keep_failed(folder)
        print(
            f"tempguard: the command failed; its temp folder is kept: {kept} (the newest "
            f"{KEEP_FAILED} failed runs' are; the next run removes older ones)",
            file=sys.stderr,
        )
        return code
    names = leftovers(folder)
    if names:
        print(f"tempguard: {describe(folder, names)}", file=sys.stderr)
    shutil.rmtree(folder, ignore_errors=True)
    return LEAK_EXIT if names else 0


def main(args: Sequence[str]) -> int:
    argv = list(args)
    if argv[:1] == ["--janitor"] and len(argv) == 4:
        return janitor(argv[1], int(argv[2]), None if argv[3] == "None" else argv[3])
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0] + "\nusage: python tools/tempguard.py -- CMD [ARGS...]")
        return 0 if argv else 2
    return run(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
