"""What the supervisor decides when a step has ended: pure functions of what it knows.

:func:`classify_term` reads what a SIGTERM to the batch script meant from SLURM's record of the
job; :func:`end_kind` sorts an exit (finished, stopped, the store unreachable, SLURM's doing, a
stop on request, a usage error, a failure); :func:`decide` gives the :class:`Verdict`: end,
restart in this allocation, requeue, or give up -- with the one line the job log gets.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from slurmclock.job import (
    CANCELLED,
    EXIT_STOPPED,
    EXIT_STORE_UNAVAILABLE,
    LIMIT,
    PREEMPTED,
    REQUEUED,
    SLURM_ENDS,
    STOP,
    TERM_KINDS,
    JobState,
    JobView,
)
from slurmclock.supervisor.config import SuperviseConfig
from slurmclock.supervisor.history import Streak, as_int

__all__ = [
    "CHAIN_GOES_ON",
    "NO_ROOM",
    "SRUN_REFUSALS",
    "TERM_KINDS",
    "Room",
    "Verdict",
    "classify_term",
    "decide",
    "describe_status",
    "end_kind",
    "gave_up_line",
    "requeue_or_end",
    "srun_refusal",
    "term_words",
]


def classify_term(view: JobView | None, restart: int, seconds_left: float | None) -> str:
    """What a SIGTERM to the batch script meant: one of :data:`TERM_KINDS`.

    ``view``: the job as SLURM shows it right after the signal (None when scontrol did not
    answer: then only a deadline already passed, ``seconds_left`` <= 2, reads as the limit).
    """
    if view is None:
        return LIMIT if seconds_left is not None and seconds_left <= 2 else STOP
    if view.state == JobState.ACTIVE:
        return STOP
    if view.state == JobState.TIMED_OUT:
        return LIMIT
    if view.restarts is not None and view.restarts > restart:
        return REQUEUED
    if view.state == JobState.QUEUED:
        return REQUEUED
    if view.state == JobState.PREEMPTED:
        return PREEMPTED
    return CANCELLED


def describe_status(rc: int | None) -> str:
    """``exit 1``, ``exit 137 (killed by SIGKILL)``, ``no exit status``."""
    if rc is None:
        return "no exit status"
    if rc > 128:
        try:
            return f"exit {rc} (killed by {signal.Signals(rc - 128).name})"
        except ValueError:
            pass
    return f"exit {rc}"


# What srun prints when it refuses the step's own settings (before any task ran): a setting
# error, not a crash -- a retry gets the same answer (SLURM 22.05's wording, each "srun: ...").
SRUN_REFUSALS = (
    "More processors requested than permitted",
    "Requested node configuration is not available",
    "invalid option",
    "unrecognized option",
    "Invalid generic resource",
    "Invalid node name specified",
    "Invalid job id specified",
    "Unable to allocate resources: Invalid",
    "Invalid numeric value",
    "Memory required by task is not available",
)


# A stop of one job of a chain (submit-chain.sh: afterany) or of an array task: the rest starts.
CHAIN_GOES_ON = (
    "this job is part of a chain or an array, whose later jobs still start and resume from its "
    "checkpoint: to stop them too, scancel them (squeue --me -o '%i %E' lists the jobs that "
    "wait on this one; scancel ARRAY_ID ends an array)"
)


def srun_refusal(text: str) -> str | None:
    """The first line of ``text`` (the job log since the launch) in which srun refused the
    step's settings, or None."""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("srun:") and any(r.lower() in line.lower() for r in SRUN_REFUSALS):
            return line
    return None


def end_kind(rc: int, term: str | None, no_retry: frozenset[int]) -> str:
    """``finished``, ``stopped`` (exit 75), ``store`` (exit 74: the checkpoint store could not
    be reached), ``slurm`` (SLURM ended it: limit, preemption, requeue, cancel), ``requested``
    (slurmclock stop), ``usage`` (a no-retry status) or ``failed``."""
    if term in SLURM_ENDS:
        return "slurm"
    if term == STOP:
        return "requested"
    if rc == 0:
        return "finished"
    if rc == EXIT_STOPPED:
        return "stopped"
    if rc == EXIT_STORE_UNAVAILABLE:
        return "store"
    return "usage" if rc in no_retry else "failed"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do once the step has exited: ``action`` ``end`` (exit with ``code``),
    ``restart`` (start the step again in this allocation), ``requeue`` (exit 0 once SLURM
    accepted, else ``code``) or ``give_up`` (exit ``code``)."""

    action: str
    code: int
    message: str


@dataclass(frozen=True, slots=True)
class Room:
    """Can the step start again in this allocation? ``ok``; ``why``: in words, what the time
    left and a restart's cost are, or why not; ``wait``: seconds before it starts."""

    ok: bool
    why: str = ""
    wait: float = 0.0


NO_ROOM = Room(False)


