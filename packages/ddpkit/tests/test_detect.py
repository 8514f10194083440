"""detect() on fake environments: precedence, derived master, and one-line errors."""

from __future__ import annotations

import dataclasses

import pytest

from ddpkit import DistConfigError, DistInfo, detect, master_port_for_job

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
