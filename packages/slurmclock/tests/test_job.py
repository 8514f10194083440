"""slurmclock.job: the job's facts, who leads, the exit codes; slurmclock.slurm: SLURM behind the
Scheduler interface (canned command output, a fake scheduler). Under a real mpirun in a real
batch job: test_slurm.py."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import slurmclock
from slurmclock import (
    CommandError,
    DeadlineWatcher,
    JobFacts,
    JobTimeline,
    JobView,
    Node,
    Slurm,
    is_leader,
    job_facts,
    requeue,
    this_job,
    watches_the_clock,
)
from slurmclock.deadline import CLOCK_RANK_POLL, OTHER_RANK_POLL
from slurmclock.job import JobState, tasks_per_node

# -- exit codes: one definition -------------------------------------------------------------------


def test_exit_codes_are_the_contract() -> None:
    from slurmclock import loop
    from slurmclock.supervisor import config

    codes = {
        "EXIT_FINISHED": 0,
        "EXIT_ERROR": 1,
        "EXIT_USAGE": 2,
        "EXIT_PEER_LOST": 69,
        "EXIT_STORE_UNAVAILABLE": 74,
        "EXIT_STOPPED": 75,
    }
    assert {name: getattr(slurmclock, name) for name in codes} == codes
    assert sorted(slurmclock.EXIT_CODES) == sorted(codes.values())
    # The loop and the supervisor act on the same 75 (it was written twice).
    assert loop.EXIT_STOPPED is config.EXIT_STOPPED is slurmclock.job.EXIT_STOPPED


# -- who leads: one reading of every launcher's variables ---------------------------------------

LEADS = [
    ({}, True),
    ({"RANK": "0"}, True),
    ({"RANK": "3"}, False),
    ({"SLURM_PROCID": "0"}, True),
    ({"SLURM_PROCID": "1"}, False),
    ({"RANK": "0", "SLURM_PROCID": "5"}, True),  # torchrun's global rank first
    ({"OMPI_COMM_WORLD_RANK": "2"}, False),
    ({"PMI_RANK": "0"}, True),
    ({"PMIX_RANK": "1"}, False),
    ({"RANK": "zero"}, False),  # not a number: not the leader (two leaders would write twice)
    # mpirun inside sbatch: every rank inherits the batch shell's SLURM_PROCID=0
    ({"SLURM_PROCID": "0", "OMPI_COMM_WORLD_RANK": "1"}, False),
    ({"SLURM_PROCID": "0", "OMPI_COMM_WORLD_RANK": "0"}, True),
    ({"SLURM_PROCID": "0", "PMI_RANK": "2"}, False),  # MPICH's mpiexec the same way
    ({"SLURM_PROCID": "0", "PMIX_RANK": "3"}, False),
]


@pytest.mark.parametrize(("env", "leads"), LEADS)
def test_the_timeline_and_the_clock_have_one_leader(
    env: dict[str, str], leads: bool, tmp_path: Path
) -> None:
    """Before, the timeline read RANK then SLURM_PROCID and the clock RANK, SLURM_PROCID,
    OMPI_COMM_WORLD_RANK, PMI_RANK: under mpirun in a batch job every rank led both."""
    job = {"SLURM_JOB_ID": "7", **env}
    assert is_leader(env=env) is leads and watches_the_clock(env) is leads
    assert JobTimeline(directory=tmp_path, env=job).writer is leads
    watcher = DeadlineWatcher(env=job, runner=lambda argv, timeout: "", clock=lambda: 0.0)
    assert watcher.poll_interval == (CLOCK_RANK_POLL if leads else OTHER_RANK_POLL)


def test_a_rank_the_caller_passes_wins_over_the_environment(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "7", "RANK": "0"}
    assert not JobTimeline(directory=tmp_path, env=env, rank=1).writer
    assert JobTimeline(directory=tmp_path, env={**env, "RANK": "4"}, rank=0).writer
    clock = DeadlineWatcher(env=env, rank=2, runner=lambda a, t: "", clock=lambda: 0.0)
    assert clock.poll_interval == OTHER_RANK_POLL
    assert is_leader(0, env={"RANK": "5"}) and not is_leader(3, env={})


def test_a_garbage_rank_is_named_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="slurmclock"):
        assert slurmclock.global_rank({"RANK": "zero"}) == -1
        assert slurmclock.global_rank({"RANK": "zero"}) == -1
    assert caplog.text.count("RANK='zero' is not a whole number") == 1


# -- the job's facts ---------------------------------------------------------------------------


def test_this_job_is_read_from_the_environment() -> None:
    env = {
        "SLURM_JOB_ID": "0036",
        "SLURM_ARRAY_JOB_ID": "35",
        "SLURM_ARRAY_TASK_ID": "1",
        "SLURM_RESTART_COUNT": "2",
        "SLURM_CLUSTER_NAME": "ci",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_PROCID": "1",
    }
    assert this_job(env) == JobFacts(
        job_id="36",
        array_task="35_1",
        restart=2,
        cluster="ci",
        nodes="n[1-2]",
        num_nodes=2,
        rank=1,
    )
    assert not this_job(env).leader and this_job(env, rank=0).leader
    assert this_job({}) == JobFacts(job_id=None)


def test_another_jobs_facts_come_from_the_scheduler(fakes: Any) -> None:
    view = JobView(state=JobState.ACTIVE, restarts=1, nodes="n3", num_nodes=1, array_task="35_1")
    scheduler = fakes.Scheduler({"36": view})
    facts = job_facts("0036", scheduler, env={"SLURM_JOB_ID": "40", "SLURM_RESTART_COUNT": "7"})
    assert (facts.job_id, facts.restart, facts.array_task, facts.nodes) == ("36", 1, "35_1", "n3")
    assert facts.source == "scontrol" and facts.cluster is None
    # From a shell on the cluster, the cluster is this shell's; its own job is its environment.
    assert job_facts("36", scheduler, env={"SLURM_CLUSTER_NAME": "ci"}).cluster == "ci"
    own = job_facts("40", scheduler, env={"SLURM_JOB_ID": "40", "SLURM_RESTART_COUNT": "7"})
    assert own.restart == 7 and own.source == "environment"


def test_a_job_the_scheduler_does_not_know_stays_unknown(
    fakes: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="slurmclock"):
        facts = job_facts("99", fakes.Scheduler(), env={})
    assert facts == JobFacts(job_id="99", restart=None, source="none")
    assert "Invalid job id specified; the facts of job 99 stay unknown" in caplog.text


# -- SLURM behind the interface -----------------------------------------------------------------

SHOW = (
    "JobId=36 ArrayJobId=35 ArrayTaskId=1 JobName=train JobState=RUNNING Reason=None "
    "Restarts=1 Partition=debug NodeList=n[1-2] NumNodes=2-2 ExcNodeList=(null) "
    "EndTime=2026-11-25T18:24:58 TimeLimit=01:00:00"
)


def test_slurm_reads_what_its_commands_print(fakes: Any) -> None:
    runner = fakes.Runner(
        squeue=lambda argv: "2026-11-25T18:24:58 1:00:00\n" if "%e %l" in argv else "N/A\n",
        scontrol=lambda argv: {
            ("show", "job", "-o", "36"): SHOW,
            ("show", "job", "36"): SHOW.replace(" ", "\n   "),
            ("show", "hostnames", "n[1-2]"): "n1\nn2\n",
            ("show", "config"): "Configuration data\nClusterName             = ci\n",
        }.get(tuple(argv[1:]), ""),
        sinfo="n1 idle\nn2 down*\nn3 drain\nn4 alloc\nn5 mix*\n",
        scancel="",
    )
    slurm = Slurm(runner)
    quick, full = slurm.end_time("36"), slurm.end_time("36", thorough=True)
    assert (quick.end, quick.limit, quick.source) == ("2026-11-25T18:24:58", 3600.0, "squeue")
    assert (full.end, full.limit, full.source) == ("2026-11-25T18:24:58", 3600.0, "scontrol")
    view = slurm.show_job("36")
    assert (view.restarts, view.array_task, view.nodes, view.num_nodes) == (1, "35_1", "n[1-2]", 2)
    assert view.exc_nodes == "" and view.state == JobState.ACTIVE == "active"
    assert slurm.hostnames("n[1-2]") == ["n1", "n2"] and slurm.hostnames("") == []
    assert slurm.cluster_name() == "ci"
    assert [(n.name, n.usable) for n in slurm.nodes("debug")] == [
        ("n1", True),
        ("n2", False),
        ("n3", False),
        ("n4", True),
        ("n5", False),  # not responding: SLURM schedules nothing there
    ]
    slurm.requeue("36")
    slurm.update_job("36", ExcNodeList="n2")
    slurm.signal("36", "TERM", batch=True)
    slurm.signal("36", "USR2")
    assert runner.calls[-4:] == [
        ("scontrol", "requeue", "36"),
        ("scontrol", "update", "JobId=36", "ExcNodeList=n2"),
        ("scancel", "--batch", "--signal=TERM", "36"),
        ("scancel", "--signal=USR2", "36"),
    ]
    with pytest.raises(CommandError, match=r"squeue gives job 36 no start time \('N/A'\)") as e:
        slurm.start_time("36")
    assert e.value.kind == "output"


def test_slurm_steps_as_squeue_lists_them_and_placed_launches(fakes: Any) -> None:
    """What SLURM 22.05 printed for `squeue -h -s -j 1 -o "%i %N %j"` with a step stuck on a
    lost node, the supervisor's probe and a relaunch; scancel of one step; srun placed."""
    listed = (
        "1.0 ne5551537-[1-2] python3\n1.3 ne5551537-2 slurmclock-probe\n"
        "1.2 ne5551537-1 pyrecover-train\n1.batch ne5551537-1 batch\n"
    )
    runner = fakes.Runner(squeue=listed, scancel="", srun="")
    slurm = Slurm(runner)
    steps = slurm.steps("1")
    assert [(s.id, s.number, s.name) for s in steps] == [
        ("1.0", 0, "python3"),
        ("1.3", 3, "slurmclock-probe"),
        ("1.2", 2, "pyrecover-train"),
        ("1.batch", None, "batch"),
    ]
    assert steps[0].nodes == "ne5551537-[1-2]"
    slurm.cancel_step("1.2")
    slurm.probe_node("1", "n2", timeout=5)
    assert runner.calls[1:] == [
        ("scancel", "1.2"),
        ("srun", "--jobid=1", "--overlap", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1",
         "--nodelist=n2", "--job-name=slurmclock-probe", "--quiet", "true"),
    ]  # fmt: skip
    step = ["/usr/bin/srun", "--kill-on-bad-exit=1", "train"]
    placed = slurm.step_command(step, ["n1", "n3"], tasks_per_node=4, overlap=True)
    assert placed == [
        "/usr/bin/srun", "--nodes=2", "--nodelist=n1,n3", "--ntasks=8", "--overlap",
        "--kill-on-bad-exit=1", "train",
    ]  # fmt: skip
    assert slurm.step_command(step, None) == step
    assert slurm.step_command(["mpirun", "train"], ["n1"], overlap=True) == ["mpirun", "train"]
    helper = slurm.helper_command("1", "n3", ["python", "-c", "w"], name="slurmclock-sentinel")
    assert helper == [
        "srun", "--jobid=1", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=n3",
        "--job-name=slurmclock-sentinel", "--quiet", "python", "-c", "w",
    ]  # fmt: skip


