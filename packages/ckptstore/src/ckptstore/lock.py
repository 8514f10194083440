"""One writer per experiment: ``writer.lock`` in the experiment folder.

The writer (rank 0) creates the lock before its first save: a small JSON file naming it (host,
pid, SLURM job and step, since when) that a background thread renews every quarter lease. A
second writer is refused with ``LockedError`` naming the holder. A lock that a dead writer left
is taken over at once, never waited on, when:

- the holder ran in the same SLURM job (``SLURM_JOB_ID``): the job was requeued, or runs a later
  step; SLURM ends a job's processes before it requeues it;
- the holder was an earlier link of this run's chain of jobs (``SLURMCLOCK_CHAIN_ID`` the same,
  ``SLURMCLOCK_CHAIN_INDEX`` lower, another job id; exported by ``slurmclock supervise`` to the
  step and to the successor it submits with ``--dependency=afterany``): SLURM starts a link only
  once the one before it has ended, so its lock is taken over at once, not after its lease (a
  live holder on this host still is not). slurmclock keeps that order for every way a link
  starts (a resubmit with ``--continue`` joins the chain only once SLURM says its newest job
  ended); a successor that waits in the queue while its predecessor runs must not start its
  step before the predecessor has ended, or it would take a live writer's lock;
- the holder ran on this host and its process is gone (a pid reused by another process does not
  count as the holder), or this host rebooted since;
- its lease expired: a holder on another host that stopped renewing (``lease_s``, 60 s).

A live holder on this host is never taken over, not even by the same job. A holder that loses
its lock (it did not renew for longer than its lease, e.g. a suspended process) learns it at its
next renewal, and its next save fails with ``LockedError``.

A lock file removed under a live writer (a cleanup script, ``rm -rf`` of the experiment, a
``ckptstore lock --break``) is not a lost lock: nobody else holds the experiment, so the writer
creates it again, atomically, at its next renewal or save (whichever comes first; every save
checks the lock is still its own) and goes on, with one warning. Only when another run created a
lock in the meantime has this run lost, and it saves nothing more.

What is guaranteed where:

- Local disks, NFS, Lustre: creating the lock is atomic (a hard link of a complete file; O_EXCL
  where the filesystem has no hard links), and so is a takeover (compare-and-swap under a
  breaker file held for milliseconds). Expiry compares clocks of two hosts: keep them in sync.
- S3 (AWS, MinIO, moto): conditional requests (``If-None-Match`` to create, ``If-Match`` to
  renew, take over and release) are atomic where the server implements them; a server that
  ignores them lets two writers that start at the same instant both proceed until the next
  renewal shows one of them that it lost.
- Other fsspec stores (``memory://``, ...): check, write, read back: best effort.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import orjson

from .errors import CheckpointError, LockedError
from .smallfile import UnreadableFileError
from .storage import Storage

log = logging.getLogger("ckptstore")
LOCK_NAME = "writer.lock"
# slurmclock's names (a sibling package: not imported; DESIGN.md's Environment variables table).
CHAIN_ID, CHAIN_INDEX = "SLURMCLOCK_CHAIN_ID", "SLURMCLOCK_CHAIN_INDEX"
DEFAULT_LEASE_S = 60.0
RELEASE_TIMEOUT_S = 10.0
_LIVE: set[str] = set()  # tokens of the locks this process holds right now
_LIVE_MUTEX = threading.Lock()


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {"str": str, "int": int, "float": (int, float)}


@dataclass(frozen=True, slots=True)
class LockInfo:
    """Who writes an experiment: the content of its ``writer.lock``."""

    token: str
    host: str
    pid: int
    since: float  # wall time the lock was taken
    renewed: float  # wall time of the last renewal
    lease_s: float
    job_id: str = ""  # SLURM_JOB_ID
    job_step: str = ""  # SLURM_STEP_ID
    boot_id: str = ""  # tells a reboot of the same host
    pid_start: str = ""  # the process's start time: tells a reused pid from the holder
    chain: str = ""  # SLURMCLOCK_CHAIN_ID: the first job of the run's chain of jobs
    link: int = 0  # SLURMCLOCK_CHAIN_INDEX: the job's place in that chain

    def to_json(self) -> bytes:
        return orjson.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, data: bytes) -> LockInfo:
        body = orjson.loads(data)
        if not isinstance(body, dict):
            raise TypeError("not a JSON object")
        for field in dataclasses.fields(cls):  # another process wrote it: types checked
            value, want = body.get(field.name), _FIELD_TYPES[str(field.type)]
            if field.name in body and (isinstance(value, bool) or not isinstance(value, want)):
                raise TypeError(f"{field.name} is {type(value).__name__}, not {field.type}")
        return cls(**body)

    def describe(self, now: float) -> str:
        job = f", SLURM job {self.job_id}" if self.job_id else ""
        job += f" step {self.job_step}" if self.job_id and self.job_step else ""
        job += f" (link {self.link} of chain {self.chain})" if self.job_id and self.chain else ""
        since = datetime.datetime.fromtimestamp(self.since).isoformat(timespec="seconds")
        ago = max(0.0, now - self.renewed)
        return f"host {self.host} pid {self.pid}{job}, since {since} (renewed {ago:.0f} s ago)"


def whoami(now: float, lease_s: float, env: Mapping[str, str] | None = None) -> LockInfo:
    """This process as a lock holder, with a fresh token."""
    env = os.environ if env is None else env
    pid = os.getpid()
    return LockInfo(
        token=uuid.uuid4().hex,
        host=socket.gethostname(),
        pid=pid,
        since=now,
        renewed=now,
        lease_s=lease_s,
        job_id=env.get("SLURM_JOB_ID", ""),
        job_step=env.get("SLURM_STEP_ID", ""),
        boot_id=_read("/proc/sys/kernel/random/boot_id"),
        pid_start=_pid_start(pid),
        chain=env.get(CHAIN_ID, "").strip()[:64],
        link=_link(env.get(CHAIN_INDEX, "")),
    )


def _link(raw: str) -> int:
    """A chain index as exported (whole digits); 0 for anything else."""
    raw = raw.strip()
    return int(raw) if raw.isdigit() and len(raw) < 10 else 0


def takeover_reason(
    holder: LockInfo, me: LockInfo, now: float, alive: Callable[[LockInfo], bool]
) -> str | None:
    """Why ``me`` may take the lock ``holder`` left, or None (the holder may still write)."""
    here = holder.host == me.host and holder.boot_id == me.boot_id
    if here and alive(holder):
        return None
    if earlier_link(holder, me):
        return (
            f"it was link {holder.link} (SLURM job {holder.job_id}) of this run's chain "
            f"{holder.chain}, which ended before this link {me.link} started"
        )
    if holder.job_id and holder.job_id == me.job_id:
        return f"same SLURM job {holder.job_id} (requeued, or a later step of it)"
    if here:
        return f"its process {holder.pid} on this host is gone"
    if holder.host == me.host and holder.boot_id and me.boot_id:
        return "this host rebooted since"
    if now - holder.renewed > holder.lease_s:
        return f"its lease expired {now - holder.renewed - holder.lease_s:.0f} s ago"
    return None


def earlier_link(holder: LockInfo, me: LockInfo) -> bool:
    """Whether ``holder`` was an earlier job of ``me``'s chain (slurmclock's successor jobs)."""
    return bool(
        holder.chain
        and holder.chain == me.chain
        and holder.link < me.link
        and holder.job_id
        and holder.job_id != me.job_id
    )


def holder_alive(holder: LockInfo) -> bool:
    """Whether the holder's process still runs (asked on the holder's host)."""
    if holder.pid == os.getpid():
        with _LIVE_MUTEX:
            return holder.token in _LIVE  # another store of this very process
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: alive
    return not holder.pid_start or _pid_start(holder.pid) in ("", holder.pid_start)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_start(pid: int) -> str:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot); "" where absent."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else ""


def refusal(holder: LockInfo, url: str, now: float) -> str:
    left = holder.renewed + holder.lease_s - now
    return (
        f"{url} is being written by another run: {holder.describe(now)}. Stop that run or use "
        f"another experiment; if it is dead, its lock is taken over once its lease runs out "
        f"(in {max(left, 0):.0f} s) or when removed with: ckptstore lock {url} --break"
    )


def read_lock(storage: Storage, root: str) -> tuple[LockInfo, str] | None:
    """The holder of an experiment's lock and the lock's version, or None if unlocked.
    LockedError when the lock file cannot be read as one."""
    path = storage.join(root, LOCK_NAME)
    try:
        got = storage.read_versioned(path)
        if got is None:
            return None
        return LockInfo.from_json(got[0]), got[1]
    except (orjson.JSONDecodeError, TypeError, ValueError, UnreadableFileError) as e:
        raise LockedError(
            f"{storage.url(path)} is not a valid writer lock ({e}); if no run writes "
            f"{storage.url(root)}, remove it with: ckptstore lock {storage.url(root)} --break"
        ) from None


def break_lock(storage: Storage, root: str) -> bool:
    """Remove an experiment's lock whatever it holds (the ``--break`` of the CLI)."""
    path = storage.join(root, LOCK_NAME)
    try:
        got = storage.read_versioned(path)
    except UnreadableFileError:  # a FIFO, a device, gigabytes: no lock to compare, removed
        storage.delete(path)
        return True
    return got is not None and storage.delete_if(path, got[1])


