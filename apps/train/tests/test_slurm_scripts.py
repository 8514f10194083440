"""The sbatch scripts' own logic, with fake ``srun``/``sbatch``/``scontrol``/``scancel`` on PATH and
the real ``slurmclock supervise`` (no SLURM needed): the original's interface, trainer-flag
passthrough, resume on restart, what each exit status of the training step and each kind of
SIGTERM lead to, the crash budget, the job-array and ``--dependency=afterany`` alternatives,
dataset staging, self-submission; plus ``bash -n`` and shellcheck. The real-SLURM runs are in
e2e/ (the fault matrix)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from train_helpers import ROOT

SLURM_DIR = ROOT / "apps" / "train" / "slurm"
SIMPLE = SLURM_DIR / "submit-training-simple.sh"
CHAIN = SLURM_DIR / "submit-chain.sh"
VENV_BIN = str(Path(sys.executable).parent)  # the real slurmclock
RUNNING = "JobState=RUNNING Reason=None Restarts=0"
AT_LIMIT = "JobState=COMPLETING Reason=TimeLimit Restarts=0"

FAKE_SRUN = r"""#!/bin/bash
# Records each call's arguments (and the signal lead it was given); runs staging commands
# (bash -c); the training step exits with $FAKE_RC, or with FAKE_WAIT_TERM=1 waits for SIGTERM
# and then exits 75, as the trainer does (or $FAKE_TERM_RC: 143 = killed by it).
n=$(find "$FAKE_DIR" -name 'srun.*.args' | wc -l)
echo "${PYRECOVER_SIGNAL_LEAD-unset}" > "$FAKE_DIR/srun.$n.lead"
[ -n "${FAKE_SRUN_ENV:-}" ] && echo "${!FAKE_SRUN_ENV-unset}" > "$FAKE_DIR/srun.env"
echo $$ > "$FAKE_DIR/srun.pid"
printf '%s\n' "$@" > "$FAKE_DIR/srun.$n.args.tmp"
mv "$FAKE_DIR/srun.$n.args.tmp" "$FAKE_DIR/srun.$n.args"
while [ $# -gt 0 ] && [[ $1 == --* ]]; do shift; done
if [ "${1:-}" = bash ]; then exec "$@"; fi
if [ "${FAKE_WAIT_TERM:-0}" = 1 ]; then
    trap 'exit ${FAKE_TERM_RC:-75}' TERM
    trap 'echo USR2 >> "$FAKE_DIR/srun.signals"' USR2
    for _ in $(seq 1 600); do sleep 0.1; done
    exit 1
fi
exit "${FAKE_RC:-0}"
"""
FAKE_SCONTROL = r"""#!/bin/bash
# Records the call; `show job` prints $FAKE_JOB (what SLURM says about the job), `requeue` exits
# with $FAKE_REQUEUE_RC (default 0), `show hostnames` prints its argument.
echo "scontrol $*" >> "$FAKE_DIR/calls.log"
case "$1 ${2:-}" in
    "show job") echo "JobId=4242 ${FAKE_JOB:-JobState=RUNNING Reason=None Restarts=0}" ;;
    "show hostnames") echo "$3" | tr ',' '\n' ;;
    "requeue "*) exit "${FAKE_REQUEUE_RC:-0}" ;;
