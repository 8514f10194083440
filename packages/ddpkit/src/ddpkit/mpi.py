"""MPI launchers: Open MPI's ``mpirun``, MVAPICH2's ``mpirun_rsh``, and the PMI launchers (MPICH
and Intel MPI's Hydra ``mpiexec``, HPE Cray's PALS ``mpiexec``).

Each launcher exports, before the program starts, the process's rank and the job's size, and
(most of them) its rank and count on this node:

=========  ==========================  ==========================  ==============================
family     rank / size                 local rank / local size     shared by every rank
=========  ==========================  ==========================  ==============================
openmpi    OMPI_COMM_WORLD_RANK/SIZE   OMPI_COMM_WORLD_LOCAL_*     OMPI_MCA_ess_base_jobid,
                                                                   PMIX_NAMESPACE (Open MPI 5)
mvapich2   MV2_COMM_WORLD_RANK/SIZE    MV2_COMM_WORLD_LOCAL_*      MPIRUN_ID
pmi        PMI_RANK / PMI_SIZE         MPI_LOCALRANKID/NRANKS      PALS_APID (Cray PALS);
                                       (Hydra), PMI_LOCAL_RANK/    Hydra exports none
                                       SIZE (PALS)
=========  ==========================  ==========================  ==============================

A new launcher of this kind (Flux, LSF's ``jsrun``, a site's own) is one more :class:`Family` in
:data:`FAMILIES`: detection, the variable names in error messages, ``ddpkit.env.LAUNCHERS`` and
the tests parametrized over the table follow. slurmclock reads the rank variable too, to know
which process leads (its ``RANK_VARIABLES``; ``tests/contracts`` checks it against this table).

(Hydra: ``pmip_cb.c`` in MPICH sets PMI_RANK, PMI_SIZE, PMI_FD, MPI_LOCALRANKID and
MPI_LOCALNRANKS; with ``-pmi-port`` it sets PMI_ID and PMI_PORT instead of a rank and size, which
no process can resolve alone, so that launch is refused.)

The launcher's variables win over SLURM's: ``mpirun`` inside an allocation starts its daemons with
``srun``, so its ranks also carry the daemon step's ``SLURM_PROCID`` (a node index) and
``SLURM_NTASKS`` (a node count). Only when srun itself exported PMI variables (``srun --mpi=pmi2``)
do both agree; then the launch is srun's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ddpkit.errors import DistConfigError
from ddpkit.hostlist import first_host


@dataclass(frozen=True, slots=True)
class Family:
    """One launcher's variables (the first of each tuple that is set is used)."""

    launcher: str
    name: str
    rank: str
    size: str
    local_rank: tuple[str, ...]
    local_size: tuple[str, ...]
    job_ids: tuple[str, ...]
    num_nodes: tuple[str, ...] = ()
    # How to give every rank a variable with this launcher (for error messages).
    export: str = "mpirun -x NAME"


OPENMPI = Family(
    launcher="openmpi",
    name="Open MPI",
    rank="OMPI_COMM_WORLD_RANK",
    size="OMPI_COMM_WORLD_SIZE",
    local_rank=("OMPI_COMM_WORLD_LOCAL_RANK",),
    local_size=("OMPI_COMM_WORLD_LOCAL_SIZE",),
    job_ids=("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"),
    num_nodes=("OMPI_MCA_orte_num_nodes",),
)
MVAPICH2 = Family(
    launcher="mvapich2",
    name="MVAPICH2",
    rank="MV2_COMM_WORLD_RANK",
    size="MV2_COMM_WORLD_SIZE",
    local_rank=("MV2_COMM_WORLD_LOCAL_RANK",),
    local_size=("MV2_COMM_WORLD_LOCAL_SIZE",),
    job_ids=("MPIRUN_ID",),
    export="mpirun_rsh ... NAME=VALUE program",
)
PMI = Family(
    launcher="pmi",
    name="MPICH/Intel MPI/PMI",
    rank="PMI_RANK",
    size="PMI_SIZE",
    local_rank=("MPI_LOCALRANKID", "PMI_LOCAL_RANK", "PALS_LOCAL_RANKID"),
    local_size=("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"),
    job_ids=("PALS_APID",),
    export="mpiexec -genv NAME VALUE",
)
FAMILIES = (OPENMPI, MVAPICH2, PMI)

# Per-process variables of launchers no family resolves (PMIx, Flux, PALS, Hydra with
# -pmi-port, torchrun's locals): a value meaning "rank > 0" or "more than one process" is
# an error, never a silent world of one -- N copies of the same training would each write the
# same checkpoints. (A family's own rank and size never get here: family_of finds them first.)
RANK_SIGNS = (
    "PMI_ID",
    "PMIX_RANK",
    "MPI_LOCALRANKID",
    "PMI_LOCAL_RANK",
    "PALS_RANKID",
    "FLUX_TASK_RANK",
    "LOCAL_RANK",
)
SIZE_SIGNS = (
    "MPI_LOCALNRANKS",
    "PMI_LOCAL_SIZE",
    "FLUX_JOB_SIZE",
    "LOCAL_WORLD_SIZE",
)