def test_slurm_names_its_own_command_whatever_the_runner_says(fakes: Any) -> None:
    def buggy(argv: Any, timeout: float) -> str:
        raise ZeroDivisionError("oops")

    with pytest.raises(CommandError) as e:
        Slurm(buggy).requeue("5")
    assert (
        e.value.kind == "error" and str(e.value) == "scontrol runner raised ZeroDivisionError: oops"
    )
    lying = fakes.Runner(squeue=CommandError(["x"], "timeout", "slow"))
    with pytest.raises(CommandError) as e:
        Slurm(lying).end_time("5")
    assert e.value.argv == ("squeue", "-h", "-o", "%e %l", "-j", "5") and e.value.kind == "timeout"
    with pytest.raises(CommandError, match="printed no ClusterName"):
        Slurm(fakes.Runner(scontrol="nothing\n")).cluster_name()


def test_a_second_scheduler_plugs_in_everywhere(fakes: Any, tmp_path: Path) -> None:
    """What slurmclock asks of SLURM goes through the interface: a fake scheduler is enough
    for the deadline, the requeue and another job's facts (no command runs)."""
    scheduler = fakes.Scheduler({"8": JobView(state=JobState.ACTIVE, restarts=0)})
    scheduler.ends["8"] = slurmclock.EndTime("1900000600", 3600.0, "fake")
    env = {"SLURM_JOB_ID": "8"}
    found = DeadlineWatcher(env=env, scheduler=scheduler, clock=lambda: 1_900_000_000.0).get()
    assert (found.end, found.source) == (1_900_000_600.0, "fake")
    timeline = JobTimeline(directory=tmp_path, env=env)
    assert requeue(env=env, scheduler=scheduler, timeline=timeline).ok
    assert job_facts("8", scheduler, env={}).restart == 1
    assert [e.name for e in timeline.events()] == ["requeued"]
    with pytest.raises(TypeError, match="not both"):
        DeadlineWatcher(env=env, scheduler=scheduler, runner=fakes.Runner())