def decide(
    kind: str,
    rc: int,
    *,
    term: str | None,
    streak: Streak,
    restarts: int,
    config: SuperviseConfig,
    requeued: bool = False,
    here: Room = NO_ROOM,
    store_tries: int = 1,
) -> Verdict:
    """The verdict for a step that exited with ``rc`` (``kind`` from :func:`end_kind`);
    ``streak`` includes this failure; ``requeued``: already requeued when the SIGTERM came;
    ``here``: whether a failure or a store outage can be retried in this allocation;
    ``store_tries``: the store outages (exit 74) in a row in this allocation, this one too."""
    if kind == "slurm":
        return _slurm_ended(term, requeued)
    if kind == "requested":
        if rc in (0, EXIT_STOPPED):
            rest = CHAIN_GOES_ON if config.next_job_resumes else "resume by submitting again"
            return Verdict(
                "end",
                0,
                "stopped on request (SIGTERM to the batch script: slurmclock stop or scancel "
                f"--batch): not requeueing; {rest}",
            )
        return Verdict("end", rc, f"the step ended with {describe_status(rc)} after a stop request")
    if kind == "finished":
        return Verdict("end", 0, "training finished")
    if kind == "usage":
        why = f"{describe_status(rc)}: a usage error, a retry cannot help"
        return Verdict("end", rc, f"training failed ({why})")
    if kind == "stopped":
        return requeue_or_end("stopped early with steps left", EXIT_STOPPED, restarts, config)
    if kind == "store":
        return _store_down(rc, restarts, config, here, store_tries)
    at = "before any checkpoint" if streak.step is None else f"at checkpoint step {streak.step}"
    if streak.count >= config.max_failures:
        return Verdict("give_up", rc, gave_up_line(streak, config))
    why = (
        f"training failed ({describe_status(rc)}, failure {streak.count} of "
        f"{config.max_failures} in a row {at})"
    )
    if here.ok:
        return Verdict("restart", rc, f"{why}: starting it again in this allocation ({here.why})")
    return requeue_or_end(f"{why}; {here.why}" if here.why else why, rc, restarts, config)


def _slurm_ended(term: str | None, requeued: bool) -> Verdict:
    if requeued:
        return Verdict("end", 0, f"already requeued at the {term_words(term)}")
    if term == REQUEUED:
        return Verdict("end", 0, "SLURM requeued this job itself: it comes back by itself")
    if term == CANCELLED:
        return Verdict("end", 0, "the job was cancelled (scancel): not requeueing")
    return Verdict("end", EXIT_STOPPED, f"not requeued at the {term_words(term)}")


def _store_down(
    rc: int, restarts: int, config: SuperviseConfig, here: Room, tries: int = 1
) -> Verdict:
    """Exit 74: nothing was lost and it is not a failure of the run: tried again after a pause
    while the allocation has the time, else in the next one -- unless the outage outlasted
    this allocation's retries (two or more in a row): then a requeue would only wait in the
    queue to meet it again, up to --max-restarts times; one line, and the chain ends."""
    what = "the checkpoint store could not be reached (exit 74: nothing lost, not a failure)"
    if here.ok:
        return Verdict(
            "restart", rc, f"{what}: trying again in {here.wait:.0f} s in this allocation"
        )
    if tries >= 2:
        return Verdict(
            "give_up",
            rc,
            f"gave up: the checkpoint store did not answer through {tries} starts in a row, "
            f"for the rest of this allocation ({here.why or 'no time left'}); not requeueing "
            f"(nothing is lost). Once the store answers, resume: {config.resume_hint}",
        )
    return requeue_or_end(f"{what}; {here.why}" if here.why else what, rc, restarts, config)


def gave_up_line(streak: Streak, config: SuperviseConfig) -> str:
    """The one line that ends a chain: what failed, where, how many times, how to resume."""
    at = "before any checkpoint" if streak.step is None else f"at checkpoint step {streak.step}"
    info = streak.last.info if streak.last is not None else {}
    last = str(info.get("why") or describe_status(as_int(info.get("rc"))))
    where = f" on {info['nodes']}" if info.get("nodes") else ""
    return (
        f"gave up: the training step failed {streak.count} times in a row {at} (last: {last}"
        f"{where}); not requeueing. Fix the cause, then resume: {config.resume_hint}"
    )


def requeue_or_end(why: str, code: int, restarts: int, config: SuperviseConfig) -> Verdict:
    """Requeue (``why`` said first), unless the settings or the restart budget say no."""
    if not config.requeue and config.next_job_resumes:
        done = 0 if code == EXIT_STOPPED else code
        return Verdict("end", done, f"{why}; not requeueing (the next array task / chained job "
                                    "resumes)")  # fmt: skip
    if not config.requeue:
        return Verdict(
            "end",
            code,
            f"{why}; not requeueing (requeue is off); to go on: {config.resume_hint}",
        )
    if restarts >= config.max_restarts:
        return Verdict(
            "end",
            code,
            f"{why}, but already restarted {restarts} times (max restarts): not requeueing",
        )
    if config.successor:  # not a requeue: the supervisor says which job resumes
        return Verdict("requeue", code, f"{why}: handing the run to a successor job")
    return Verdict("requeue", code, f"{why}: requeueing to resume from the newest checkpoint")


def term_words(term: str | None) -> str:
    """``time limit``, ``preemption``; else ``SIGTERM``."""
    return {LIMIT: "time limit", PREEMPTED: "preemption"}.get(term or "", "SIGTERM")
