"""The batch node lost: a sentinel on another node of the job requeues it.

The batch script and the supervisor run on one node of the allocation, the *batch node*. When
it is lost nothing on it can act: SLURM 22.05 ends a ``--no-kill`` job whose batch node is set
DOWN as FAILED (measured: ``Removing failed node`` then the batch step killed, ``Reason=
JobLaunchFailure``; ``--requeue`` does not requeue it), and a batch node that crashed leaves
the job RUNNING on the other nodes with nothing using them until SLURM marks it DOWN
(``SlurmdTimeout``), when it ends the same way.

So for a job of several nodes the supervisor starts a *sentinel*: one tiny step
(the scheduler's :meth:`~slurmclock.Scheduler.helper_command`; SLURM: ``srun --overlap -N1
-n1``), named :data:`SENTINEL_NAME`, on a node that is not the batch node, running this
module's :func:`main`. The supervisor touches a heartbeat file
beside the job's timeline every :data:`BEAT_S`. The sentinel acts once, when

- SLURM ends the job (its SIGTERM to every step: the sentinel has ``KillWait`` seconds) and the
  batch node has left the job's node list or is DOWN/FAIL/not responding in SLURM; or
- the heartbeat is older than :data:`SILENT_S` and the batch node is gone in SLURM the same way
  (a crash, once SLURM noticed; a supervisor merely slow is never requeued).

It requeues the job (``scontrol requeue`` also takes a FAILED job back), and writes what it saw
to the job's timeline (a ``node`` event with ``batch=1`` and the ``requeued`` event), which the
next allocation's supervisor names in its job log as its first line about the run before
(:func:`batch_node_lost`): the job log of the lost run ends on the dead node's side. A SIGTERM
with the batch node healthy (the time limit, ``scancel``, the job's end) leaves quietly; the
supervisor writes the stop file as it ends, and the sentinel leaves at once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from slurmclock.commands import CommandError
from slurmclock.job import Scheduler
from slurmclock.requeue import requeue
from slurmclock.schedulers import default_scheduler
from slurmclock.supervisor.nodestates import no_resize_scripts
from slurmclock.timeline import Event, JobTimeline
from slurmclock.untrusted import quote

__all__ = [
    "BEAT_S",
    "SENTINEL_NAME",
    "SILENT_S",
    "Sentinel",
    "SentinelStep",
    "batch_node_lost",
    "main",
]

SENTINEL_NAME = "slurmclock-sentinel"
BEAT_S = 5.0  # the supervisor's heartbeat
SILENT_S = 30.0  # a heartbeat this old: the sentinel asks SLURM about the batch node
_TICK_S = 0.5
# Not `-m slurmclock.supervisor.sentinel`: the package imports this module first (runpy warns).
_MAIN = "import sys; from slurmclock.supervisor.sentinel import main; sys.exit(main())"
_GONE = ("down", "fail", "maint", "boot", "reboot", "pow", "inval")


class Sentinel:
    """Watches ``batch`` (the batch node) of ``job`` from another node; see the module."""

    def __init__(
        self,
        job: str,
        batch: str,
        *,
        beat: Path,
        stop: Path,
        scheduler: Scheduler,
        timeline: JobTimeline,
        timeout: float = 10.0,
        silent: float = SILENT_S,
    ) -> None:
        self.job, self.batch, self.beat, self.stop = job, batch.split(".")[0], beat, stop
        self.scheduler, self.timeline, self.timeout, self.silent = (
            scheduler,
            timeline,
            timeout,
            silent,
        )
        self.term = False

    def batch_gone(self) -> tuple[str, str] | None:
        """(state, reason) of the batch node when SLURM shows it lost to the job; None when it
        is in the job and answering (or SLURM cannot say: never requeue on a guess)."""
        try:
            view = self.scheduler.show_job(self.job, timeout=self.timeout)
            listed = self.scheduler.nodes(view.partition, timeout=self.timeout)
            in_job = self.scheduler.hostnames(view.nodes, timeout=self.timeout)
        except CommandError:
            return None
        node = next((n for n in listed if n.name.split(".")[0] == self.batch), None)
        state, reason = (node.state, node.reason) if node is not None else ("", "")
        low = state.lower()
        if in_job and self.batch not in {h.split(".")[0] for h in in_job}:
            return state or "not in the job", reason
        if low.startswith(_GONE) or low.endswith("*"):
            return state, reason
        return None

    def silent_for(self) -> float:
        try:
            return time.time() - self.beat.stat().st_mtime
        except OSError:
            return 0.0  # no beat yet: the supervisor has not started it

    def watch(self) -> int:
        """Until the stop file, a requeue, or the end of the job; the exit status."""
        signal.signal(signal.SIGTERM, self._on_term)
        for warning in (signal.SIGUSR1, signal.SIGUSR2):  # `--signal=USR2@N` reaches every step
            signal.signal(warning, signal.SIG_IGN)
        looked = 0.0
        while not self.stop.exists():
            if self.term:
                return self._act("SLURM ended the job") or 0
            now = time.monotonic()
            if self.silent_for() > self.silent and now - looked >= BEAT_S:
                looked = now
                silent = f"the supervisor is silent for {self.silent_for():.0f} s"
                if (code := self._act(silent, quiet=True)) is not None:
                    return code
            time.sleep(_TICK_S)
        return 0

    def _on_term(self, signum: int, frame: object) -> None:
        self.term = True

    def _act(self, why: str, *, quiet: bool = False) -> int | None:
        gone = self.batch_gone()
        if gone is None:
            return None if quiet else 0
        state, reason = gone
        said = f", reason {quote(reason)}" if reason else ""
        self.timeline.mark(
            "node",
            node=self.batch,
            state=state,
            reason=reason,
            kind="gone",
            batch=1,
            why=why,
            sentinel=socket.gethostname(),
        )
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # SLURM's, as it takes the requeue
        result = requeue(self.job, scheduler=self.scheduler, timeline=self.timeline)
        print(
            f"slurmclock sentinel: batch node {self.batch} is {quote(state)} in SLURM{said} "
            f"({why}): {result.message}",
            file=sys.stderr,
            flush=True,
        )
        return 0 if result.ok else 1


def batch_node_lost(events: Sequence[Event]) -> str | None:
    """The line that names the run before as ended by its batch node's loss (the sentinel's
    ``node`` event with ``batch=1`` after the run's ``start``); None when it was not."""
    start = max((i for i, ev in enumerate(events) if ev.name == "start"), default=None)
    if start is None:
        return None
    for ev in events[start + 1 :]:
        if ev.name == "node" and ev.info.get("batch") == 1:
            state, reason = str(ev.info.get("state", "")), str(ev.info.get("reason", ""))
            said = f", reason {quote(reason)}" if reason else ""
            return (
                f"run {ev.restart} lost its batch node {quote(str(ev.info.get('node', '')))} "
                f"({quote(state)} in SLURM{said}): requeued by the sentinel on "
                f"{quote(str(ev.info.get('sentinel', '')))}; not counted as a failure"
            )
    return None


