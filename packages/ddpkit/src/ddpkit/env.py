"""Who am I in the job? ``detect()`` reads the launcher's variables into an immutable DistInfo.

Precedence (first match wins):

1. **torchrun** -- ``RANK`` and ``WORLD_SIZE`` are set (torchrun also sets ``LOCAL_RANK``,
   ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``).
   They win over SLURM's and MPI's, so ``srun torchrun ...`` (one torchrun per node) is torchrun.
   Without torchrun's ``TORCHELASTIC_RUN_ID`` they must agree with an srun step's or an MPI
   launcher's rank and size (equal, or each task's own launcher numbering its processes in the
   task's block): ``RANK=0 WORLD_SIZE=1`` left exported in a shell that then runs ``srun -n 2``
   (srun forwards the environment) is an error, not two silent worlds of one.
2. **MPI launchers** -- Open MPI's ``mpirun`` (``OMPI_COMM_WORLD_*``), MVAPICH2's ``mpirun_rsh``
   (``MV2_COMM_WORLD_*``), and PMI launchers such as MPICH/Intel MPI's Hydra and Cray PALS
   (``PMI_RANK``/``PMI_SIZE``): see :mod:`ddpkit.mpi`. They win over SLURM's variables, which an
   ``mpirun`` inside an allocation leaves behind from the ``srun`` that started its daemons.
3. **srun** -- ``SLURM_PROCID`` is set *and* ``SLURM_STEP_ID`` names a regular job step. The batch
   script of ``sbatch -n 4`` also carries ``SLURM_PROCID=0`` and ``SLURM_NTASKS=4``, but it is one
   shell, not four tasks: without ``SLURM_STEP_ID`` (or with the batch/extern/interactive step ids)
   it is a single process, so ``python train.py`` straight in a batch script never waits for three
   peers that will not come.
4. **single** -- one process, world size 1, no process group needed. But a launcher variable that
   says "rank > 0" or "more than one process" (``PMIX_RANK=1``, ``PMI_ID=3``, ``FLUX_TASK_RANK``,
   a lone ``LOCAL_WORLD_SIZE=4``, ...) that no launcher above explains is an error: N silent copies
   of one training would overwrite each other's checkpoints.

Step values win over job values (``SLURM_STEP_NUM_TASKS`` over ``SLURM_NTASKS``,
``SLURM_STEP_NODELIST`` over ``SLURM_NODELIST`` over ``SLURM_JOB_NODELIST``), because
``srun -n 2`` inside ``sbatch -n 8`` runs a two-task step.

Master address: ``MASTER_ADDR`` when set, else the first host of the step's node list (parsed
here, no ``scontrol``); under an MPI launcher 127.0.0.1 when every rank is on this node. Master
port: ``MASTER_PORT`` when set, else derived from an id every rank shares (the MPI launcher's job
id, else the SLURM job id and step) by :func:`master_port_for_job`, so two jobs sharing a node do
not collide; when it is taken anyway, rank 0 moves on to :func:`fallback_ports` (the others find
it there: :mod:`ddpkit.rendezvous`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from ddpkit import mpi
from ddpkit.errors import DistConfigError
from ddpkit.hostlist import first_host, parse_tasks_per_node

Launcher = str
"""The name of what started the process: one of :data:`LAUNCHERS`."""
# torchrun and srun have rules of their own (below); every MPI-style launcher is one entry of
# mpi.FAMILIES, so a new one is named here without an edit of this module.
LAUNCHERS: tuple[str, ...] = ("torchrun", "srun", *(f.launcher for f in mpi.FAMILIES), "single")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
# Derived ports stay below Linux's ephemeral range (32768-60999): an outgoing connection can never
# be sitting on them, and they need no privileges.
PORT_BASE = 20000
PORT_SPAN = 10000
DEFAULT_PORT = 29500  # torch's own default, for a single process that never listens anyway
# When a derived port is taken, rank 0 tries these many more, FALLBACK_STRIDE apart (a prime: the
# fallbacks of one job never land on a neighbour job's or another step's derived port).
FALLBACK_PORTS = 7
FALLBACK_STRIDE = 1009
# SLURM's special step ids (slurm.h): pending, batch script, extern container, interactive step.
_SPECIAL_STEP_IDS = {"batch", "extern", "interactive", "pending", "tbd"}
_SPECIAL_STEP_MIN = 0xFFFFFFF0

# Which variable each field came from, per launcher: error messages name the variable to fix.
_VAR_NAMES: dict[str, dict[str, str]] = {
    "torchrun": {
        "rank": "RANK",
        "world_size": "WORLD_SIZE",
        "local_rank": "LOCAL_RANK",
        "local_world_size": "LOCAL_WORLD_SIZE",
        "node_rank": "GROUP_RANK",
    },
    "srun": {
        "rank": "SLURM_PROCID",
        "world_size": "SLURM_STEP_NUM_TASKS/SLURM_NTASKS",
        "local_rank": "SLURM_LOCALID",
        "local_world_size": "SLURM_STEP_TASKS_PER_NODE/SLURM_TASKS_PER_NODE",
        "node_rank": "SLURM_NODEID",
        "num_nodes": "SLURM_STEP_NUM_NODES/SLURM_NNODES",
    },
    **{
        fam.launcher: {
            "rank": fam.rank,
            "world_size": fam.size,
            "local_rank": "/".join(fam.local_rank),
            "local_world_size": "/".join(fam.local_size),
        }
        for fam in mpi.FAMILIES
    },
}


@dataclass(frozen=True, slots=True, kw_only=True)
class DistInfo:
    """Where this process stands in the job. Immutable; build it with :func:`detect`."""

    launcher: Launcher
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    job_id: str | None = None
    # Where master_addr / master_port came from ("MASTER_ADDR", "SLURM_STEP_NODELIST", ...).
    master_source: str = field(default="default", compare=False)
    # True when master_port was derived from a job id (not MASTER_PORT): if it is taken, rank 0
    # may move on to fallback_ports(master_port) and the other ranks look for it there.
    derived_port: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        names = _VAR_NAMES.get(self.launcher, {})

        def var(f: str) -> str:
            return names.get(f, f)

        if self.launcher not in LAUNCHERS:
            raise DistConfigError(
                f"launcher must be one of {', '.join(LAUNCHERS)}; got {self.launcher!r}"
            )
        for f in ("rank", "local_rank", "node_rank"):
            if getattr(self, f) < 0:
                raise DistConfigError(f"{var(f)}={getattr(self, f)} is negative; it must be >= 0")
        for f in ("world_size", "local_world_size", "num_nodes"):
            if getattr(self, f) < 1:
                raise DistConfigError(f"{var(f)}={getattr(self, f)} must be >= 1")
        pairs = (
            ("rank", "world_size"),
            ("local_rank", "local_world_size"),
            ("node_rank", "num_nodes"),
        )
        for lo, hi in pairs:
            if getattr(self, lo) >= getattr(self, hi):
                raise DistConfigError(
                    f"{var(lo)}={getattr(self, lo)} must be < {var(hi)}={getattr(self, hi)}; "
                    "the launcher's variables disagree (a stale export in your shell or sbatch "
                    "script?)"
                )
        if self.local_world_size > self.world_size:
            raise DistConfigError(
                f"{var('local_world_size')}={self.local_world_size} exceeds "
                f"{var('world_size')}={self.world_size}; the launcher's variables disagree"
            )
        if not 1 <= self.master_port <= 65535:
            raise DistConfigError(
                f"master port {self.master_port} (from {self.master_source}) is out of range; "
                "set MASTER_PORT to a free port in 1024-65535"
            )
        if not self.master_addr:
            raise DistConfigError("master address is empty; set MASTER_ADDR to rank 0's host")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """More than one process: a process group is needed."""
        return self.world_size > 1


def master_port_for_job(job_id: str | int, step_id: str | int | None = None) -> int:
    """A stable port for a job (and step), in ``[20000, 30000)``.

    Numeric ids map by remainder, so consecutive jobs sharing a node never collide (ids 10000
    apart would); other ids are hashed (crc32). The step id shifts the port so two concurrent
    ``srun`` steps of one job do not collide either; step 0 (or None) gives the job's own port.
    """
    text = str(job_id).strip()
    if not text:
        raise DistConfigError("job id is empty; cannot derive a master port (set MASTER_PORT)")
    base = int(text) if text.isdigit() else zlib.crc32(text.encode())
    step = str(step_id).strip() if step_id is not None else "0"
    offset = int(step) if step.isdigit() else zlib.crc32(step.encode())
    return PORT_BASE + (base + 97 * offset) % PORT_SPAN


def fallback_ports(port: int) -> list[int]:
    """``port`` and the ports rank 0 tries after it when it is taken, in order (all ranks compute
    the same list, so the others can look for rank 0 without a store to tell them)."""
    if not PORT_BASE <= port < PORT_BASE + PORT_SPAN:
        return [port]
    return [
        PORT_BASE + (port - PORT_BASE + i * FALLBACK_STRIDE) % PORT_SPAN
        for i in range(FALLBACK_PORTS + 1)
    ]


def detect(env: Mapping[str, str] | None = None) -> DistInfo:
    """Read the launcher's variables (``os.environ`` by default) into a :class:`DistInfo`.

    Pure: no network, no subprocess. Raises :class:`DistConfigError` (a ValueError) with one line
    naming the variable when they are malformed or inconsistent.
    """
    env = os.environ if env is None else env
    job_id = _get(env, "SLURM_JOB_ID", "SLURM_JOBID")
    srun = _get(env, "SLURM_PROCID") is not None and _is_task_step(env)
    if any(_get(env, name) is not None for name in ("RANK", "WORLD_SIZE")):
        info = _from_torchrun(env, job_id)
        _check_not_stale(env, info, srun)
        return info
    fam = mpi.family_of(env)
    if fam is not None:
        if srun and fam is mpi.PMI:  # srun --mpi=pmi2 exports PMI_RANK/PMI_SIZE of its own
            info = _from_srun(env, job_id)
            if mpi.agrees_with_srun(env, fam, info.rank, info.world_size):
                return info
        return _from_mpi(env, fam, job_id)
    if srun:
        return _from_srun(env, job_id)
    sign = mpi.unresolved_sign(env)
    if sign is not None:
        raise DistConfigError(
            f"{sign} says this process is one of several, but no launcher ddpkit knows gave it a "
            "rank and a world size; launch with torchrun, srun, mpirun (Open MPI) or mpiexec "
            "(MPICH/Intel MPI), or export RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE "
            "(plus MASTER_ADDR and MASTER_PORT)"
        )
    return _with_master(DistInfo(launcher="single", job_id=job_id), env, None)


def _check_not_stale(env: Mapping[str, str], info: DistInfo, srun: bool) -> None:
    """torchrun's variables without torchrun (no ``TORCHELASTIC_RUN_ID``) under srun or an MPI
    launcher that says otherwise: exports left in the shell (srun and ``mpirun -x`` pass them
    on), which would make each of N tasks a silent world of its own."""
    if _get(env, "TORCHELASTIC_RUN_ID") is not None:
        return  # `srun torchrun ...`: torchrun's numbers are the truth, SLURM's count its agents
    other = _other_launcher(env, srun)
    if other is None:
        return
    name, (rank_var, rank), (size_var, size) = other
    # Equal, or a launcher of one's own in each task (each spawns WORLD_SIZE / size processes
    # and numbers them in its task's block): stale exports are the same in every task, which
    # cannot fit every task's block.
    per_task, rest = divmod(info.world_size, size)
    if size <= 1 or (rest == 0 and info.rank // per_task == rank):
        return
    raise DistConfigError(
        f"RANK={info.rank} WORLD_SIZE={info.world_size} (torchrun's variables, not set by "
        f"torchrun: no TORCHELASTIC_RUN_ID) disagree with {name}'s {rank_var}={rank} "
        f"{size_var}={size}: stale exports in the launching shell? unset RANK WORLD_SIZE "
        "LOCAL_RANK LOCAL_WORLD_SIZE and launch again (or start the program with torchrun)"
    )


def _other_launcher(
    env: Mapping[str, str], srun: bool
) -> tuple[str, tuple[str, int], tuple[str, int]] | None:
    """(name, (rank variable, rank), (size variable, size)) of an MPI launcher or srun task
    step in ``env``; None when there is none or its numbers do not read as integers."""
    fam = mpi.family_of(env)
    if fam is not None:
        got = mpi.get(env, fam.rank), mpi.get(env, fam.size)
        name = fam.name
    elif srun:
        got = (
            mpi.get(env, "SLURM_PROCID"),
            mpi.get(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"),
        )
        name = "srun"
    else:
        return None
    rank, size = got
    if rank is None or size is None or not (rank[1].isdigit() and size[1].isdigit()):
        return None
    return name, (rank[0], int(rank[1])), (size[0], int(size[1]))


def _get(env: Mapping[str, str], *names: str) -> str | None:
    """The first of ``names`` that is set to something non-blank."""
    for name in names:
        value = env.get(name)
        if value is not None and value.strip():
            return value.strip()
    return None


def _int(env: Mapping[str, str], *names: str, default: int | None = None) -> int:
    for name in names:
        value = _get(env, name)
        if value is None:
            continue
        if not re.fullmatch(r"[+-]?\d+", value):
            raise DistConfigError(f"{name}={value!r} is not an integer; fix or unset it")
        return int(value)
    if default is None:
        raise DistConfigError(f"{' / '.join(names)} is not set")
    return default


def _is_task_step(env: Mapping[str, str]) -> bool:
    """True inside a task launched by srun; False in a batch shell, salloc shell or extern step."""
    step = _get(env, "SLURM_STEP_ID", "SLURM_STEPID")
    if step is None:
        return False
    if step.lower() in _SPECIAL_STEP_IDS:
        return False
    return not (step.isdigit() and int(step) >= _SPECIAL_STEP_MIN)


def _from_torchrun(env: Mapping[str, str], job_id: str | None) -> DistInfo:
    missing = [name for name in ("RANK", "WORLD_SIZE") if _get(env, name) is None]
    if missing:
        raise DistConfigError(
            f"{missing[0]} is not set but {'RANK' if missing[0] == 'WORLD_SIZE' else 'WORLD_SIZE'}"
            " is: set both (torchrun sets them) or unset both"
        )
    rank = _int(env, "RANK")
    world_size = _int(env, "WORLD_SIZE")
    if world_size > 1 and _get(env, "LOCAL_RANK") is None:
        # rank % gpus_per_node guesses wrong on uneven nodes; refuse to guess.
        raise DistConfigError(
            "LOCAL_RANK is not set while WORLD_SIZE > 1; launch with torchrun (which sets it) "
            "or export LOCAL_RANK and LOCAL_WORLD_SIZE yourself"
        )
    if world_size > 1 and _get(env, "LOCAL_WORLD_SIZE") is None:
        raise DistConfigError(
            "LOCAL_WORLD_SIZE is not set while WORLD_SIZE > 1; launch with torchrun (which sets "
            "it) or export it (the number of processes on this node)"
        )
    local_rank = _int(env, "LOCAL_RANK", default=0)
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", default=1)
    node_default = rank // local_world_size if local_world_size > 0 else 0
    node_rank = _int(env, "GROUP_RANK", default=node_default)
    nodes_default = max(-(-world_size // max(local_world_size, 1)), node_rank + 1, 1)
    num_nodes = _int(env, "GROUP_WORLD_SIZE", default=nodes_default)
    # Identity first: a RANK >= WORLD_SIZE is the error to report, not a missing MASTER_ADDR.
    info = DistInfo(
        launcher="torchrun",
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        num_nodes=num_nodes,
        job_id=job_id,
    )
    return _with_master(info, env, None)


def _from_srun(env: Mapping[str, str], job_id: str | None) -> DistInfo:
    rank = _int(env, "SLURM_PROCID")
    world_size = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", default=1)
    local_rank = _int(env, "SLURM_LOCALID", default=0)
    node_rank = _int(env, "SLURM_NODEID", default=0)
    per_node_var, per_node = _tasks_per_node(env)
    num_nodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", default=len(per_node or [1]))
    if per_node is not None:
        if len(per_node) != num_nodes or sum(per_node) != world_size:
            raise DistConfigError(
                f"{per_node_var}={_get(env, per_node_var)!r} does not describe {world_size} tasks "
                f"on {num_nodes} nodes; the SLURM variables disagree (stale exports?)"
            )
        if node_rank >= len(per_node):
            raise DistConfigError(
                f"SLURM_NODEID={node_rank} must be < the {len(per_node)} nodes of {per_node_var}"
            )
        local_world_size = per_node[node_rank]
    else:
        local_world_size = max(-(-world_size // max(num_nodes, 1)), local_rank + 1)
    info = DistInfo(
        launcher="srun",
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        num_nodes=num_nodes,
        job_id=job_id,
    )
    return _with_master(info, env, _get(env, "SLURM_STEP_ID", "SLURM_STEPID"))


def _from_mpi(env: Mapping[str, str], fam: mpi.Family, job_id: str | None) -> DistInfo:
    at = mpi.placement(env, fam)
    info = DistInfo(  # identity first: RANK >= SIZE is the error to report, not a missing master
        launcher=fam.launcher,
        rank=at.rank,
        local_rank=at.local_rank,
        world_size=at.world_size,
        local_world_size=at.local_world_size,
        node_rank=at.node_rank,
        num_nodes=at.num_nodes,
        job_id=job_id,
    )
    if info.world_size > 1:
        addr, addr_source = mpi.master_addr(env, fam, info.world_size, info.local_world_size)
    else:
        addr, addr_source = _get(env, "MASTER_ADDR") or "127.0.0.1", "default address"
    ids: list[tuple[str, str, str | None]] = []
    shared = mpi.job_id(env, fam)
    if shared is not None:  # one per mpirun: two runs in one allocation do not collide
        ids.append((shared[0], shared[1], None))
    if job_id is not None:
        ids.append(("SLURM job id", job_id, None))
    port = _port(
        env,
        ids,
        info.world_size,
        missing=f"job id all ranks share ({', '.join(fam.job_ids)} or SLURM_JOB_ID)",
        fix="give every rank MASTER_PORT=<a free port> "
        f"({fam.export.replace('NAME', 'MASTER_PORT')})",
    )
    return _placed(info, (addr, addr_source), port)


def _with_master(info: DistInfo, env: Mapping[str, str], step: str | None) -> DistInfo:
    addr = _slurm_addr(env, world_size=info.world_size)
    ids = [] if info.job_id is None else [("job id", info.job_id, step)]
    return _placed(info, addr, _port(env, ids, info.world_size))


def _placed(info: DistInfo, addr: tuple[str, str], port: tuple[int, str, bool]) -> DistInfo:
    """``info`` with its master: (address, its source) and (port, its source, derived?)."""
    return dataclasses.replace(
        info,
        master_addr=addr[0],
        master_port=port[0],
        master_source=f"{addr[1]}, {port[1]}",
        derived_port=port[2],
    )


def _tasks_per_node(env: Mapping[str, str]) -> tuple[str, list[int] | None]:
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        value = _get(env, name)
        if value is not None:
            try:
                return name, parse_tasks_per_node(value)
            except ValueError as e:
                raise DistConfigError(f"{name}: {e}") from None
    return "", None


def _slurm_addr(env: Mapping[str, str], *, world_size: int) -> tuple[str, str]:
    """MASTER_ADDR, else the first host of the step's (or job's) node list."""
    addr = _get(env, "MASTER_ADDR")
    if addr is not None:
        return addr, "MASTER_ADDR"
    for name in ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"):
        nodelist = _get(env, name)
        if nodelist is None:
            continue
        try:
            return first_host(nodelist), f"first host of {name}"
        except ValueError as e:
            raise DistConfigError(f"{name}: {e}") from None
    if world_size > 1:
        raise DistConfigError(
            f"world size is {world_size} but MASTER_ADDR is not set and there is no SLURM "
            "node list to take it from; export MASTER_ADDR=<rank 0's host>"
        )
    return "127.0.0.1", "default address"


def _port(
    env: Mapping[str, str],
    ids: list[tuple[str, str, str | None]],
    world_size: int,
    *,
    missing: str = "SLURM job id",
    fix: str = "export MASTER_PORT=<a free port>",
) -> tuple[int, str, bool]:
    """(port, where it came from, derived?): MASTER_PORT, else the first of ``ids`` (label, id,
    step) through master_port_for_job; an error only when a process group needs one."""
    port_text = _get(env, "MASTER_PORT")
    if port_text is not None:
        if not port_text.isdigit():
            raise DistConfigError(
                f"MASTER_PORT={port_text!r} is not a port number; set it to a free port in "
                "1024-65535"
            )
        port = int(port_text)
        if not 1 <= port <= 65535:
            raise DistConfigError(
                f"MASTER_PORT={port} is out of range; set it to a free port in 1024-65535"
            )
        return port, "MASTER_PORT", False
    if ids:
        label, value, step = ids[0]
        port = master_port_for_job(value, step)
        return port, f"port from {label} {value}" + (f" step {step}" if step else ""), True
    if world_size > 1:
        raise DistConfigError(
            f"world size is {world_size} but MASTER_PORT is not set and there is no {missing} to "
            f"derive it from; {fix}"
        )
    return DEFAULT_PORT, "default port", False
