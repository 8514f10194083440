"""What a failed rank looks like to the others: one record, one line on stderr, one JSON line in
``DDPKIT_FAULT_FILE``.

The file is the contract with the job script and slurmclock's supervisor (DESIGN.md,
"Contracts"): when the watchdog ends a step because a rank died or froze, the rank that saw it
appends ``{"time", "rank", "host", "what", "reporter", "silent_s", "job_id"}`` so the node can be
named and left out of the next allocation. ``time`` is epoch seconds (as the job's timeline has
it), ``what`` is ``"dead"`` (the process or its node is gone) or ``"frozen"`` (the process is
there but silent: stopped, or holding the GIL). A rank that ended with a Python exception is not a
node fault: the others stop for it too, but nothing is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Literal

from ddpkit.errors import DistConfigError

FAULT_FILE_ENV = "DDPKIT_FAULT_FILE"
# The keys of one line of the fault file, in this order (the contract in DESIGN.md).
FAULT_RECORD_KEYS = ("time", "rank", "host", "what", "reporter", "silent_s", "job_id")
# The exit status of every rank the watchdog ends (sysexits' EX_UNAVAILABLE: a peer the job needs
# is gone). Not 1 (this rank's own error), not 75 (stopped with a checkpoint: resume), not 128+N
# (killed by a signal): a job script can tell "a peer failed, retry elsewhere" from all three.
EXIT_PEER_LOST = 69
# What a job script and slurmclock's supervisor read as "stopped with a durable checkpoint, steps
# left: resume" (slurmclock.EXIT_STOPPED; ddpkit cannot import it): the watchdog refuses to end a
# rank with it. tests/contracts/test_job_life.py checks that the two agree.
EXIT_STOPPED = 75

What = Literal["dead", "frozen", "error"]


@dataclass(frozen=True, slots=True)
class Fault:
    """A rank that failed, as its reporter saw it."""

    rank: int | None  # None: the store's host was not a rank (torchrun's agent)
    host: str
    what: What
    reporter: int
    silent_s: float = 0.0
    job_id: str | None = None
    detail: str = ""  # how it was seen (connection closed, store hung) or the error's first line
    time: float = dataclasses.field(default_factory=time.time)  # epoch seconds

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Fault:
        data: dict[str, Any] = json.loads(text)
        fields = {f.name for f in dataclasses.fields(Fault)}
        return Fault(**{k: v for k, v in data.items() if k in fields})

    def who(self) -> str:
        if self.rank is None:
            return f"the rendezvous store's host ({self.host})"
        return f"rank {self.rank} on {self.host}"

    def describe(self) -> str:
        """``rank 1 on node12 is dead (its connection closed, no heartbeat for 0.4 s)``."""
        if self.what == "error":
            return f"{self.who()} ended with an error ({self.detail})"
        how = f"{self.detail}, " if self.detail else ""
        return f"{self.who()} is {self.what} ({how}no heartbeat for {self.silent_s:.1f} s)"

    def file_line(self) -> str:
        """The contract's line: time, rank, host, what, reporter, silent_s, job_id."""
        data = dataclasses.asdict(self)
        data["time"] = round(self.time, 3)
        data["silent_s"] = round(self.silent_s, 1)
        return json.dumps({k: data[k] for k in FAULT_RECORD_KEYS}) + "\n"


def check_fault_file(path: str) -> str:
    """``path`` if a line could be appended there later; else one line saying what to fix."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        raise DistConfigError(f"{FAULT_FILE_ENV}={path!r} is a folder; name a file in it")
    if not os.path.isdir(folder):
        raise DistConfigError(
            f"{FAULT_FILE_ENV}={path!r}: folder {folder} does not exist; create it or point "
            f"{FAULT_FILE_ENV} at a file in an existing folder"
        )
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise DistConfigError(f"{FAULT_FILE_ENV}={path!r} is not writable; fix its permissions")
    return path


def append(path: str, fault: Fault) -> str | None:
    """Append the fault's line (one ``write`` of an O_APPEND file: lines of two reporters never
    interleave on a local file system). None, or why it could not be written."""
    if fault.what == "error":
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, fault.file_line().encode())
        finally:
            os.close(fd)
    except OSError as e:
        return f"{FAULT_FILE_ENV}={path}: {e.strerror or e}"
    return None