class SentinelStep:
    """The supervisor's side: the heartbeat (a thread touching ``beat`` every :data:`BEAT_S`)
    and the sentinel's step, launched as ``scheduler`` says with ``env`` on a node of
    ``hosts`` that is neither ``here`` nor lost; ``log`` gets one line per start. Nothing
    without the scheduler's launcher on PATH."""

    def __init__(
        self, scheduler: Scheduler, job: str, here: str, files: tuple[Path, Path],
        env: Mapping[str, str], log: Callable[[str], None],
    ) -> None:  # fmt: skip
        self.scheduler, self.job, self.here = scheduler, job, here.split(".")[0]
        self.env, self.log = dict(env), log
        self.beat, self.stop_file = files
        self.proc: subprocess.Popen[bytes] | None = None
        self._done = threading.Event()
        self._beating: threading.Thread | None = None

    def ensure(self, hosts: Sequence[str], lost: set[str]) -> None:
        """A sentinel runs on a node other than this one (started again when its node went)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        others = [h for h in hosts if h.split(".")[0] not in lost | {self.here}]
        if not others:
            return
        node = others[-1]  # the last: a hot spare where there is one
        watch = [sys.executable, "-c", _MAIN, "--job", self.job, "--batch-node", self.here]
        watch += ["--beat", str(self.beat), "--stop", str(self.stop_file)]
        argv = self.scheduler.helper_command(self.job, node, watch, name=SENTINEL_NAME)
        launcher = shutil.which(argv[0], path=self.env.get("PATH")) if argv else None
        if launcher is None:
            return
        argv[0] = launcher
        self.stop_file.unlink(missing_ok=True)
        self._beat_on()
        try:
            self.proc = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL)
        except OSError as e:
            self.log(f"cannot start the sentinel of the batch node: {e}")
            return
        self.log(f"sentinel on {node}: requeues the job should this node ({self.here}) be lost")

    def _beat_on(self) -> None:
        if self._beating is not None:
            return

        def beat() -> None:
            while not self._done.is_set():
                try:
                    self.beat.touch()
                except OSError:
                    pass  # the sentinel sees a silence, and asks SLURM before it acts
                self._done.wait(BEAT_S)

        self._beating = threading.Thread(target=beat, daemon=True)
        self._beating.start()

    def stop(self) -> None:
        """As the supervisor ends: the sentinel told to leave and its step ended, waiting at
        most 2 s (an srun whose node is lost would hold the batch script, and with it the
        requeue updates that must land within seconds of its end; SLURM ends what is left)."""
        self._done.set()
        self.beat.unlink(missing_ok=True)
        if self.proc is None:
            return
        try:
            self.stop_file.touch()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=2 * _TICK_S)
        except subprocess.TimeoutExpired:
            self.proc.terminate()  # srun passes it on; the sentinel sees the node healthy
            try:
                self.proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                return
        self.stop_file.unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurmclock.supervisor.sentinel")
    parser.add_argument("--job", required=True)
    parser.add_argument("--batch-node", required=True)
    parser.add_argument("--beat", required=True, type=Path)
    parser.add_argument("--stop", required=True, type=Path)
    parser.add_argument("--silent", type=float, default=SILENT_S)
    args = parser.parse_args(argv)
    sentinel = Sentinel(
        args.job,
        args.batch_node,
        beat=args.beat,
        stop=args.stop,
        scheduler=default_scheduler(no_resize_scripts()),
        timeline=JobTimeline(env=os.environ),
        silent=args.silent,
    )
    return sentinel.watch()


if __name__ == "__main__":
    sys.exit(main())
