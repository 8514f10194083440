"""Running SLURM's client commands, injectably (submitit's habit).

A :data:`Runner` is any callable ``(argv, timeout) -> stdout``. It raises :class:`CommandError`
when the command is missing, fails, or runs past ``timeout``. Tests pass a fake runner that
returns canned ``squeue``/``scontrol`` output (or raises), so no test sleeps or needs SLURM.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Protocol

__all__ = ["CommandError", "Runner", "SubprocessRunner", "default_runner", "last_line"]


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


class Runner(Protocol):
    """Runs ``argv`` and returns its stdout; raises :class:`CommandError` otherwise."""

    def __call__(self, argv: Sequence[str], timeout: float) -> str: ...


class SubprocessRunner:
    """The real runner: ``subprocess.run`` with a timeout, stdin closed, output captured.

    ``env`` replaces the environment of the commands (e.g. one holding ``SLURM_CONF`` for a
    test cluster); None inherits this process's environment.
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = dict(env) if env is not None else None

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        cmd = shlex.join(argv)
        path = (self.env or os.environ).get("PATH")
        if not argv or shutil.which(argv[0], path=path) is None:
            name = argv[0] if argv else "(empty command)"
            raise CommandError(argv, "missing", f"{name} not found on PATH")
        try:
            proc = subprocess.run(
                list(argv),
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
                env=self.env,
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            raise CommandError(argv, "timeout", f"`{cmd}` timed out after {timeout:g} s") from e
        except OSError as e:  # vanished between which() and exec, not executable, ...
            raise CommandError(argv, "missing", f"could not run `{cmd}`: {e}") from e
        if proc.returncode != 0:
            err = last_line(proc.stderr) or last_line(proc.stdout) or "no output"
            raise CommandError(
                argv,
                "failed",
                f"`{cmd}` exited with {proc.returncode}: {err}",
                returncode=proc.returncode,
                stderr=proc.stderr,
            )
        return proc.stdout


default_runner: Runner = SubprocessRunner()