@pytest.mark.parametrize(
    ("env", "per_node"),
    [
        ({"SLURM_NTASKS_PER_NODE": "4", "SLURM_TASKS_PER_NODE": "4(x2)"}, 4),
        ({"SLURM_TASKS_PER_NODE": "2(x3)"}, 2),
        ({"SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NTASKS": "7", "SLURM_NNODES": "4"}, None),
        ({"SLURM_NTASKS": "6", "SLURM_JOB_NUM_NODES": "3"}, 2),
        ({}, None),
        ({"SLURM_NTASKS_PER_NODE": "x"}, None),
    ],
)
def test_tasks_per_node(env: dict[str, str], per_node: int | None) -> None:
    """What the supervisor places a step with; an uneven layout gives no count."""
    assert tasks_per_node(env) == per_node


def test_the_supervisor_excludes_a_node_through_the_interface(fakes: Any, tmp_path: Path) -> None:
    from slurmclock.supervisor.lostnodes import NodeKeeper

    view = JobView(state=JobState.ACTIVE, partition="p", num_nodes=1, exc_nodes="")
    scheduler = fakes.Scheduler({"9": view})
    scheduler.partitions["p"] = [Node("n1", "idle", True), Node("n2", "alloc", True)]
    scheduler.dead.add("n2")
    said: list[str] = []
    keeper = NodeKeeper(scheduler, "9", log=said.append, timeout=5, probe_timeout=5, here="n1")
    assert keeper.lost(["n2", "n1"]) == {"n2"}  # its own node answers by being there
    assert ("probe_node", "9", "n2") in scheduler.calls
    assert ("probe_node", "9", "n1") not in scheduler.calls
    plan = keeper.before_requeue(view, 1, asked=1)
    assert (plan.exclude, plan.nodes, plan.give_up) == (("n2",), None, None)