esac
exit 0
"""
FAKE_RECORDER = r"""#!/bin/bash
# Appends "NAME ARGS..." to calls.log; prints $FAKE_<NAME>_OUT; exits with $FAKE_<NAME>_RC
# (default 0).
name=$(basename "$0")
echo "$name $*" >> "$FAKE_DIR/calls.log"
upper=$(echo "$name" | tr '[:lower:]' '[:upper:]')
out="FAKE_${upper}_OUT"
[ -n "${!out:-}" ] && echo "${!out}"
var="FAKE_${upper}_RC"
exit "${!var:-0}"
"""
FAKE_SCANCEL = r"""#!/bin/bash
# Records the call; `scancel --signal=SIG JOB` (no --batch) signals the step's tasks: here the
# fake srun, which stands for them.
echo "scancel $*" >> "$FAKE_DIR/calls.log"
sig=${1#--signal=}
kill -s "$sig" "$(cat "$FAKE_DIR/srun.pid")"
"""
FAKE_SBATCH = r"""#!/bin/bash
# Records each submission (one argument per line, then ---) and prints a job id (--parsable);
# --test-only exits with $FAKE_TEST_ONLY_RC (default 0) and records nothing.
if [ "${1:-}" = --test-only ]; then
    echo "sbatch --test-only" >> "$FAKE_DIR/calls.log"
    said="allocation failure: Requested node configuration is not available"
    [ "${FAKE_TEST_ONLY_RC:-0}" = 0 ] || echo "$said" >&2
    exit "${FAKE_TEST_ONLY_RC:-0}"
fi
n=$(grep -c '^---$' "$FAKE_DIR/sbatch.log" 2>/dev/null)
{ printf '%s\n' "$@"; echo ---; echo "PYRECOVER_CHAIN=${PYRECOVER_CHAIN:-}"; echo ---; } \
    >> "$FAKE_DIR/sbatch.log"
echo "$((1000 + ${n:-0} / 2));cluster"
"""


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (
        ("srun", FAKE_SRUN),
        ("sbatch", FAKE_SBATCH),
        ("scontrol", FAKE_SCONTROL),
        ("sinfo", FAKE_RECORDER),
        ("squeue", FAKE_RECORDER),
        ("scancel", FAKE_SCANCEL),
        ("pyrecover-train", "#!/bin/bash\nexit 0\n"),  # what TRAIN_CMD finds (srun is fake)
        ("my-train", "#!/bin/bash\nexit 0\n"),
    ):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    return tmp_path


def run_script(
    fake: Path, script: Path, *args: str, job: bool = True, **env: str
) -> subprocess.CompletedProcess[str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "SBATCH_", "PYRECOVER_", "FAKE_", "SLURMCLOCK_"))
        and k not in ("PARTITION", "ACCOUNT", "MODULES", "PYTHON_ENV", "CONTAINER", "TRAIN_CMD")
    }
    base["PATH"] = os.pathsep.join([str(fake / "bin"), VENV_BIN, base.get("PATH", "")])
    base["FAKE_DIR"] = str(fake)
    base["SLURMCLOCK_DIR"] = str(fake / "timelines")
    if job:
        base.update(
            SLURM_JOB_ID="4242", SLURM_NNODES="1", SLURM_NTASKS="4", SLURM_JOB_NODELIST="n1"
        )
    base.update(env)
    return subprocess.run(
        ["bash", str(script), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=base,
        cwd=fake,
    )


def srun_calls(fake: Path) -> list[list[str]]:
    files = sorted(fake.glob("srun.*.args"), key=lambda p: int(p.name.split(".")[1]))
    return [p.read_text().splitlines() for p in files]


def all_calls(fake: Path) -> list[str]:
    log = fake / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def calls(fake: Path) -> list[str]:
    """The calls that act on the job (queries left out)."""
    queries = ("scontrol show ", "sinfo ", "squeue ")
    return [c for c in all_calls(fake) if not c.startswith(queries)]


def little_time_left(seconds: float = 20.0) -> dict[str, str]:
    """squeue's answer for a job that ends in ``seconds``: no time for a restart in it."""
    end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + seconds))
    return {"FAKE_SQUEUE_OUT": f"{end} 1:00"}


PLACED = ["--nodes=1", "--nodelist=n1"]  # the supervisor places the step on the job's node


def marks(fake: Path) -> list[str]:
    """The job's timeline (the real slurmclock's), one "EVENT k=v ..." per line."""
    path = fake / "timelines" / "job-4242.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        info = [
            f"{k}={v}"
            for k, v in rec.items()
            if k not in ("event", "time", "restart", "host", "pid")
        ]
        out.append(" ".join([rec["event"], *info]))
    return out


