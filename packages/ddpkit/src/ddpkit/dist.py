"""``init()``: join the job's process group (or not, for one process) and talk to the other ranks.

A world of one needs no process group: every helper of :class:`Dist` then returns what the
collective would have returned for one rank, so the same training script runs under
``python``, ``torchrun`` and ``srun`` unchanged.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import math
import numbers
import os
import pickle
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import torch
import torch.distributed as tdist

from ddpkit import agreement
from ddpkit.beacon import Beacon
from ddpkit.env import DistInfo, detect
from ddpkit.errors import DistConfigError, PeerError, first_line
from ddpkit.health import Heartbeat, diagnose, heartbeat_interval
from ddpkit.rendezvous import DEFAULT_STOP_SIGNALS, Joined, StopWatch, rendezvous
from ddpkit.watchdog import Settings, Watchdog, WatchdogOptions, env_frozen_after, env_switch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

T = TypeVar("T")
ReduceOpName = Literal["mean", "sum", "max", "min"]

TIMEOUT_ENV = "PYRECOVER_DIST_TIMEOUT"
# SLURM sends SIGTERM, waits KillWait (30 s by default) and then SIGKILLs. A collective that waits
# on a dead peer for the torch default of 10-30 min would burn the rest of the allocation; three
# minutes still covers a slow first step, a long checkpoint write or a compile on another rank.
DEFAULT_TIMEOUT_S = 180.0
# Start-up is slower and more uneven than a step (imports from a shared filesystem, a node that
# boots late): the rendezvous waits at least this long for every rank to arrive.
MIN_RENDEZVOUS_TIMEOUT_S = 300.0
BACKENDS = ("auto", "gloo", "nccl", "mpi", "ucc")
# Errors that mean "the other side is gone or late", not "you passed a bad tensor".
_COMM_FAILURE = re.compile(
    r"timed out|timeout|connection|closed by peer|reset by peer|broken pipe|socket|"
    r"NCCL (?:error|communicator)|watchdog|abort",
    re.IGNORECASE,
)


def is_peer_failure(e: BaseException) -> bool:
    """Whether ``e`` means "another rank is gone or late" rather than a programming error: a
    :class:`PeerError`, a ``torch.distributed`` error, or a backend's RuntimeError about a
    closed connection or a timeout (what DDP's gradient all-reduce inside ``backward()``
    raises when a peer dies and the watchdog is off)."""
    if isinstance(e, PeerError | tdist.DistError):
        return True
    return isinstance(e, RuntimeError) and _COMM_FAILURE.search(str(e)) is not None


@dataclass(kw_only=True, slots=True)
class InitOptions:
    """The arguments of :func:`init`, checked before anything touches the network."""

    backend: str = "auto"
    timeout: float | timedelta | None = None
    rendezvous_timeout: float | timedelta | None = None
    distributed: bool | None = None
    device: str | torch.device | None = None
    heartbeat: bool = True
    watchdog: bool | WatchdogOptions | None = None
    abort: Callable[[], bool] | None = None
    stop_signals: tuple[str, ...] = DEFAULT_STOP_SIGNALS

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS and ":" not in self.backend:
            raise DistConfigError(
                f"backend={self.backend!r} is unknown; use one of {', '.join(BACKENDS)} "
                "(or torch's 'cpu:gloo,cuda:nccl' form)"
            )
        for name in ("timeout", "rendezvous_timeout"):
            value = getattr(self, name)
            if value is None:
                continue
            seconds = _seconds(value)
            if not (math.isfinite(seconds) and seconds > 0):
                raise DistConfigError(
                    f"{name}={value!r} must be a positive number of seconds, e.g. 180"
                )
        if self.distributed not in (None, True, False):
            raise DistConfigError(f"distributed={self.distributed!r} must be None, True or False")
        if not (self.watchdog is None or isinstance(self.watchdog, (bool, WatchdogOptions))):
            raise DistConfigError(
                f"watchdog={self.watchdog!r} must be True, False or a ddpkit.WatchdogOptions"
            )
        if self.abort is not None and not callable(self.abort):
            raise DistConfigError(f"abort={self.abort!r} must be a callable returning a bool")
        self.stop_signals = tuple(self.stop_signals)
        known = {s.name.removeprefix("SIG") for s in signal.Signals}
        bad = [s for s in self.stop_signals if str(s).upper().removeprefix("SIG") not in known]
        if bad:
            raise DistConfigError(
                f"stop_signals: {bad[0]!r} is not a signal name; use names such as 'TERM', 'INT'"
            )

    def timeout_seconds(self, env: Mapping[str, str]) -> float:
        """The argument, else ``PYRECOVER_DIST_TIMEOUT``, else 180 s."""
        if self.timeout is not None:
            return _seconds(self.timeout)
        text = env.get(TIMEOUT_ENV, "").strip()
        if not text:
            return DEFAULT_TIMEOUT_S
        try:
            seconds = float(text)
        except ValueError:
            seconds = float("nan")
        if not (math.isfinite(seconds) and seconds > 0):
            raise DistConfigError(
                f"{TIMEOUT_ENV}={text!r} must be a positive number of seconds, e.g. 180"
            )
        return seconds

    def watchdog_settings(self, env: Mapping[str, str], timeout_s: float) -> Settings | None:
        """The watchdog's settings (None: off): needs the heartbeat; env fills the Nones."""
        if not self.heartbeat or self.watchdog is False:
            return None
        options = self.watchdog if isinstance(self.watchdog, WatchdogOptions) else None
        if options is None:
            options = WatchdogOptions(enabled=True if self.watchdog is True else None)
        return options.settings(env, heartbeat_interval(timeout_s))

    def rendezvous_seconds(self, timeout_s: float) -> float:
        """The argument, else the collective timeout but at least 300 s."""
        if self.rendezvous_timeout is not None:
            return _seconds(self.rendezvous_timeout)
        return max(timeout_s, MIN_RENDEZVOUS_TIMEOUT_S)


