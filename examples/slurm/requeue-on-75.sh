#!/bin/bash
# Run any time-aware training command under SLURM; requeue the job while it exits 75.
#
#   sbatch --time=04:00:00 examples/slurm/requeue-on-75.sh python examples/lightning_time_aware.py
#   sbatch --time=04:00:00 --signal=B:USR2@120 examples/slurm/requeue-on-75.sh python my_train.py
#
# The command stops on its own before the time limit (slurmclock reads the job's end time from
# SLURM), saves a checkpoint and exits 75; this script then requeues the job, which starts again
# with SLURM_RESTART_COUNT+1 and resumes. Exit 0 = finished; anything else is an error and is not
# retried. A warning signal is optional: with --signal=B:USR2@N the shell forwards USR2 (and
# SIGTERM from scancel or preemption) to the command, which saves at the next step and exits 75.
# The same contract as pyrecover-train's apps/train/slurm/submit-training-simple.sh.
#
#SBATCH --requeue
#SBATCH --open-mode=append

set -u
MAX_RESTARTS=${MAX_RESTARTS:-50}
restarts=${SLURM_RESTART_COUNT:-0}
log() { echo "[$(date '+%F %T')] requeue-on-75: $*"; }
[ $# -gt 0 ] || { log "usage: sbatch $0 COMMAND [ARGS...]"; exit 2; }
log "job ${SLURM_JOB_ID:-?} restart $restarts: $*"

step_pid=""
# shellcheck disable=SC2317  # called by the traps below
forward() {
    log "received SIG$1: forwarding to the training step"
    [ -n "$step_pid" ] && kill -s "$1" "$step_pid" 2>/dev/null
}
trap 'forward USR2' USR2
trap 'forward TERM' TERM

srun --ntasks="${SLURM_NTASKS:-1}" --kill-on-bad-exit=1 "$@" &
step_pid=$!
# `wait` returns early whenever a trapped signal arrives: wait again until the step has exited.
while true; do
    wait "$step_pid"
    rc=$?
    kill -0 "$step_pid" 2>/dev/null || break
done
log "training step exited with status $rc"
# From here a SIGTERM means SLURM is ending this run (our own requeue, or a cancel): just go.
trap 'log "SIGTERM: SLURM ends this run"; exit 0' TERM

case $rc in
    0) log "training finished"; exit 0 ;;
    75)
        if [ "$restarts" -ge "$MAX_RESTARTS" ]; then
            log "stopped early, but restarted $restarts times already (MAX_RESTARTS): giving up"
            exit 75
        fi
        log "stopped early with a checkpoint: requeueing job ${SLURM_JOB_ID:-?}"
        if command -v slurmclock >/dev/null 2>&1; then
            slurmclock requeue && exit 0
        else
            scontrol requeue "$SLURM_JOB_ID" && exit 0
        fi
        # SLURM may end us before the command answers: did the restart count go up?
        scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -qE "Restarts=$((restarts + 1))( |$)" && exit 0
        log "requeue failed: submit the job again to resume"
        exit 75
        ;;
    *) log "training failed (status $rc): not requeueing"; exit "$rc" ;;
esac
