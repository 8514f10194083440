"""detect() on fake environments: precedence, derived master, and one-line errors."""

from __future__ import annotations

import dataclasses

import pytest

from ddpkit import DistConfigError, DistInfo, detect, fallback_ports, master_port_for_job
from ddpkit.env import LAUNCHERS
from ddpkit.mpi import FAMILIES, Family

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "node1",
    "MASTER_PORT": "29400",
    "TORCHELASTIC_RUN_ID": "abc",
}


def srun_env(**over: str) -> dict[str, str]:
    """Task 4 of `srun -n 7` on 4 nodes laid out 2,2,2,1 (what SLURM 22.05 sets)."""
    env = {
        "SLURM_JOB_ID": "123456",
        "SLURM_JOBID": "123456",
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_PROCID": "4",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "2",
        "SLURM_NTASKS": "7",
        "SLURM_NPROCS": "7",
        "SLURM_STEP_NUM_TASKS": "7",
        "SLURM_NNODES": "4",
        "SLURM_STEP_NUM_NODES": "4",
        "SLURM_TASKS_PER_NODE": "2(x3),1",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
        "SLURM_JOB_NODELIST": "gpu[007-009],cpu3",
        "SLURM_STEP_NODELIST": "gpu[007-009],cpu3",
        "SLURM_NODELIST": "gpu[007-009],cpu3",
    }
    env.update(over)
    return {k: v for k, v in env.items() if v != "UNSET"}


def test_single_process_without_any_launcher() -> None:
    info = detect({})
    assert info == DistInfo(launcher="single")
    assert (info.rank, info.world_size, info.local_rank, info.is_main) == (0, 1, 0, True)
    assert not info.is_distributed
    assert (info.master_addr, info.master_port, info.job_id) == ("127.0.0.1", 29500, None)


def test_torchrun() -> None:
    info = detect(TORCHRUN)
    assert info.launcher == "torchrun"
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (5, 8, 1, 4)
    assert (info.node_rank, info.num_nodes) == (1, 2)
    assert (info.master_addr, info.master_port) == ("node1", 29400)
    assert info.is_distributed and not info.is_main


def test_torchrun_started_by_srun_wins_over_slurm() -> None:
    info = detect({**srun_env(), **TORCHRUN})
    assert info.launcher == "torchrun"
    assert (info.rank, info.world_size, info.master_port) == (5, 8, 29400)
    assert info.job_id == "123456"  # still known: useful for logs and W&B run ids


def test_srun() -> None:
    info = detect(srun_env())
    assert info.launcher == "srun"
    assert (info.rank, info.world_size, info.local_rank) == (4, 7, 0)
    assert (info.node_rank, info.num_nodes, info.local_world_size) == (2, 4, 2)
    assert info.master_addr == "gpu007"  # first host of the node list, no scontrol
    assert info.master_port == master_port_for_job("123456", "0")
    assert info.job_id == "123456"
    last = detect(srun_env(SLURM_PROCID="6", SLURM_NODEID="3"))
    assert last.local_world_size == 1  # the "1" of 2(x3),1


def test_srun_step_values_win_over_job_values() -> None:
    """`srun -n 2` inside `sbatch -n 7`: the step has 2 tasks on its own nodes."""
    env = srun_env(
        SLURM_PROCID="1",
        SLURM_LOCALID="1",
        SLURM_NODEID="0",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_NUM_NODES="1",
        SLURM_STEP_TASKS_PER_NODE="2",
        SLURM_STEP_NODELIST="gpu009",
        SLURM_NODELIST="UNSET",
        SLURM_STEP_ID="3",
    )
    info = detect(env)
    assert (info.world_size, info.num_nodes, info.local_world_size) == (2, 1, 2)
    assert info.master_addr == "gpu009"
    assert info.master_port == master_port_for_job("123456", "3")


def test_srun_node_list_fallbacks() -> None:
    env = srun_env(SLURM_STEP_NODELIST="UNSET", SLURM_NODELIST="UNSET")
    assert detect(env).master_addr == "gpu007"
    assert "SLURM_JOB_NODELIST" in detect(env).master_source


def test_master_variables_override_slurm() -> None:
    info = detect(srun_env(MASTER_ADDR="10.1.2.3", MASTER_PORT="40000"))
    assert (info.master_addr, info.master_port) == ("10.1.2.3", 40000)
    assert info.master_source == "MASTER_ADDR, MASTER_PORT"


