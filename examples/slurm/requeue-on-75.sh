#!/bin/bash
# Run any time-aware training command under SLURM; the job comes back after anything but "done"
# or a user's stop.
#
#   sbatch --time=04:00:00 examples/slurm/requeue-on-75.sh python examples/lightning_time_aware.py
#   sbatch --time=04:00:00 examples/slurm/requeue-on-75.sh .venv/bin/python my_train.py
#
# The command stops on its own before the time limit (slurmclock reads the job's end time from
# SLURM), saves a checkpoint and exits 75; `slurmclock supervise` then requeues the job, which
# starts again with SLURM_RESTART_COUNT+1 and resumes. It also requeues at the time limit while
# the command still runs, after preemption and after a crash -- unless MAX_FAILURES crashes in a
# row came at the same checkpoint (the command marks `checkpoint step=N` in the job's timeline
# through slurmclock's TimeBudget.record_save(step=N); without those marks: MAX_FAILURES crashes
# in a row with no clean exit between): then one "gave up" line. Exit 0, exit 2 (a usage error),
# scancel and `slurmclock stop JOBID` end the job. A warning signal is optional: with
# --signal=B:USR2@N the USR2 is forwarded to the command. The same contract as pyrecover-train's
# apps/train/slurm/submit-training-simple.sh.
#
# slurmclock must be found where this script runs: on PATH (activate its environment before
# sbatch, which passes your PATH on), beside the python the command starts with
# (`.venv/bin/python train.py` finds .venv/bin/slurmclock), or as SLURMCLOCK=/path/to/slurmclock.
#
#SBATCH --requeue
#SBATCH --open-mode=append

set -u
MAX_RESTARTS=${MAX_RESTARTS:-50}  # stop requeueing after this many restarts (a safety net)
MAX_FAILURES=${MAX_FAILURES:-3}   # stop after this many failures in a row at the same checkpoint
log() { echo "[$(date '+%F %T')] requeue-on-75: $*"; }
[ $# -gt 0 ] || { log "usage: sbatch $0 COMMAND [ARGS...]"; exit 2; }
log "job ${SLURM_JOB_ID:-?}, restart ${SLURM_RESTART_COUNT:-0}: $*"

clock=${SLURMCLOCK:-}
if [ -z "$clock" ]; then
    first=$(command -v "$1" 2>/dev/null)
    if command -v slurmclock >/dev/null 2>&1; then
        clock=slurmclock
    elif [ -n "$first" ] && [ -x "$(dirname "$first")/slurmclock" ]; then
        clock=$(dirname "$first")/slurmclock  # the environment of the command's python
    fi
fi
if [ -z "$clock" ] || ! command -v "$clock" >/dev/null 2>&1; then
    log "slurmclock not found (${clock:-not on PATH, not beside $1}): activate its environment before sbatch, start the command with that environment's python, or set SLURMCLOCK=/path/to/slurmclock"
    exit 2
fi
trap '' TERM USR2  # ignored (not lost to bash's default) until the supervisor handles them
exec "$clock" supervise --name requeue-on-75 --max-restarts "$MAX_RESTARTS" \
    --max-failures "$MAX_FAILURES" \
    --resume-hint "submit the job again (or scontrol requeue {job} while SLURM lists the job)" \
    -- srun --ntasks="${SLURM_NTASKS:-1}" --kill-on-bad-exit=1 "$@"