def test_scripts_parse_and_pass_shellcheck() -> None:
    for script in (SIMPLE, CHAIN):
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert os.access(script, os.X_OK) or script.read_text().startswith("#!/bin/bash")
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    r = subprocess.run(
        ["shellcheck", str(SIMPLE), str(CHAIN)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_sbatch_header_has_signal_requeue_append() -> None:
    text = SIMPLE.read_text()
    for line in (
        "#SBATCH --signal=B:USR2@",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
    ):
        assert line in text
    # No cluster-specific settings hard-coded: partition/account/modules/container are variables.
    assert "#SBATCH --partition" not in text and "#SBATCH --account" not in text
    for var in ("PARTITION", "ACCOUNT", "MODULES", "CONTAINER"):
        assert f"{var}=${{{var}:-" in text


def test_original_interface_and_passthrough(fake: Path) -> None:
    r = run_script(
        fake,
        SIMPLE,
        "--distributed",
        "--exp_name=run1",
        "--continue",
        "--use_torch_distributed_ckpt",
        "--model-size",
        "1b",
        "--sequence-length=4096",
        "--async-checkpoint",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (call,) = srun_calls(fake)
    assert call[:5] == [*PLACED, "--ntasks=4", "--kill-on-bad-exit=1", "pyrecover-train"]
    assert call[5:] == [
        "--experiment_name",
        "run1",
        "--distributed",
        "--use-torch-distributed-ckpt",
        "--resume-from-checkpoint",
        "latest",
        "--model-size",
        "1b",
        "--sequence-length=4096",
        "--async-checkpoint",
    ]
    assert "training finished" in r.stdout and calls(fake) == []  # no requeue


def test_defaults_single_task_and_fresh_start(fake: Path) -> None:
    r = run_script(fake, SIMPLE, "--training-steps", "50", TRAIN_CMD="my-train")
    assert r.returncode == 0, r.stdout + r.stderr
    (call,) = srun_calls(fake)
    # Without --distributed one task, even in a 4-task allocation; no resume on a first start.
    assert call == [
        *PLACED,
        "--ntasks=1",
        "--ntasks=1",
        "--kill-on-bad-exit=1",
        "my-train",
        "--experiment_name",
        "default-exp",
        "--training-steps",
        "50",
    ]


def test_restarted_job_resumes_from_latest(fake: Path) -> None:
    r = run_script(fake, SIMPLE, "--exp_name=x", SLURM_RESTART_COUNT="2")
    assert r.returncode == 0, r.stdout + r.stderr
    (call,) = srun_calls(fake)
    assert call[-2:] == ["--resume-from-checkpoint", "latest"]
    assert "restart 2" in r.stdout


def test_stopped_early_requeues_itself(fake: Path) -> None:
    r = run_script(fake, SIMPLE, "--exp_name=x", FAKE_RC="75")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "submit-training-simple: training step exited with status 75" in r.stdout
    assert "stopped early with steps left: requeueing" in r.stdout
    assert "requeued job 4242 (restart 1)" in r.stdout
    assert calls(fake) == ["scontrol requeue 4242"]


def test_without_slurmclock_it_says_so_and_requeues_after_75_only(fake: Path) -> None:
    path = os.pathsep.join(
        p
        for p in os.environ.get("PATH", "").split(os.pathsep)
        if p and not (Path(p) / "slurmclock").exists()
    )
    r = run_script(fake, SIMPLE, FAKE_RC="75", PATH=f"{fake / 'bin'}{os.pathsep}{path}")
    assert r.returncode == 0, r.stdout + r.stderr
    said = [line for line in r.stdout.splitlines() if "slurmclock not found" in line]
    assert len(said) == 1 and "requeueing only after exit 75" in said[0], r.stdout
    assert calls(fake) == ["scontrol requeue 4242"]


def test_failed_requeue_exits_75_and_says_what_to_do(fake: Path) -> None:
    r = run_script(fake, SIMPLE, FAKE_RC="75", FAKE_REQUEUE_RC="1")
    assert r.returncode == 75, r.stdout + r.stderr
    assert "requeue failed: submit again with --continue" in r.stdout


@pytest.mark.parametrize(
    "env",
    [{"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_JOB_ID": "4240"}, {"PYRECOVER_CHAIN": "1"}],
    ids=["array", "chain"],
)
def test_array_task_or_chained_job_does_not_requeue(fake: Path, env: dict[str, str]) -> None:
    r = run_script(fake, SIMPLE, "--continue", FAKE_RC="75", **env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "not requeueing (the next array task / chained job resumes)" in r.stdout
    assert calls(fake) == []
    (call,) = srun_calls(fake)
    assert call[-2:] == ["--resume-from-checkpoint", "latest"]


def test_requeue_off_in_a_plain_job_says_how_to_go_on_and_does_not_complete(fake: Path) -> None:
    """REQUEUE=0 outside an array or a chain (issue 30): there is no next job to speak of, and
    an unfinished run ends with its status (the job FAILED, not COMPLETED)."""
    r = run_script(fake, SIMPLE, "--continue", FAKE_RC="75", REQUEUE="0")
    assert r.returncode == 75, r.stdout + r.stderr
    assert "stopped early with steps left; not requeueing (requeue is off); to go on: submit " \
        "again with --continue" in r.stdout  # fmt: skip
    assert "next array task" not in r.stdout and calls(fake) == []


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"REQUEUE": "banana"}, "REQUEUE=banana: give auto (requeue unless in an array or a "
         "chain), 1, 0, successor or successor-early"),
        ({"MIN_NODES": "0"}, "MIN_NODES=0: give a whole number >= 1"),
        ({"SPARE_NODES": "one"}, "SPARE_NODES=one: give a whole number >= 0"),
        ({"TIME_MIN": "0:30", "REQUEUE": "successor", "TIME_LIMIT": "60"},
         "TIME_MIN=0:30: give whole minutes >= 1"),
        ({"TIME_MIN": "30", "TIME_LIMIT": "60"}, "TIME_MIN=30 needs REQUEUE=successor: a requeued "
         "job keeps the lowered limit"),
        ({"TIME_MIN": "30", "REQUEUE": "successor"}, "TIME_MIN=30 needs TIME_LIMIT"),
    ],
    ids=["REQUEUE", "MIN_NODES", "SPARE_NODES", "TIME_MIN", "TIME_MIN-requeue", "TIME_MIN-limit"],
)  # fmt: skip
@pytest.mark.parametrize("job", [True, False], ids=["in-job", "submitting"])
def test_a_bad_setting_is_one_line_and_nothing_runs(
    fake: Path, env: dict[str, str], said: str, job: bool
) -> None:
    r = run_script(fake, SIMPLE, job=job, **env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout.count("\n") == 1 and f"usage error: {said}" in r.stdout
    assert srun_calls(fake) == [] and all_calls(fake) == []
    assert not (fake / "sbatch.log").exists()


def test_successor_instead_of_requeue_keeps_script_arguments_and_time_min(fake: Path) -> None:
    """REQUEUE=successor (issue 35): exit 75 submits the same script with the same arguments
    after this job (afterany), with TIME_LIMIT and TIME_MIN; no scontrol requeue."""
    r = run_script(
        fake, SIMPLE, "--exp_name", "a b", "--lr", "0.1", FAKE_RC="75", REQUEUE="successor",
        TIME_LIMIT="60", TIME_MIN="20", SLURM_JOB_NAME="pyrecover", SLURM_JOB_NUM_NODES="1",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "submitted job 1000 to resume after job 4242 ends" in r.stdout
    assert not any(c.startswith("scontrol requeue") for c in all_calls(fake))
    argv = (fake / "sbatch.log").read_text().split("---\n")[0].splitlines()
    assert argv[:5] == [
        "--parsable",
        "--dependency=afterany:4242",
        "--kill-on-invalid-dep=yes",
        "--export=ALL,SLURMCLOCK_CHAIN_INDEX=1,SLURMCLOCK_CHAIN_ID=4242",  # slurmclock.chain
        "--time-min=20",
    ]
    assert "--time=60" in argv and "--nodes=1" in argv and "--job-name=pyrecover" in argv
    script = argv.index(str(SIMPLE))
    assert argv[script + 1 :] == ["--continue", "--exp_name", "a b", "--lr", "0.1"]


def test_successor_early_reaches_the_supervisor(fake: Path) -> None:
    """REQUEUE=successor-early (issue 35): supervise --successor-early; a stop before the
    early submission was due submits the successor at the stop, telling it its predecessor."""
    r = run_script(
        fake, SIMPLE, FAKE_RC="75", REQUEUE="successor-early", TIME_LIMIT="60", TIME_MIN="20"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "submitted job 1000 to resume after job 4242 ends" in r.stdout
    assert "handing the run to a successor job" in r.stdout and "requeueing" not in r.stdout
    argv = (fake / "sbatch.log").read_text().split("---\n")[0].splitlines()
    assert "--dependency=afterany:4242" in argv and "--time-min=20" in argv
    export = next(a for a in argv if a.startswith("--export="))
    exported = dict(item.split("=", 1) for item in export.split(",")[1:])
    assert exported["SLURMCLOCK_CHAIN_INDEX"] == "1" and exported["SLURMCLOCK_CHAIN_ID"] == "4242"
    assert exported["SLURMCLOCK_PREDECESSOR"] == "4242"


def test_time_limit_and_time_min_reach_the_submission(fake: Path) -> None:
    r = run_script(
        fake, SIMPLE, job=False, REQUEUE="successor", TIME_LIMIT="1:00:00", TIME_MIN="30"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    argv = (fake / "sbatch.log").read_text().split("---\n")[0].splitlines()
    assert "--time=1:00:00" in argv and "--time-min=30" in argv


def test_a_train_cmd_that_is_not_there_is_not_found(fake: Path) -> None:
    """TRAIN_CMD=/nonexistent (issue 30): srun's exec failure exits 2 (ENOENT), which read as
    a usage error; the script says "not found" before any step."""
    r = run_script(fake, SIMPLE, TRAIN_CMD="/nonexistent")
    assert r.returncode == 127, r.stdout + r.stderr
    assert "TRAIN_CMD=/nonexistent: not found here" in r.stdout
    assert "usage error" not in r.stdout and srun_calls(fake) == []


def test_restart_limit(fake: Path) -> None:
    r = run_script(fake, SIMPLE, FAKE_RC="75", SLURM_RESTART_COUNT="3", MAX_RESTARTS="3")
    assert r.returncode == 75, r.stdout + r.stderr
    assert "already restarted 3 times (max restarts)" in r.stdout and calls(fake) == []


def test_a_usage_error_is_not_retried(fake: Path) -> None:
    r = run_script(fake, SIMPLE, FAKE_RC="2")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "training failed (exit 2: a usage error, a retry cannot help)" in r.stdout
    assert calls(fake) == []


@pytest.mark.parametrize("rc", [1, 137])
def test_a_crash_starts_again_in_the_allocation_until_the_budget_is_spent(
    fake: Path, rc: int
) -> None:
    """With time left a crash starts the step again at once (no requeue), resuming; the third
    failure in a row at one checkpoint stops the chain with one line."""
    r = run_script(fake, SIMPLE, FAKE_RC=str(rc))
    assert r.returncode == rc, r.stdout + r.stderr
    first, *again = srun_calls(fake)
    assert len(again) == 2 and "--overlap" not in first and "--resume-from-checkpoint" not in first
    for call in again:  # a step that lost a node may still hold CPUs: --overlap
        assert call[:4] == [*PLACED, "--ntasks=1", "--overlap"]
        assert call[-2:] == ["--resume-from-checkpoint", "latest"]
    assert "failure 1 of 3 in a row before any checkpoint): starting it again in this " \
        "allocation" in r.stdout  # fmt: skip
    assert len([line for line in r.stdout.splitlines() if "gave up" in line]) == 1
    assert calls(fake) == []  # never requeued
    assert [m.split()[0] for m in marks(fake)].count("relaunched") == 2


@pytest.mark.parametrize("rc", [1, 137])
def test_a_crash_is_retried_until_the_budget_is_spent(fake: Path, rc: int) -> None:
    """Each allocation (no time left for a restart in it) that fails at the same checkpoint step
    counts; the third stops the chain with one line, here and in the job's timeline, naming
    what, where, how often, how to go on."""
    for restart in range(3):
        r = run_script(
            fake, SIMPLE, FAKE_RC=str(rc), SLURM_RESTART_COUNT=str(restart), **little_time_left()
        )
        if restart < 2:
            assert r.returncode == 0, r.stdout + r.stderr
            assert f"failure {restart + 1} of 3 in a row before any checkpoint" in r.stdout
    assert r.returncode == rc, r.stdout + r.stderr
    gave_up = [line for line in r.stdout.splitlines() if "gave up" in line]
    assert len(gave_up) == 1, r.stdout
    assert "failed 3 times in a row before any checkpoint" in gave_up[0]
    assert "submit again with --continue (or scontrol requeue 4242" in gave_up[0]
    assert calls(fake) == ["scontrol requeue 4242"] * 2
    assert [m.split()[0] for m in marks(fake)].count("failed") == 3
    assert marks(fake)[-1].startswith("gave_up why=gave up: the training step failed 3 times")


def test_progress_between_crashes_restarts_the_count(fake: Path) -> None:
    tl = fake / "timelines" / "job-4242.jsonl"
    for restart, step in enumerate((100, 200, 300, 400)):
        r = run_script(
            fake, SIMPLE, FAKE_RC="1", SLURM_RESTART_COUNT=str(restart), **little_time_left()
        )
        assert r.returncode == 0 and "failure 1 of 3" in r.stdout, r.stdout
        with tl.open("a") as f:  # the next allocation gets past a new checkpoint, then fails
            f.write(
                json.dumps(
                    {"event": "checkpoint", "time": 1.0, "restart": restart + 1, "step": step}
                )
                + "\n"
            )
    assert "at checkpoint step 300" in r.stdout


def test_dataset_staged_to_node_local_tmpdir(fake: Path) -> None:
    data = fake / "data"
    data.mkdir()
    (data / "part-0.parquet").write_bytes(b"PAR1 not really")
    local = fake / "nodelocal"
    local.mkdir()
    r = run_script(fake, SIMPLE, "--dataset", str(data), STAGE_DATASET="1", SLURM_TMPDIR=str(local))
    assert r.returncode == 0, r.stdout + r.stderr
    stage, train = srun_calls(fake)
    assert stage[:2] == ["--ntasks=1", "--ntasks-per-node=1"]
    staged = local / "dataset" / "data"
    assert (staged / "part-0.parquet").read_bytes() == b"PAR1 not really"
    assert train[train.index("--dataset") + 1] == str(staged)
    assert str(data) not in train


def test_outside_a_job_it_submits_itself(fake: Path) -> None:
    r = run_script(
        fake, SIMPLE, "--exp_name=x", "--continue", job=False, PARTITION="gpu", ACCOUNT="proj"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    args = (fake / "sbatch.log").read_text().split("---\n")[0].splitlines()
    assert args == ["--partition=gpu", "--account=proj", str(SIMPLE), "--exp_name=x", "--continue"]
    assert srun_calls(fake) == [] and all_calls(fake) == ["sbatch --test-only"]


def test_a_job_the_partition_cannot_give_is_not_submitted(fake: Path) -> None:
    """sbatch takes a job that asks for more nodes than the partition has (or can use: a node
    DOWN) and it pends for ever; --test-only says so first."""
    r = run_script(fake, SIMPLE, "--exp_name=x", job=False, FAKE_TEST_ONLY_RC="1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.count("\n") == 1 and "not submitted: SLURM cannot give this job what it " \
        "asks for (sbatch --test-only: allocation failure: Requested node configuration is not " \
        "available)" in r.stdout  # fmt: skip
    assert not (fake / "sbatch.log").exists()


def sbatch_submissions(fake: Path) -> list[tuple[list[str], str]]:
    parts = (fake / "sbatch.log").read_text().split("---\n")
    return [(parts[i].splitlines(), parts[i + 1].strip()) for i in range(0, len(parts) - 1, 2)]


def test_chain_submits_n_jobs_each_after_the_previous(fake: Path) -> None:
    r = run_script(
        fake, CHAIN, "3", "--time=04:00:00", "--", "--exp_name=big", "--distributed", job=False
    )
    assert r.returncode == 0, r.stdout + r.stderr
    subs = sbatch_submissions(fake)
    assert len(subs) == 3
    deps = []
    for args, env in subs:
        assert env == "PYRECOVER_CHAIN=1"
        assert args[:3] == ["--parsable", "--no-requeue", "--export=ALL,PYRECOVER_CHAIN=1"]
        assert args[-4:] == [str(SIMPLE), "--continue", "--exp_name=big", "--distributed"]
        assert "--time=04:00:00" in args
        deps.append([a for a in args if a.startswith("--dependency")])
    assert deps == [[], ["--dependency=afterany:1000"], ["--dependency=afterany:1001"]]
    assert r.stdout.splitlines() == [
        "job 1/3: 1000",
        "job 2/3: 1001 (after 1000)",
        "job 3/3: 1002 (after 1001)",
    ]


def test_chain_without_sbatch_options(fake: Path) -> None:
    r = run_script(fake, CHAIN, "2", "--exp_name=e", job=False, PARTITION="p")
    assert r.returncode == 0, r.stdout + r.stderr
    (first, _), (second, _) = sbatch_submissions(fake)
    assert first[-3:] == [str(SIMPLE), "--continue", "--exp_name=e"]
    assert "--partition=p" in first and "--dependency=afterany:1000" in second


@pytest.mark.parametrize("argv", [[], ["0"], ["two", "--exp_name=e"]], ids=["none", "0", "word"])
def test_chain_usage_error(fake: Path, argv: list[str]) -> None:
    r = run_script(fake, CHAIN, *argv, job=False)
    assert r.returncode == 2
    assert r.stderr.startswith("usage:") and len(r.stderr.strip().splitlines()) == 1
    assert not (fake / "sbatch.log").exists()


def test_exp_name_with_a_space_and_the_originals_flags_pass_through(fake: Path) -> None:
    originals = [
        "--timeaware-checkpointing",
        "--default-iter-time",
        "0.5",
        "--default-ckpt-time=30",
    ]
    r = run_script(fake, SIMPLE, "--exp_name", "run 7", *originals, "--experiment-name", "run8")
    assert r.returncode == 0, r.stdout + r.stderr
    (call,) = srun_calls(fake)
    assert call[6:8] == ["--experiment_name", "run8"]  # the last one given wins
    assert call[8:] == originals
    r = run_script(fake, SIMPLE, "--exp_name", "run 7")
    assert srun_calls(fake)[-1][6:8] == ["--experiment_name", "run 7"]


@pytest.mark.parametrize("argv", [["--exp_name"], ["--dataset"], ["--exp_name="]])
def test_a_script_flag_without_its_value_is_one_line_and_exit_2(
    fake: Path, argv: list[str]
) -> None:
    r = run_script(fake, SIMPLE, "--continue", *argv)
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [line for line in r.stdout.splitlines() if "usage error" in line]
    assert len(errors) == 1 and ("needs a value" in errors[0] or "is empty" in errors[0])
    assert srun_calls(fake) == [] and calls(fake) == []


def test_the_signal_lead_is_exported_from_the_sbatch_line(fake: Path) -> None:
    r = run_script(fake, SIMPLE)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (fake / "srun.0.lead").read_text().strip() == "300"  # #SBATCH --signal=B:USR2@300
    assert "warning signal lead: 300 s" in r.stdout
    r = run_script(fake, SIMPLE, PYRECOVER_SIGNAL_LEAD="45")  # sbatch --signal=B:USR2@45
    assert (fake / "srun.1.lead").read_text().strip() == "45"


def test_the_end_of_each_run_is_marked_in_the_timeline(fake: Path) -> None:
    r = run_script(fake, SIMPLE, FAKE_RC="75")
    assert r.returncode == 0, r.stdout + r.stderr
    assert marks(fake) == ["start chain=4242 link=0", "exited rc=75", "requeued confirmed=True"]
    assert calls(fake) == ["scontrol requeue 4242"]


def test_the_step_is_told_where_to_report_a_dead_rank(fake: Path) -> None:
    r = run_script(fake, SIMPLE, FAKE_RC="0", FAKE_SRUN_ENV="DDPKIT_FAULT_FILE")
    assert r.returncode == 0, r.stdout + r.stderr
    said = (fake / "srun.env").read_text().strip()
    assert said == str(fake / "timelines" / "job-4242.0-1.faults.jsonl")  # restart 0, launch 1


def start_script(fake: Path, script: Path = SIMPLE, **env: str) -> subprocess.Popen[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PYRECOVER_"))}
    base.update(PATH=os.pathsep.join([str(fake / "bin"), VENV_BIN, base.get("PATH", "")]))
    base.update(FAKE_DIR=str(fake), SLURMCLOCK_DIR=str(fake / "timelines"))
    base.update(SLURM_JOB_ID="4242", SLURM_NNODES="1", SLURM_NTASKS="1", FAKE_WAIT_TERM="1")
    base.update(env)
    args = ["--exp_name=x"] if script == SIMPLE else ["train"]
    proc = subprocess.Popen(
        ["bash", str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=base,
        cwd=fake,
    )
    deadline = time.monotonic() + 60
    while not (fake / "srun.0.args").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.3)  # the supervisor waits for the step
    return proc


def wait_for(what: str, ok: Any, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while not ok():
        assert time.monotonic() < deadline and proc.poll() is None, (what, proc.communicate())
        time.sleep(0.05)


def test_slurmclock_stop_saves_and_stops_without_requeue(fake: Path) -> None:
    """`slurmclock stop` (SIGTERM to the batch script; the job still RUNNING): the TERM reaches
    the tasks through SLURM, not through srun (which would kill the step); no requeue."""
    proc = start_script(fake, FAKE_JOB=RUNNING)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "received SIGTERM (slurmclock stop or scancel --batch): forwarding" in out
    assert "training step exited with status 75" in out
    assert "stopped on request (SIGTERM to the batch script" in out
    assert calls(fake) == ["scancel --signal=TERM 4242"]
    assert "signal name=TERM kind=stop" in marks(fake)


@pytest.mark.parametrize(
    "job",
    [AT_LIMIT, "JobState=COMPLETING Reason=None Restarts=0 PreemptTime=2026-11-25T18:29:12"],
    ids=["limit", "preempted"],
)
def test_at_the_time_limit_or_preemption_it_requeues_before_the_step_exits(
    fake: Path, job: str
) -> None:
    """SLURM kills the batch script KillWait after its SIGTERM, maybe before the step exits (a
    stuck file system, a slow save): the requeue comes first, the step is left to SLURM."""
    proc = start_script(fake, FAKE_JOB=job)
    proc.send_signal(signal.SIGTERM)
    wait_for("the requeue", lambda: "scontrol requeue 4242" in calls(fake), proc)
    assert proc.poll() is None  # the step still runs; the requeue did not wait for it
    os.kill(int((fake / "srun.pid").read_text()), signal.SIGKILL)  # SLURM's SIGKILL
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "requeueing job 4242 now, before the step has exited" in out
    assert "training step exited with status 137" in out
    assert "already requeued at the" in out
    assert calls(fake) == ["scontrol requeue 4242"]  # nothing forwarded: SLURM signals the tasks


@pytest.mark.parametrize(
    ("job", "said"),
    [
        ("JobState=COMPLETING Reason=None Restarts=0", "the job was cancelled (scancel)"),
        ("JobState=COMPLETING Reason=None Restarts=1", "SLURM requeued this job"),
    ],
    ids=["scancel", "requeued-by-slurm"],
)
def test_scancel_and_slurms_own_requeue_are_left_alone(fake: Path, job: str, said: str) -> None:
    proc = start_script(fake, FAKE_JOB=job, FAKE_TERM_RC="143")
    proc.send_signal(signal.SIGTERM)
    wait_for("the verdict", lambda: "kind=" in " ".join(marks(fake)), proc)
    os.kill(int((fake / "srun.pid").read_text()), signal.SIGTERM)  # SLURM's own SIGTERM
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert said in out and calls(fake) == [], out
    assert not [m for m in marks(fake) if m.startswith("failed")]  # not a crash


def test_a_step_killed_after_a_stop_request_is_not_requeued(fake: Path) -> None:
    proc = start_script(fake, FAKE_JOB=RUNNING, FAKE_TERM_RC="143")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out
    assert "the step ended with exit 143 (killed by SIGTERM) after a stop request" in out
    assert calls(fake) == ["scancel --signal=TERM 4242"]


def test_usr2_is_forwarded_and_the_step_goes_on(fake: Path) -> None:
    proc = start_script(fake)
    proc.send_signal(signal.SIGUSR2)
    wait_for("the USR2", lambda: (fake / "srun.signals").exists(), proc)
    time.sleep(0.3)
    assert proc.poll() is None  # information: the step goes on
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert "received SIGUSR2: forwarding to the training step" in out
    assert (fake / "srun.signals").read_text() == "USR2\n"
    assert "signal name=USR2" in marks(fake)


def test_a_warning_that_agrees_with_slurms_end_time_is_not_forwarded(fake: Path) -> None:
    """USR2@300 in a job with 200 s left: the trainer knows the end already, and a signal
    during its imports would kill it."""
    proc = start_script(fake, PYRECOVER_END_TIME=f"{time.time() + 200:.0f}")
    proc.send_signal(signal.SIGUSR2)
    wait_for("the verdict", lambda: "signal name=USR2 forwarded=0" in marks(fake), proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert "received SIGUSR2: agrees with the end time SLURM gives (" in out
    assert "s left, lead 300 s): not forwarded" in out
    assert not (fake / "srun.signals").exists()  # the step never saw it