def _seconds(t: float | timedelta) -> float:
    if isinstance(t, timedelta):
        return t.total_seconds()
    if isinstance(t, bool) or not isinstance(t, numbers.Real):
        raise DistConfigError(f"timeout {t!r} must be seconds (a number) or a timedelta")
    return float(t)


def init(
    backend: str = "auto",
    timeout: float | timedelta | None = None,
    distributed: bool | None = None,
    device: str | torch.device | None = None,
    env: Mapping[str, str] | None = None,
    *,
    rendezvous_timeout: float | timedelta | None = None,
    heartbeat: bool = True,
    watchdog: bool | WatchdogOptions | None = None,
    abort: Callable[[], bool] | None = None,
    stop_signals: Iterable[str] = DEFAULT_STOP_SIGNALS,
) -> Dist:
    """Join the job: detect the launcher, pick the device, create the process group if needed.

    Use it as a context manager (``with init() as dist:``) so the group is destroyed on exit,
    also on exceptions; or keep the returned :class:`Dist` and call :meth:`Dist.close`.

    ``distributed``: None creates a process group only when world size > 1; True demands a
    launcher (torchrun or srun) and always creates one; False refuses a multi-process launch.
    ``timeout`` (seconds or timedelta; default ``PYRECOVER_DIST_TIMEOUT`` or 180 s) bounds every
    collective: a dead or stuck peer makes the others raise :class:`PeerError` instead of hanging.
    ``rendezvous_timeout`` bounds the wait for every rank to start (default: ``timeout``, but at
    least 300 s, since imports from a shared filesystem can be slow and uneven).
    ``env`` replaces ``os.environ`` for detection (tests, dry runs). ``heartbeat`` lets a failed
    collective name the rank that stopped answering. ``watchdog`` (on unless
    ``DDPKIT_WATCHDOG=0``; a :class:`WatchdogOptions` to tune it) ends every rank with exit 69
    within seconds when one rank dies or freezes (:mod:`ddpkit.watchdog`).
    The wait for the other ranks ends within ~0.1 s of a signal in ``stop_signals`` (default
    SIGTERM and SIGINT; a handler the caller installed for them still runs) or of ``abort()``
    turning true (e.g. the caller's own stop flag, polled ten times a second), raising
    :class:`InitInterrupted`.
    All configuration errors raise :class:`DistConfigError` before any network wait.

    Args:
        backend: ``"auto"`` (NCCL on CUDA, else gloo), ``"gloo"``, ``"nccl"``, ``"mpi"``,
            ``"ucc"`` or a per-device string (``"cpu:gloo,cuda:nccl"``).
        timeout: Bounds every collective (seconds or timedelta; default
            ``PYRECOVER_DIST_TIMEOUT`` or 180 s).
        distributed: None: a process group only when world size > 1; True: demand a
            launcher; False: refuse a multi-process launch.
        device: The device (default: ``cuda:LOCAL_RANK`` when CUDA is there, else CPU).
        env: Replaces ``os.environ`` for detection.
        rendezvous_timeout: Bounds the wait for every rank to start (default: ``timeout``,
            at least 300 s).
        heartbeat: Let a failed collective name the rank that stopped answering.
        watchdog: End every rank with exit 69 when one dies or freezes (a
            :class:`WatchdogOptions` tunes it; default on unless ``DDPKIT_WATCHDOG=0``).
        abort: Polled ten times a second during the rendezvous; True ends the wait.
        stop_signals: Signals that end the rendezvous wait (default SIGTERM, SIGINT).

    Returns:
        The job's :class:`Dist`: rank, world size, device, the group.
    """
    opts = InitOptions(
        backend=backend,
        timeout=timeout,
        rendezvous_timeout=rendezvous_timeout,
        distributed=distributed,
        device=device,
        heartbeat=heartbeat,
        watchdog=watchdog,
        abort=abort,
        stop_signals=tuple(stop_signals),
    )
    environ: Mapping[str, str] = os.environ if env is None else env
    info = detect(environ)
    timeout_s = opts.timeout_seconds(environ)
    _check_launch(opts.distributed, info)
    dev = pick_device(opts.device, info)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if tdist.is_available() and tdist.is_initialized():
        # Someone (a framework, an outer init()) owns the group: use it, never destroy it.
        return Dist(info, dev, backend=str(tdist.get_backend()), timeout_s=timeout_s, owned=False)
    want = info.is_distributed if opts.distributed is None else opts.distributed
    if not want:
        if opts.watchdog is None and env_switch(environ):  # unused by one process, but a
            env_frozen_after(environ)  # typo is said here too, not first on a big launch
        return Dist(info, dev, backend=None, timeout_s=timeout_s, owned=False)
    chosen = pick_backend(opts.backend, dev)
    _check_resolvable(info)
    rdzv_s = opts.rendezvous_seconds(timeout_s)
    watch = opts.watchdog_settings(environ, timeout_s) if info.world_size > 1 else None
    return _join(info, dev, chosen, timeout_s, rdzv_s, opts, watch)