@pytest.mark.parametrize(
    "step",
    [
        None,  # the batch shell of `sbatch -n 4`: no step id at all
        "batch",
        "extern",
        "interactive",
        str(0xFFFFFFFB),  # SLURM_BATCH_SCRIPT
        str(0xFFFFFFFC),  # SLURM_EXTERN_CONT
        str(0xFFFFFFFA),  # SLURM_INTERACTIVE_STEP
    ],
)
def test_batch_shell_is_not_a_task_launcher(step: str | None) -> None:
    """`python train.py` straight in an `sbatch -n 4` script is one process, not four."""
    env = srun_env(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    env.pop("SLURM_STEP_ID")
    env.pop("SLURM_STEPID")
    for k in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES", "SLURM_STEP_TASKS_PER_NODE"):
        env.pop(k)
    if step is not None:
        env["SLURM_STEP_ID"] = step
    info = detect(env)
    assert info.launcher == "single"
    assert (info.rank, info.world_size) == (0, 1)
    assert info.job_id == "123456"
    assert info.master_port == master_port_for_job("123456")


BAD = [
    (
        {"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"},
        "RANK=4 must be < WORLD_SIZE=4",
    ),
    ({**TORCHRUN, "RANK": "-1"}, "RANK=-1 is negative"),
    ({**TORCHRUN, "WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ({**TORCHRUN, "RANK": "two"}, "RANK='two' is not an integer"),
    ({"RANK": "0"}, "WORLD_SIZE is not set but RANK is"),
    ({"WORLD_SIZE": "2"}, "RANK is not set but WORLD_SIZE is"),
    ({k: v for k, v in TORCHRUN.items() if k != "LOCAL_RANK"}, "LOCAL_RANK is not set"),
    ({k: v for k, v in TORCHRUN.items() if k != "LOCAL_WORLD_SIZE"}, "LOCAL_WORLD_SIZE is not set"),
    ({**TORCHRUN, "LOCAL_RANK": "4"}, "LOCAL_RANK=4 must be < LOCAL_WORLD_SIZE=4"),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "9"}, "LOCAL_WORLD_SIZE=9 exceeds WORLD_SIZE=8"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is out of range"),
    ({**TORCHRUN, "MASTER_PORT": "0"}, "MASTER_PORT=0 is out of range"),
    ({**TORCHRUN, "MASTER_PORT": "-5"}, "MASTER_PORT='-5' is not a port number"),
    ({**TORCHRUN, "MASTER_PORT": "http"}, "MASTER_PORT='http' is not a port number"),
    (
        {k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"},
        "MASTER_ADDR is not set and there is no SLURM node list",
    ),
    (
        {k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"},
        "MASTER_PORT is not set and there is no SLURM job id",
    ),
    (srun_env(SLURM_PROCID="7"), "SLURM_PROCID=7 must be < SLURM_STEP_NUM_TASKS/SLURM_NTASKS=7"),
    (srun_env(SLURM_PROCID="-2"), "SLURM_PROCID=-2 is negative"),
    (srun_env(SLURM_STEP_TASKS_PER_NODE="2(x4)"), "does not describe 7 tasks on 4 nodes"),
    (srun_env(SLURM_STEP_TASKS_PER_NODE="2(x3,1"), "SLURM_STEP_TASKS_PER_NODE: malformed"),
    (srun_env(SLURM_LOCALID="2"), "SLURM_LOCALID=2 must be < "),
    (srun_env(SLURM_NODEID="4"), "SLURM_NODEID=4 must be < "),
    (srun_env(SLURM_STEP_NODELIST="gpu[1-"), "SLURM_STEP_NODELIST: unclosed '['"),
    (srun_env(SLURM_STEP_NODELIST="gpu[a]"), "malformed range 'a'"),
]


@pytest.mark.parametrize(("env", "message"), BAD)
def test_inconsistent_variables_raise_one_clear_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(DistConfigError) as e:
        detect(env)
    assert message in str(e.value)
    assert "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)


def test_world_of_one_needs_no_master() -> None:
    info = detect({"RANK": "0", "WORLD_SIZE": "1"})
    assert (info.launcher, info.world_size, info.local_world_size) == ("torchrun", 1, 1)
    assert info.master_addr == "127.0.0.1"


def test_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(TORCHRUN) + ["SLURM_PROCID", "SLURM_JOB_ID", "SLURM_JOBID"]:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert detect().rank == 1


def test_distinfo_is_immutable_and_validated() -> None:
    info = detect(TORCHRUN)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.rank = 0  # type: ignore[misc]
    with pytest.raises(DistConfigError, match="launcher must be"):
        DistInfo(launcher="mpirun")  # type: ignore[arg-type]
    with pytest.raises(DistConfigError, match="rank=2 must be < world_size=2"):
        DistInfo(launcher="single", rank=2, world_size=2, local_world_size=2)


def test_master_port_for_job() -> None:
    p = master_port_for_job("123456")
    assert p == master_port_for_job(123456) == master_port_for_job("123456", 0)  # stable
    assert 20000 <= p < 30000
    ports = {master_port_for_job(j) for j in range(5000, 5100)}
    assert len(ports) == 100, "consecutive jobs sharing a node must not collide"
    assert master_port_for_job("123456", 1) != p  # a second concurrent step
    assert 20000 <= master_port_for_job("my-run") < 30000
    assert master_port_for_job("my-run") == master_port_for_job("my-run")
    with pytest.raises(DistConfigError, match="job id is empty"):
        master_port_for_job(" ")


# -- MPI launchers (what Open MPI 4.1's mpirun, MPICH's Hydra and Cray PALS export) ----------------

OMPI = {  # rank 1 of `mpirun -n 2` on one node (Debian's openmpi-bin 4.1.4)
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "1",
    "OMPI_MCA_ess_base_jobid": "1335164929",
    "OMPI_MCA_orte_num_nodes": "1",
    "PMIX_NAMESPACE": "1335164929",
    "PMIX_RANK": "1",
}
HYDRA = {  # rank 3 of `mpiexec -n 4` (MPICH / Intel MPI): no id that every rank shares
    "PMI_RANK": "3",
    "PMI_SIZE": "4",
    "PMI_FD": "9",
    "MPI_LOCALRANKID": "3",
    "MPI_LOCALNRANKS": "4",
}
PALS = {  # rank 5 of 8 on 2 nodes (HPE Cray PALS mpiexec)
    "PMI_RANK": "5",
    "PMI_SIZE": "8",
    "PMI_LOCAL_RANK": "1",
    "PMI_LOCAL_SIZE": "4",
    "PALS_APID": "6c4a1b0e-0e6f-4bd4-9c7e-2c6e7a3b7e11",
    "MASTER_ADDR": "x1000c0s0b0n0",
}


def family_env(fam: Family) -> dict[str, str]:
    """What ``fam``'s launcher exports to rank 3 of 4, the second of two on its node."""
    env = {fam.rank: "3", fam.size: "4", fam.local_rank[0]: "1", fam.local_size[0]: "2"}
    return env | {fam.job_ids[0]: "4242", "SLURM_JOB_NODELIST": "n[1-2]"}


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.launcher)
def test_every_launcher_of_the_table_is_detected_from_its_variables(fam: Family) -> None:
    """A launcher is one entry of ddpkit.mpi.FAMILIES: detection follows from its variables,
    also under a batch job's leftover SLURM_PROCID=0 (mpirun inside sbatch)."""
    for env in (family_env(fam), {**family_env(fam), "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}):
        info = detect(env)
        assert (info.launcher, info.rank, info.world_size) == (fam.launcher, 3, 4)
        assert (info.local_rank, info.local_world_size, info.node_rank) == (1, 2, 1)
        assert (info.master_addr, info.master_port) == ("n1", master_port_for_job("4242"))
    assert fam.launcher in LAUNCHERS
    assert [f.launcher for f in FAMILIES].count(fam.launcher) == 1


def test_open_mpi_on_one_node() -> None:
    info = detect(OMPI)
    assert (info.launcher, info.rank, info.world_size) == ("openmpi", 1, 2)
    assert (info.local_rank, info.local_world_size, info.node_rank, info.num_nodes) == (1, 2, 0, 1)
    assert info.master_addr == "127.0.0.1"  # every rank is on this node
    assert info.master_port == master_port_for_job("1335164929") and info.derived_port
    assert "OMPI_MCA_ess_base_jobid" in info.master_source


def test_open_mpi_5_port_from_its_pmix_namespace() -> None:
    env = {k: v for k, v in OMPI.items() if not k.startswith("OMPI_MCA")}
    env["PMIX_NAMESPACE"] = "prterun-node1-4242@1"
    assert detect(env).master_port == master_port_for_job("prterun-node1-4242@1")


def test_mpirun_inside_an_allocation_wins_over_the_daemons_srun_step() -> None:
    """On the second node, mpirun's ranks inherit the srun step that started its daemon: task 0
    of a 1-task step. The MPI variables are the truth; rank 0 is on the job's first node."""
    env = {
        **OMPI,
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_MCA_orte_num_nodes": "2",
        **srun_env(
            SLURM_PROCID="0",
            SLURM_LOCALID="0",
            SLURM_NODEID="0",
            SLURM_STEP_ID="1",
            SLURM_STEP_NUM_TASKS="1",
            SLURM_STEP_NUM_NODES="1",
            SLURM_STEP_TASKS_PER_NODE="1",
            SLURM_STEP_NODELIST="gpu008",
            SLURM_JOB_NODELIST="gpu[007-008]",
            SLURM_NODELIST="gpu[007-008]",
            SLURM_NTASKS="4",
            SLURM_NNODES="2",
            SLURM_TASKS_PER_NODE="2(x2)",
        ),
    }
    info = detect(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("openmpi", 2, 4, 0)
    assert (info.node_rank, info.num_nodes) == (1, 2)
    assert info.master_addr == "gpu007"  # the job's first node, not the daemon step's
    assert info.master_port == master_port_for_job("1335164929")  # one per mpirun
    assert info.job_id == "123456"


def test_hydra_without_a_shared_id_needs_master_port() -> None:
    with pytest.raises(DistConfigError) as e:
        detect(HYDRA)
    msg = str(e.value)
    assert "MASTER_PORT is not set and there is no job id all ranks share" in msg
    assert "mpiexec -genv MASTER_PORT" in msg and "\n" not in msg
    info = detect({**HYDRA, "MASTER_PORT": "29612"})
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("pmi", 3, 4, 3)
    assert (info.master_addr, info.master_port, info.derived_port) == ("127.0.0.1", 29612, False)
    # Inside a SLURM allocation the job id serves.
    inside = detect({**HYDRA, "SLURM_JOB_ID": "777", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"})
    assert (inside.launcher, inside.master_port) == ("pmi", master_port_for_job("777"))


def test_cray_pals() -> None:
    info = detect(PALS)
    assert (info.launcher, info.rank, info.world_size) == ("pmi", 5, 8)
    assert (info.local_rank, info.local_world_size, info.node_rank, info.num_nodes) == (1, 4, 1, 2)
    assert info.master_addr == "x1000c0s0b0n0"
    assert info.master_port == master_port_for_job(PALS["PALS_APID"])


def test_srun_pmi2_is_srun_and_hydra_through_srun_is_pmi() -> None:
    """`srun --mpi=pmi2` exports PMI_RANK/PMI_SIZE equal to its task numbers: srun. Hydra that
    started its proxies with srun: the PMI numbers differ from the proxy step's, PMI wins."""
    pmi2 = detect(srun_env(PMI_RANK="4", PMI_SIZE="7", PMI_FD="5"))
    assert (pmi2.launcher, pmi2.rank, pmi2.world_size) == ("srun", 4, 7)
    hydra = detect(srun_env(**{**HYDRA, "PMI_RANK": "6", "PMI_SIZE": "8"}))
    assert (hydra.launcher, hydra.rank, hydra.world_size) == ("pmi", 6, 8)
    assert hydra.master_addr == "gpu007"  # several nodes: the job's first


def test_mvapich2_mpirun_rsh() -> None:
    env = {
        "MV2_COMM_WORLD_RANK": "1",
        "MV2_COMM_WORLD_SIZE": "2",
        "MV2_COMM_WORLD_LOCAL_RANK": "1",
        "MV2_COMM_WORLD_LOCAL_SIZE": "2",
        "MPIRUN_ID": "31337",
    }
    info = detect(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("mvapich2", 1, 2, 1)
    assert info.master_port == master_port_for_job("31337")


def test_mpirun_with_one_process_is_a_world_of_one() -> None:
    env = {**OMPI, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    env.update(OMPI_COMM_WORLD_LOCAL_RANK="0", OMPI_COMM_WORLD_LOCAL_SIZE="1", PMIX_RANK="0")
    info = detect(env)
    assert (info.launcher, info.world_size, info.is_distributed) == ("openmpi", 1, False)


MPI_BAD = [
    (
        {**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "4"},
        "Open MPI started 4 ranks on several nodes (2 here) and MASTER_ADDR is not set",
    ),
    ({"PMI_RANK": "1"}, "PMI_RANK is set but PMI_SIZE is not"),
    ({"PMI_SIZE": "4"}, "PMI_SIZE is set but PMI_RANK is not"),
    (
        {"PMI_RANK": "1", "PMI_SIZE": "4", "MASTER_PORT": "1"},
        "PMI_SIZE=4 but MPI_LOCALRANKID / PMI_LOCAL_RANK / PALS_LOCAL_RANKID is not set",
    ),
    (
        {**OMPI, "OMPI_COMM_WORLD_RANK": "2"},
        "OMPI_COMM_WORLD_RANK=2 must be < OMPI_COMM_WORLD_SIZE",
    ),
    ({**OMPI, "OMPI_COMM_WORLD_SIZE": "two"}, "OMPI_COMM_WORLD_SIZE='two' is not an integer"),
    # Hydra's -pmi-port mode: a rank id but no size; nothing a process can resolve alone.
    ({"PMI_ID": "1", "PMI_PORT": "n1:4000", "MPI_LOCALRANKID": "1"}, "PMI_ID=1 says this"),
    ({"PMIX_RANK": "3"}, "PMIX_RANK=3 says this process is one of several"),
    ({"FLUX_TASK_RANK": "1", "FLUX_JOB_SIZE": "2"}, "FLUX_TASK_RANK=1 says"),
    ({"LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE=4 says"),
    ({"MPI_LOCALNRANKS": "x"}, "MPI_LOCALNRANKS=x says"),
]


@pytest.mark.parametrize(("env", "message"), MPI_BAD)
def test_unresolvable_multi_process_launch_is_an_error(env: dict[str, str], message: str) -> None:
    """Never N silent copies of a world of one."""
    with pytest.raises(DistConfigError) as e:
        detect(env)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_launcher_variables_of_one_process_are_harmless() -> None:
    """Rank 0 of 1 (a PMIx singleton, LOCAL_RANK=0 exported by a script) is one process."""
    for env in ({"PMIX_RANK": "0"}, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, {"PMI_ID": "0"}):
        assert detect(env).launcher == "single", env


def test_fallback_ports() -> None:
    port = master_port_for_job("1")
    ports = fallback_ports(port)
    assert ports[0] == port and len(set(ports)) == len(ports) == 8
    assert all(20000 <= p < 30000 for p in ports)
    # The job's neighbours' derived ports and its other steps' are not among its fallbacks.
    others = {master_port_for_job(j, s) for j in range(-20, 22) for s in range(3)} - {port}
    assert not others & set(ports[1:])
    assert fallback_ports(29500) == [29500, *fallback_ports(29500)[1:]]
    assert fallback_ports(40000) == [40000]  # not a derived port: nothing to fall back to
    assert detect(srun_env()).derived_port
    assert not detect(srun_env(MASTER_PORT="29400")).derived_port


STALE = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}  # left exported in a shell (issue 30)


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({**OMPI, **STALE}, "Open MPI's OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=2"),
        ({**srun_env(SLURM_PROCID="0"), **STALE}, "srun's SLURM_PROCID=0 SLURM_STEP_NUM_TASKS=7"),
        ({**HYDRA, **STALE, "MASTER_PORT": "1"}, "MPICH/Intel MPI/PMI's PMI_RANK=3 PMI_SIZE=4"),
    ],
)
def test_stale_torchrun_variables_under_another_launcher_are_an_error(
    env: dict[str, str], names: str
) -> None:
    """`mpirun -x RANK=0 -x WORLD_SIZE=1` or `srun -n 2` from a shell exporting them: not N
    silent worlds of one, one line naming both launchers' variables and the fix."""
    with pytest.raises(DistConfigError) as e:
        detect(env)
    msg = str(e.value)
    assert "RANK=0 WORLD_SIZE=1 (torchrun's variables" in msg and names in msg, msg
    assert "unset RANK WORLD_SIZE LOCAL_RANK" in msg and "\n" not in msg


def test_torchrun_variables_that_agree_with_the_launcher_or_come_from_torchrun_are_fine() -> None:
    # A script that exports RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS itself: they agree.
    mine = {"RANK": "4", "WORLD_SIZE": "7", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    info = detect({**srun_env(), **mine})
    assert (info.launcher, info.rank, info.world_size) == ("torchrun", 4, 7)
    # torchrun under mpirun or srun: its own numbers, whatever the outer launcher says.
    assert detect({**OMPI, **TORCHRUN}).launcher == "torchrun"
    # A launcher of one's own in each of 2 srun tasks, 4 processes each: task 1's third.
    own = {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}
    two = srun_env(SLURM_PROCID="1", SLURM_NODEID="1", SLURM_STEP_NUM_TASKS="2")
    two.update(SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_STEP_NUM_NODES="2")
    assert detect({**two, **own}).rank == 6
    with pytest.raises(DistConfigError, match="SLURM_PROCID=1 SLURM_STEP_NUM_TASKS=2"):
        detect({**two, **own, "RANK": "2"})  # task 0's block: the same export in every task
    # An outer launcher of one process: torchrun's variables describe what it started.
    one = {**OMPI, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    info = detect({**one, **TORCHRUN, "TORCHELASTIC_RUN_ID": ""})
    assert (info.launcher, info.world_size) == ("torchrun", 8)