def get(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """(name, value) of the first of ``names`` set to something non-blank."""
    for name in names:
        value = env.get(name)
        if value is not None and value.strip():
            return name, value.strip()
    return None


def integer(name: str, value: str) -> int:
    if not re.fullmatch(r"[+-]?\d+", value):
        raise DistConfigError(f"{name}={value!r} is not an integer; fix or unset it")
    return int(value)


def family_of(env: Mapping[str, str]) -> Family | None:
    """The MPI launcher whose rank or size variable is set, in the order of FAMILIES."""
    for fam in FAMILIES:
        if get(env, fam.rank, fam.size) is not None:
            return fam
    return None


@dataclass(frozen=True, slots=True)
class Placement:
    """What an MPI launcher says about this process (validated later by DistInfo)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int


def placement(env: Mapping[str, str], fam: Family) -> Placement:
    """Rank, size and locals from ``fam``'s variables; one-line errors for what is missing."""
    got_rank, got_size = get(env, fam.rank), get(env, fam.size)
    if got_rank is None or got_size is None:
        have, miss = (fam.rank, fam.size) if got_size is None else (fam.size, fam.rank)
        raise DistConfigError(
            f"{have} is set but {miss} is not: a {fam.name} launch needs both; start the program "
            "with the launcher's own mpirun/mpiexec, or unset the stale variable"
        )
    rank, size = integer(*got_rank), integer(*got_size)
    local = get(env, *fam.local_rank)
    local_n = get(env, *fam.local_size)
    if size > 1 and (local is None or local_n is None):
        missing = " / ".join(fam.local_rank if local is None else fam.local_size)
        raise DistConfigError(
            f"{fam.size}={size} but {missing} is not set: the rank on this node (which GPU) is "
            "unknown; use a launcher that sets it or export LOCAL_RANK and LOCAL_WORLD_SIZE with "
            "RANK and WORLD_SIZE (torchrun's variables)"
        )
    local_rank = integer(*local) if local else 0
    local_world = integer(*local_n) if local_n else 1
    nodes_var = get(env, *fam.num_nodes)
    per_node = max(local_world, 1)
    # The node index is not exported by every launcher: by-slot (block) placement is assumed.
    num_nodes = integer(*nodes_var) if nodes_var else max(-(-size // per_node), 1)
    node_rank = min(max(rank, 0) // per_node, max(num_nodes - 1, 0))
    return Placement(rank, size, local_rank, local_world, node_rank, num_nodes)


def agrees_with_srun(env: Mapping[str, str], fam: Family, srun_rank: int, srun_size: int) -> bool:
    """``srun --mpi=pmi2`` exports PMI_RANK/PMI_SIZE equal to its own task numbers."""
    got_rank, got_size = get(env, fam.rank), get(env, fam.size)
    if got_rank is None or got_size is None:
        return False
    try:
        return (integer(*got_rank), integer(*got_size)) == (srun_rank, srun_size)
    except DistConfigError:
        return False


def unresolved_sign(env: Mapping[str, str]) -> str | None:
    """A launcher variable that says "several processes" though no launcher was recognised."""
    for names, limit in ((RANK_SIGNS, 0), (SIZE_SIGNS, 1)):
        for name in names:
            got = get(env, name)
            if got is None:
                continue
            value = got[1]
            if not re.fullmatch(r"[+-]?\d+", value) or int(value) > limit:
                return f"{name}={value}"
    return None


def job_id(env: Mapping[str, str], fam: Family) -> tuple[str, str] | None:
    """(variable, value) of an id every rank of this launch shares, for the derived port."""
    return get(env, *fam.job_ids)


def master_addr(
    env: Mapping[str, str], fam: Family, world_size: int, local_world_size: int
) -> tuple[str, str]:
    """(address, where it came from): MASTER_ADDR; one node: loopback; else SLURM's first node."""
    given = get(env, "MASTER_ADDR")
    if given is not None:
        return given[1], "MASTER_ADDR"
    if world_size <= local_world_size:
        return "127.0.0.1", f"every rank on this node ({fam.name})"
    nodelist = get(env, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if nodelist is not None:
        try:
            return first_host(nodelist[1]), f"first host of {nodelist[0]}"
        except ValueError as e:
            raise DistConfigError(f"{nodelist[0]}: {e}") from None
    raise DistConfigError(
        f"{fam.name} started {world_size} ranks on several nodes ({local_world_size} here) and "
        "MASTER_ADDR is not set (nor a SLURM node list): give every rank MASTER_ADDR=<rank 0's "
        f"host> ({fam.export.replace('NAME', 'MASTER_ADDR')})"
    )