class WriterLock:
    """The lock on one experiment folder, held while this process writes there."""

    def __init__(
        self,
        storage: Storage,
        root: str,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        wall: Callable[[], float] = time.time,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be a positive number of seconds, got {lease_s!r}")
        self.storage, self.root = storage, root
        self.path, self.url = storage.join(root, LOCK_NAME), storage.url(root)
        self.lease_s, self._wall, self._env = lease_s, wall, env
        self.info: LockInfo | None = None
        self.lost: LockedError | None = None
        self._version = ""
        self._stop = threading.Event()
        self._mutex = threading.Lock()
        self._renewing = threading.Lock()
        self._thread: threading.Thread | None = None
        self._renew_failing = False
        self._left = False

    def acquire(self) -> LockInfo:
        """Take the lock (or keep it: checked to be still ours, re-created if someone removed
        it); LockedError names the live holder."""
        if self.info is not None:
            self.check()
            if self.lost is not None:
                raise self.lost
            if self.info is not None:
                return self.info
        for _ in range(8):
            me = whoami(self._wall(), self.lease_s, self._env)
            version = self.storage.create_exclusive(self.path, me.to_json())
            got = self._hold(me, version) if version is not None else self._take_over(me)
            if got is not None:
                return got
        raise LockedError(f"{self.url}: the writer lock kept changing under us; try again")

    def _take_over(self, me: LockInfo) -> LockInfo | None:
        current = read_lock(self.storage, self.root)
        if current is None:
            return None  # released meanwhile: create it again
        holder, version = current
        reason = takeover_reason(holder, me, me.since, holder_alive)
        if reason is None:
            raise LockedError(refusal(holder, self.url, me.since), holder)
        new_version = self.storage.replace_if(self.path, me.to_json(), version)
        if new_version is None:
            return None  # someone else changed it first: look again
        log.warning(
            "ckptstore: took over the writer lock of %s from %s: %s",
            self.url,
            holder.describe(me.since),
            reason,
        )
        return self._hold(me, new_version)

    def _hold(self, me: LockInfo, version: str) -> LockInfo:
        self.info, self._version, self.lost = me, version, None
        self._stop = threading.Event()
        with _LIVE_MUTEX:
            _LIVE.add(me.token)
        self._thread = threading.Thread(target=self._renew_loop, args=(self._stop,), daemon=True)
        self._thread.name = "ckptstore-lock"
        self._thread.start()
        return me

    def _renew_loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.lease_s / 4):
            self.renew()

    def renew(self) -> None:
        """Push the lease forward; re-create a lock file someone removed; notice a lost lock
        (``self.lost``). No I/O under the mutex: a hanging endpoint must not block
        ``release()``; renewals (the thread's, a save's check) take turns."""
        with self._renewing:
            self._renew()

    def check(self) -> None:
        """Make sure the lock file is still this run's (one read); if not, renew: that
        re-creates a removed file or finds out who holds the experiment now."""
        with self._renewing:
            with self._mutex:
                info, version = self.info, self._version
            if info is None or self.lost is not None:
                return
            try:
                current = self.storage.read_versioned(self.path)
            except (OSError, CheckpointError) as e:
                self._renew_failed(e)
                return
            if current is None or current[1] != version:
                self._renew()

    def _renew(self) -> None:
        with self._mutex:
            info, version = self.info, self._version
        if info is None or self.lost is not None:
            return
        new = dataclasses.replace(info, renewed=self._wall())
        try:
            got = self.storage.replace_if(self.path, new.to_json(), version)
            if got is None and self.storage.read_versioned(self.path) is None:
                got = self.storage.create_exclusive(self.path, new.to_json())
                if got is not None:
                    self._recreated()
        except (OSError, CheckpointError) as e:
            self._renew_failed(e)
            return
        lost = self._lost_error() if got is None else None
        with self._mutex:
            if self.info is None or self.info.token != info.token:
                return  # released meanwhile
            if lost is not None:
                self.lost = lost
            else:
                self.info, self._version, self._renew_failing = new, str(got), False

    def _recreated(self) -> None:
        log.warning(
            "ckptstore: the writer lock of %s was removed while this run held it (a cleanup "
            "script?); no other run holds the experiment, so this run created it again and goes "
            "on saving",
            self.url,
        )

    def _renew_failed(self, e: BaseException) -> None:
        if not self._renew_failing:  # once per outage
            log.warning(
                "ckptstore: could not renew the writer lock of %s (%s); another run may take it "
                "over if this lasts %.0f s",
                self.url,
                e,
                self.lease_s,
            )
        self._renew_failing = True

    def _lost_error(self) -> LockedError:
        try:
            current = read_lock(self.storage, self.root)
        except (OSError, CheckpointError):
            current = None
        who = current[0].describe(self._wall()) if current else "nobody (it was removed)"
        return LockedError(
            f"{self.url}: this run lost its writer lock (not renewed within its {self.lease_s:.0f}"
            f" s lease); it is now held by {who}; this run saves nothing more",
            current[0] if current else None,
        )

    def release(self) -> None:
        """Stop renewing and remove the lock (unless another run has taken it)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(RELEASE_TIMEOUT_S)
        with self._mutex:
            info, self.info = self.info, None
        if info is None:
            return
        with _LIVE_MUTEX:
            _LIVE.discard(info.token)
        if self.lost is None:
            # Bounded: a hanging endpoint must not hold up a process that is ending anyway.
            t = threading.Thread(target=self._delete, name="ckptstore-unlock", daemon=True)
            t.start()
            t.join(RELEASE_TIMEOUT_S)
            if t.is_alive():
                self._left_behind(f"no answer in {RELEASE_TIMEOUT_S:.0f} s")

    def _delete(self) -> None:
        try:
            self.storage.delete_if(self.path, self._version)
        except (OSError, CheckpointError) as e:
            self._left_behind(type(e.__cause__ or e).__name__)

    def _left_behind(self, why: str) -> None:
        if self._left:
            return  # said once (a late answer of a timed-out removal)
        self._left = True
        log.warning(
            "ckptstore: the writer lock of %s stays behind (%s); the next run takes it over",
            self.url,
            why,
        )