def _check_launch(distributed: bool | None, info: DistInfo) -> None:
    """``distributed=True`` needs a launcher; ``False`` refuses one that started several."""
    if distributed is True and info.launcher == "single":
        raise DistConfigError(
            "--distributed needs a launcher: found no RANK/WORLD_SIZE (torchrun), no "
            "SLURM_PROCID inside an srun step and no MPI rank (mpirun, mpiexec); launch with "
            "`torchrun --nproc-per-node=N script.py`, `srun -n N python script.py` or `mpirun "
            "-n N python script.py`"
        )
    if distributed is False and info.is_distributed:
        raise DistConfigError(
            f"distributed=False, but {info.launcher} started {info.world_size} processes (this is "
            f"rank {info.rank}); launch a single process or drop distributed=False"
        )


def pick_device(requested: str | torch.device | None, info: DistInfo) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is there (cuda:0 when each task sees one GPU), else cpu."""
    if requested is None:
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", _cuda_index(info, torch.cuda.device_count()))
    try:
        dev = torch.device(requested)
    except (RuntimeError, TypeError) as e:
        raise DistConfigError(f"device={requested!r} is not a torch device ({e})") from None
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise DistConfigError(
            f"device={requested!r} but CUDA is not available here; use device='cpu' or leave "
            "device unset"
        )
    count = torch.cuda.device_count()
    if dev.index is None:
        return torch.device("cuda", _cuda_index(info, count))
    if dev.index >= count:
        raise DistConfigError(f"device={requested!r} but only {count} GPU(s) are visible")
    return dev


def _cuda_index(info: DistInfo, count: int) -> int:
    """The GPU of this local rank among the ``count`` visible ones."""
    if info.local_rank < count:
        return info.local_rank
    if count == 1 and info.launcher != "torchrun":
        # srun --gpus-per-task=1 / --gpu-bind=single:1, mpiexec -gpus-per-proc 1: each task sees
        # only its own GPU.
        return 0
    name = {"srun": "SLURM_LOCALID", "torchrun": "LOCAL_RANK"}.get(info.launcher, "local rank")
    raise DistConfigError(
        f"{name}={info.local_rank} but only {count} GPU(s) are visible to this process; start at "
        f"most {count} process(es) per node, give each task its own GPU (srun "
        "--gpus-per-task=1), or pass device='cpu' to use gloo on the CPU"
    )


def pick_backend(requested: str, device: torch.device) -> str:
    """nccl with a CUDA device, gloo otherwise; a forced backend is checked against the build."""
    if requested == "auto":
        requested = "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise DistConfigError(
            f"backend='nccl' needs a CUDA device, but the device is {device}; use backend='gloo' "
            "or 'auto'"
        )
    available = {
        "gloo": tdist.is_available() and tdist.is_gloo_available(),
        "nccl": tdist.is_available() and tdist.is_nccl_available(),
        "mpi": tdist.is_available() and tdist.is_mpi_available(),
    }
    if not available.get(requested, tdist.is_available()):
        raise DistConfigError(
            f"backend={requested!r} is not built into this torch ({torch.__version__}); "
            "use backend='auto'"
        )
    return requested


def _check_resolvable(info: DistInfo) -> None:
    try:
        socket.getaddrinfo(info.master_addr, info.master_port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise DistConfigError(
            f"master address {info.master_addr!r} ({info.master_source}) does not resolve "
            f"({e}); export MASTER_ADDR=<rank 0's host name or IP>"
        ) from None


def _join(
    info: DistInfo,
    dev: torch.device,
    backend: str,
    timeout_s: float,
    rdzv_s: float,
    opts: InitOptions,
    watch: Settings | None,
) -> Dist:
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    # Set for anything that reads torch's env:// variables later (a DeviceMesh, a sub-launcher).
    os.environ["MASTER_ADDR"] = info.master_addr
    os.environ["MASTER_PORT"] = str(info.master_port)
    timeout = timedelta(seconds=timeout_s)
    beacon = None
    try:
        beacon = Beacon(info.master_addr, info.master_port) if watch is not None else None
        with StopWatch(opts.stop_signals, opts.abort) as stop:
            joined = rendezvous(info, rdzv_s, stop, me=beacon.record() if beacon else "1")
        if joined.port != info.master_port:  # rank 0 found the derived port taken
            info = dataclasses.replace(info, master_port=joined.port)
            os.environ["MASTER_PORT"] = str(joined.port)
        store = joined.store
        store.set_timeout(timeout)  # everyone is here: from now on, waits are collectives
        _init_group(info, store, dev, backend, timeout)
        guard = _guard(info, joined, beacon, watch, timeout_s, opts.heartbeat)
    except BaseException:
        _restore_env(saved)
        if beacon is not None:
            beacon.close()
        if tdist.is_initialized():
            tdist.destroy_process_group()
        raise
    return Dist(
        info,
        dev,
        backend=backend,
        timeout_s=timeout_s,
        owned=True,
        store=store,
        heartbeat=guard,
        heartbeat_prefix=f"{joined.prefix}/hb/",
        saved_env=saved,
    )


def _init_group(
    info: DistInfo, store: tdist.Store, dev: torch.device, backend: str, timeout: timedelta
) -> None:
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = dev  # binds the communicator to this GPU up front
    tdist.init_process_group(
        backend,
        store=store,
        rank=info.rank,
        world_size=info.world_size,
        timeout=timeout,
        **kwargs,
    )


def _guard(
    info: DistInfo,
    joined: Joined,
    beacon: Beacon | None,
    watch: Settings | None,
    timeout_s: float,
    heartbeat: bool,
) -> Heartbeat | Watchdog | None:
    """The watchdog (its own store connection: its calls may block forever on a stopped store
    host), or the bare heartbeat, or nothing."""
    prefix = f"{joined.prefix}/hb/"
    if watch is None or beacon is None:
        if not heartbeat:
            return None
        return Heartbeat(joined.store, info.rank, heartbeat_interval(timeout_s), prefix=prefix)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    own = tdist.TCPStore(
        info.master_addr, joined.port, info.world_size, False, timedelta(seconds=timeout_s)
    )
    dog = Watchdog(
        rank=info.rank,
        world_size=info.world_size,
        store=own,
        prefix=joined.prefix,
        beacon=beacon,
        settings=watch,
        job_id=info.job_id,
        store_host_is_rank0=not agent,
        store_where=f"{info.master_addr}:{joined.port}",
    )
    return dog.start(joined.record)


def _restore_env(saved: Mapping[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _to_tensor(payload: bytes, device: torch.device) -> torch.Tensor:
    if not payload:
        return torch.zeros(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)


def _to_bytes(t: torch.Tensor, n: int) -> bytes:
    """The first ``n`` bytes of a uint8 tensor, without numpy (tensor.numpy() needs it)."""
    cpu = t[:n].contiguous().cpu()
    return ctypes.string_at(cpu.data_ptr(), n) if n else b""


class Dist:
    """This process's view of the job: identity, device, and collectives that never hang.

    Made by :func:`init`. Without a process group (one process) every collective is a local
    no-op returning the one-rank answer. A collective that fails because a peer died or stalled
    raises :class:`PeerError` naming this rank and, when the heartbeats can tell, the silent ones.
    """

    def __init__(
        self,
        info: DistInfo,
        device: torch.device,
        *,
        backend: str | None,
        timeout_s: float,
        owned: bool,
        store: Any = None,
        heartbeat: Heartbeat | Watchdog | None = None,
        heartbeat_prefix: str = "",
        saved_env: Mapping[str, str | None] | None = None,
    ) -> None:
        self.info = info
        self.device = device
        self.backend = backend
        self.timeout_s = timeout_s
        self._owned = owned
        self._store = store
        self._heartbeat = heartbeat
        self._heartbeat_prefix = heartbeat_prefix
        self._saved_env = dict(saved_env or {})
        self._closed = False
        # A process group we adopted may disagree with the variables (e.g. a sub-launcher).
        self.rank = tdist.get_rank() if backend is not None else info.rank
        self.world_size = tdist.get_world_size() if backend is not None else 1
        # NCCL reduces GPU memory only; gloo is fastest (and always supported) on CPU tensors.
        self._comm_device = device if backend == "nccl" else torch.device("cpu")
        self._flag = torch.zeros(1, dtype=torch.int32, device=self._comm_device)
        self._slots: dict[int, agreement.IntSlot] = {}
        self._mesh: Any = None
        self._solo_group = False  # a one-rank group made for a mesh, destroyed by close()

    # -- identity --------------------------------------------------------------------------

    @property
    def local_rank(self) -> int:
        return self.info.local_rank

    @property
    def local_world_size(self) -> int:
        return self.info.local_world_size

    @property
    def node_rank(self) -> int:
        return self.info.node_rank

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the one that prints, logs and writes single-file checkpoints)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group exists (even of one process, with distributed=True)."""
        return self.backend is not None

    @property
    def mesh(self) -> DeviceMesh:
        """A 1-D DeviceMesh over every rank, for FSDP2 (:func:`ddpkit.shard_model`) and DTensor.

        Made on first use. One process without a group gets a private one-rank group (an
        in-process store: no port, no network) so FSDP's mixed precision, activation
        checkpointing and sharded checkpoints work the same on one GPU; :meth:`close` ends it.
        """
        if self._mesh is None:
            if not tdist.is_initialized():
                self._start_solo_group()
            from torch.distributed.device_mesh import init_device_mesh

            if self.device.type == "cuda":
                # DeviceMesh picks a GPU itself (LOCAL_RANK, else rank % GPUs) unless CUDA is
                # initialised; keep the one init() chose for this rank.
                torch.cuda.set_device(self.device)
            self._mesh = init_device_mesh(self.device.type, (tdist.get_world_size(),))
        return self._mesh

    def _start_solo_group(self) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"device_id": self.device} if backend == "nccl" else {}
        tdist.init_process_group(
            backend,
            store=tdist.HashStore(),
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=self.timeout_s),
            **kwargs,
        )
        self._solo_group = True

    def __repr__(self) -> str:
        return (
            f"Dist(rank={self.rank}, world_size={self.world_size}, local_rank={self.local_rank}, "
            f"device={self.device}, backend={self.backend}, launcher={self.info.launcher})"
        )

    # -- life cycle ------------------------------------------------------------------------

    def __enter__(self) -> Dist:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # An exception (not Ctrl-C or sys.exit) tells the other ranks to stop too: they would
        # otherwise wait in their next collective for this rank until the timeout.
        error = None
        if isinstance(exc, Exception):
            error = f"{type(exc).__name__}: {first_line(exc)}"
        self._close(error)

    @property
    def watchdog(self) -> Settings | None:
        """The watchdog's settings in force (None: no watchdog, e.g. one process)."""
        return self._heartbeat.settings if isinstance(self._heartbeat, Watchdog) else None

    def close(self) -> None:
        """Stop the heartbeat and destroy the process group this object created. Idempotent.

        The watchdog tells the other ranks that this one leaves normally (not dead).
        """
        self._close(None)

    def _close(self, error: str | None) -> None:
        if self._closed:
            return
        self._closed = True
        if isinstance(self._heartbeat, Watchdog):
            self._heartbeat.leave(error)
        elif self._heartbeat is not None:
            self._heartbeat.stop()
        if (self._owned or self._solo_group) and tdist.is_initialized():
            # A DDP model lives in reference cycles that hold the group. Left to the collector
            # at interpreter exit, it tears gloo down mid-finalization and sometimes aborts the
            # process ("terminate called without an active exception", ~1 run in 10 here).
            gc.collect()
            tdist.destroy_process_group()
        self._mesh = None
        _restore_env(self._saved_env)

    # -- collectives -----------------------------------------------------------------------

    def _comm(self, op: str, fn: Callable[[], T]) -> T:
        start = time.monotonic()
        try:
            return fn()
        except RuntimeError as e:
            if not is_peer_failure(e):
                raise  # a programming error (wrong dtype, device), not a peer problem
            raise self.peer_error(op, e, time.monotonic() - start) from e

    def peer_error(self, op: str, e: BaseException, elapsed: float | None = None) -> PeerError:
        """``e`` (see :func:`is_peer_failure`) as a :class:`PeerError` naming this rank and,
        when the heartbeats can tell, the ranks that went silent: for a failure raised outside
        these collectives, e.g. DDP's all-reduce inside ``backward()``."""
        why = "(no heartbeats to tell which rank failed)"
        if self._store is not None and self._heartbeat is not None:
            why = diagnose(
                self._store,
                self.world_size,
                self.rank,
                heartbeat_interval(self.timeout_s),
                prefix=self._heartbeat_prefix,
            )
        after = "" if elapsed is None else f" after {elapsed:.1f} s"
        return PeerError(
            f"[rank {self.rank}/{self.world_size} on {socket.gethostname()}] {op} failed{after} "
            f"(timeout {self.timeout_s:g} s): {why}. Backend said: {first_line(e)}"
        )

    def barrier(self) -> None:
        """Wait for every rank (bounded by the timeout)."""
        if not self.distributed:
            return
        if self.backend == "nccl":
            self._comm("barrier", lambda: tdist.barrier(device_ids=[self.device.index or 0]))
        else:
            self._comm("barrier", tdist.barrier)

    @overload
    def all_reduce(self, x: torch.Tensor, op: ReduceOpName = "mean") -> torch.Tensor: ...
    @overload
    def all_reduce(self, x: int, op: Literal["sum", "max", "min"]) -> int: ...
    @overload
    def all_reduce(self, x: float, op: ReduceOpName = "mean") -> float: ...
    @overload
    def all_reduce(self, x: Mapping[str, float], op: ReduceOpName = "mean") -> dict[str, float]: ...

    def all_reduce(self, x: Any, op: ReduceOpName = "mean") -> Any:
        """Reduce across ranks: a float/int (returned; the mean of ints is a float), a tensor
        (reduced in place and returned; mean needs a floating dtype), or a dict of numbers
        (one collective for all values; floats back), e.g. a step's metrics.
        """
        if op not in ("mean", "sum", "max", "min"):
            raise ValueError(f"op={op!r} is unknown; use 'mean', 'sum', 'max' or 'min'")
        if isinstance(x, torch.Tensor):
            return self._reduce_tensor(x, op)
        if isinstance(x, Mapping):
            keys = list(x)
            bad = [k for k in keys if not isinstance(x[k], numbers.Real)]
            if bad:
                raise TypeError(f"all_reduce of a dict needs numbers; {bad[0]!r} is {x[bad[0]]!r}")
            t = torch.tensor(
                [float(x[k]) for k in keys], dtype=torch.float64, device=self._comm_device
            )
            vals = self._reduce_tensor(t, op).tolist() if keys else []
            return dict(zip(keys, vals, strict=True))
        if isinstance(x, numbers.Integral):
            t = torch.tensor([int(x)], dtype=torch.int64, device=self._comm_device)
            if op == "mean":
                return float(self._reduce_tensor(t.double(), op).item())
            return int(self._reduce_tensor(t, op).item())
        if isinstance(x, numbers.Real):
            t = torch.tensor([float(x)], dtype=torch.float64, device=self._comm_device)
            return float(self._reduce_tensor(t, op).item())
        raise TypeError(
            f"all_reduce takes a float, int, tensor or dict of numbers, not {type(x).__name__}"
        )

    def _reduce_tensor(self, t: torch.Tensor, op: ReduceOpName) -> torch.Tensor:
        if op == "mean" and not (t.is_floating_point() or t.is_complex()):
            raise TypeError(
                f"all_reduce(op='mean') of a {t.dtype} tensor would truncate; convert it to float "
                "first or use op='sum'"
            )
        if not self.distributed:
            return t
        red = {"mean": tdist.ReduceOp.SUM, "sum": tdist.ReduceOp.SUM}.get(
            op, tdist.ReduceOp.MAX if op == "max" else tdist.ReduceOp.MIN
        )
        # NCCL only reduces GPU memory: reduce a copy and write the result back.
        work = t if (self.backend != "nccl" or t.is_cuda) else t.to(self.device)
        self._comm(f"all_reduce({op})", lambda: tdist.all_reduce(work, op=red))
        if op == "mean":
            work.div_(self.world_size)
        if work is not t:
            t.copy_(work)
        return t

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on at least one (one tiny MAX all-reduce).

        The cross-rank stop agreement: call it every step with "my clock says stop" and all
        ranks stop at the same step. Its cost: ``bench/agree.py`` in the PyRecover repository.
        """
        if not self.distributed:
            return bool(flag)
        self._flag.fill_(1 if flag else 0)
        self._comm("any_rank", lambda: tdist.all_reduce(self._flag, op=tdist.ReduceOp.MAX))
        return bool(self._flag.item())

    def agree(self, *values: int, op: Literal["max", "min"] = "max") -> tuple[int, ...]:
        """Every rank's small ``values`` reduced element-wise (MAX by default), on every rank.

        The per-step stop/save agreement (say: stop code, save due, cannot save) in one tiny
        all-reduce of a reused buffer -- with gloo one 8-byte word whatever the count -- so it
        costs what :meth:`any_rank` costs. Values are small ints: with n values each must be in
        ``0 .. 63 // n - 1`` (0..20 for three); bools count as 0/1. Every rank must pass the
        same number of values (a wrong value raises here, before the collective).
        """
        width = agreement.check(values, op)
        if not self.distributed:
            return tuple(int(v) for v in values)
        if self.backend == "gloo":
            word = self._slot(1)
            word.values[0] = agreement.pack(values, width)
            self._comm(f"agree({op})", lambda: word.reduce(tdist.ReduceOp.BOR))
            return agreement.unpack(int(word.values[0]), len(values), width, op)
        slot = self._slot(len(values))
        slot.values[:] = [int(v) for v in values]
        red = tdist.ReduceOp.MAX if op == "max" else tdist.ReduceOp.MIN
        self._comm(f"agree({op})", lambda: slot.reduce(red))
        return tuple(slot.values)

    def _slot(self, n: int) -> agreement.IntSlot:
        slot = self._slots.get(n)
        if slot is None:
            slot = self._slots[n] = agreement.IntSlot(n, self._comm_device)
        return slot

    def all_ranks(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on all of them (one tiny MIN all-reduce)."""
        if not self.distributed:
            return bool(flag)
        self._flag.fill_(1 if flag else 0)
        self._comm("all_ranks", lambda: tdist.all_reduce(self._flag, op=tdist.ReduceOp.MIN))
        return bool(self._flag.item())

    def all_gather_object(self, obj: T) -> list[T]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank.

        Objects travel as pickles, like torch's own object collectives: exchange them only
        between the ranks of your own job.
        """
        if not self.distributed:
            return [obj]
        # Not torch's all_gather_object: it needs numpy, which torch (and ddpkit) do not require.
        return self._comm("all_gather_object", lambda: self._gather_pickles(obj))

    def _gather_pickles(self, obj: Any) -> list[Any]:
        local = _to_tensor(pickle.dumps(obj), self._comm_device)
        size = torch.tensor([local.numel()], dtype=torch.int64, device=self._comm_device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        tdist.all_gather(sizes, size)
        lengths = [int(n.item()) for n in sizes]
        longest = max(lengths)
        padded = torch.zeros(longest, dtype=torch.uint8, device=self._comm_device)
        padded[: local.numel()] = local
        bufs = [torch.empty_like(padded) for _ in range(self.world_size)]
        tdist.all_gather(bufs, padded)
        return [pickle.loads(_to_bytes(b, n)) for b, n in zip(bufs, lengths, strict=True)]

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        """Rank ``src``'s ``obj`` (picklable) on every rank; other ranks' ``obj`` is ignored."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"src={src} is not a rank; it must be in 0..{self.world_size - 1}")
        if not self.distributed:
            return obj
        return self._comm("broadcast_object", lambda: self._broadcast_pickle(obj, src))

    def _broadcast_pickle(self, obj: Any, src: int) -> Any:
        mine = self.rank == src
        data = _to_tensor(pickle.dumps(obj), self._comm_device) if mine else None
        size = torch.tensor([data.numel() if data is not None else 0], device=self._comm_device)
        tdist.broadcast(size, src=src)
        if data is None:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=self._comm_device)
        tdist.broadcast(data, src=src)
        return obj if mine else pickle.loads(_to_bytes(data, data.numel()))

    # -- uneven inputs ---------------------------------------------------------------------

    def join(
        self, *joinables: Any, throw_on_early_termination: bool = False
    ) -> contextlib.AbstractContextManager[Any]:
        """``torch.distributed.algorithms.Join`` over DDP models / ZeroRedundancyOptimizers.

        Ranks that run out of batches early keep shadowing DDP's gradient all-reduces, so the
        others finish their extra batches instead of hanging. It covers only the joinables'
        own collectives: a ``dist.all_reduce`` of your own inside the loop would still wait on
        the finished rank -- use :meth:`even` for loops like that. A no-op for a single rank.
        """
        if not self.distributed or self.world_size == 1:
            return contextlib.nullcontext()  # wrap_ddp returned the bare model: nothing to join
        from torch.distributed.algorithms import Join, Joinable

        wrong = [type(j).__name__ for j in joinables if not isinstance(j, Joinable)]
        if wrong or not joinables:
            raise TypeError(
                "join() needs Joinables (a DistributedDataParallel model from wrap_ddp, a "
                f"ZeroRedundancyOptimizer); got {wrong or 'nothing'}"
            )
        return Join(list(joinables), throw_on_early_termination=throw_on_early_termination)

    def even(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield items while every rank still has one; all ranks stop at the same step.

        The tail of the longer ranks is dropped (like ``DistributedSampler(drop_last=True)``).
        Costs one :meth:`any_rank` per item and works with any collectives in the loop body.
        """
        it = iter(iterable)
        while True:
            try:
                item = next(it)
                exhausted = False
            except StopIteration:
                exhausted = True
            if self.any_rank(exhausted):
                return
            yield item

    # -- output ----------------------------------------------------------------------------

    def print(self, *args: object, all_ranks: bool = False, **kwargs: Any) -> None:
        """``print`` on rank 0 only (flushed); ``all_ranks=True`` prefixes ``[rank N]`` instead.
        The line goes out in one write: ``print`` writes each part and the newline apart, and
        unbuffered (PYTHONUNBUFFERED, as launchers often set) another rank's line lands between
        them in the launcher's merged output."""
        if all_ranks:
            args = (f"[rank {self.rank}]", *args)
        elif not self.is_main:
            return
        sep, end = kwargs.get("sep"), kwargs.get("end")
        text = (" " if sep is None else sep).join(map(str, args)) + ("\n" if end is None else end)
        file = kwargs.get("file") or sys.stdout
        file.write(text)
        if kwargs.get("flush", True):
            file.flush()
