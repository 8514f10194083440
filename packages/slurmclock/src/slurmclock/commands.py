"""Running SLURM's client commands, injectably (submitit's habit).

A :data:`Runner` is any callable ``(argv, timeout) -> stdout``. It raises :class:`CommandError`
when the command is missing, fails, or runs past ``timeout``. Tests pass a fake runner that
returns canned ``squeue``/``scontrol`` output (or raises), so no test sleeps or needs SLURM.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

__all__ = [
    "CommandError",
    "Runner",
    "SubprocessRunner",
    "command_bound",
    "default_runner",
    "last_line",
    "transient",
]

_TICK_S = 0.1  # how often a command's wait looks at ``cancel``
_FIRST_PAUSE_S = 0.5  # before the second try of a transient failure; doubling
# What SLURM's clients print when slurmctld is busy, restarting or unreachable for a moment.
_TRANSIENT_WORDS = (
    "socket timed out",
    "unable to contact slurm controller",
    "connection refused",
    "resource temporarily unavailable",
    "zero bytes were transmitted",
    "backup controller in standby",
)


def command_bound(
    left: float | None, *, ceiling: float = 30.0, share: float = 0.1, floor: float = 3.0
) -> float:
    """Seconds one scheduler command may take with ``left`` seconds before the deadline (None:
    unknown): ``share`` of the time left, at most ``ceiling``, at least ``floor`` (never over
    ``ceiling``). A hung slurmctld must not eat the time the final save and a requeue need."""
    if left is None or not math.isfinite(left):
        return ceiling
    return min(ceiling, max(floor, share * left))


def last_line(text: str) -> str:
    """The last non-empty line of a command's output: SLURM's clients end with the line that
    says why (``squeue: fatal: ...``), after lines of detail a one-line message does not need."""
    return next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")


class CommandError(Exception):
    """A command could not give its output.

    ``kind`` says why: ``"missing"`` (binary not on PATH), ``"failed"`` (non-zero exit, see
    ``returncode`` and ``stderr``) or ``"timeout"``; from a :class:`slurmclock.job.Scheduler`
    also ``"output"`` (the command answered something that cannot be read: the message says
    what) and ``"error"`` (an injected runner raised something else: its bug, in the message).
    """

    def __init__(
        self,
        argv: Sequence[str],
        kind: str,
        message: str,
        *,
        returncode: int | None = None,
        stderr: str = "",
    ) -> None:
        super().__init__(message)
        self.argv = tuple(argv)
        self.kind = kind
        self.returncode = returncode
        self.stderr = stderr


def transient(e: CommandError) -> bool:
    """Is ``e`` worth another try: slurmctld did not answer in time, or said it is busy,
    restarting or unreachable? A missing command, output that cannot be read and every other
    refusal (no such job, permission denied) are permanent: said once, never retried."""
    if e.kind == "timeout":
        return True
    if e.kind != "failed" or (e.returncode is not None and e.returncode < 0):
        return False
    said = f"{e.stderr}\n{e}".lower()
    return any(words in said for words in _TRANSIENT_WORDS)


class Runner(Protocol):
    """Runs ``argv`` and returns its stdout; raises :class:`CommandError` otherwise."""

    def __call__(self, argv: Sequence[str], timeout: float) -> str: ...


class SubprocessRunner:
    """The real runner: a subprocess with a timeout, stdin closed, output captured.

    ``env`` replaces the environment of the commands (e.g. one holding ``SLURM_CONF`` for a
    test cluster); None inherits this process's environment. ``bound`` (seconds, asked at each
    call) caps every caller's timeout -- the supervisor derives it from the time left -- and
    then a transient failure (:func:`transient`) is tried again, after a pause doubling from
    0.5 s, while the bound lasts. ``cancel`` is asked every 0.1 s while a command runs: True
    (a stop signal came) ends the wait at once, the command killed (kind ``timeout``).
    ``last_unanswered``: when a command last got no answer (ran out of time, or slurmctld was
    still busy when the bound ran out; ``time.monotonic()``), or None.
    """

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        *,
        bound: Callable[[], float] | None = None,
        cancel: Callable[[], bool] | None = None,
    ) -> None:
        self.env = dict(env) if env is not None else None
        self.bound = bound
        self.cancel = cancel
        self.last_unanswered: float | None = None

    def bounded(
        self, *, bound: Callable[[], float], cancel: Callable[[], bool]
    ) -> SubprocessRunner:
        """This runner (its environment) with a ``bound`` and a ``cancel``."""
        return SubprocessRunner(self.env, bound=bound, cancel=cancel)

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        path = (self.env or os.environ).get("PATH")
        if not argv or shutil.which(argv[0], path=path) is None:
            name = argv[0] if argv else "(empty command)"
            raise CommandError(argv, "missing", f"{name} not found on PATH")
        if self.bound is None:
            return self._once(argv, timeout)
        limit = min(timeout, self.bound())
        end, pause = time.monotonic() + limit, _FIRST_PAUSE_S
        while True:
            try:
                return self._once(argv, max(end - time.monotonic(), _TICK_S))
            except CommandError as e:
                if not self._again(e, end, pause):
                    raise
            pause *= 2

    def _again(self, e: CommandError, end: float, pause: float) -> bool:
        """Try once more, after ``pause`` (slept here, ended by ``cancel``)?"""
        if e.kind == "timeout" or not transient(e):
            return False
        if time.monotonic() + pause >= end:
            self.last_unanswered = time.monotonic()  # slurmctld still busy: no answer
            return False
        resume = time.monotonic() + pause
        while (left := resume - time.monotonic()) > 0:
            if self._cancelled():
                return False
            time.sleep(min(left, _TICK_S))
        return not self._cancelled()

    def _cancelled(self) -> bool:
        return self.cancel is not None and bool(self.cancel())

    def _once(self, argv: Sequence[str], timeout: float) -> str:
        cmd = shlex.join(argv)
        try:
            proc = subprocess.Popen(
                list(argv),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                stdin=subprocess.DEVNULL,
                env=self.env,
            )
        except OSError as e:  # vanished between which() and exec, not executable, ...
            raise CommandError(argv, "missing", f"could not run `{cmd}`: {e}") from e
        out, err = self._wait(proc, argv, timeout)
        if proc.returncode != 0:
            why = last_line(err) or last_line(out) or "no output"
            raise CommandError(
                argv,
                "failed",
                f"`{cmd}` exited with {proc.returncode}: {why}",
                returncode=proc.returncode,
                stderr=err,
            )
        return out

    def _wait(
        self, proc: subprocess.Popen[str], argv: Sequence[str], timeout: float
    ) -> tuple[str, str]:
        """stdout and stderr of ``proc``; killed at ``timeout`` or when cancelled."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            try:
                return proc.communicate(timeout=min(left, _TICK_S) if self.cancel else left)
            except subprocess.TimeoutExpired:
                stopped = self._cancelled()
                if stopped or time.monotonic() >= end:
                    proc.kill()
                    proc.communicate()
                    if not stopped:
                        self.last_unanswered = time.monotonic()
                    cmd = shlex.join(argv)
                    why = (
                        "was abandoned: a stop signal came"
                        if stopped
                        else f"timed out after {timeout:.3g} s"
                    )
                    raise CommandError(argv, "timeout", f"`{cmd}` {why}") from None


default_runner: Runner = SubprocessRunner()
