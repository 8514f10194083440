#!/bin/bash
# pyrecover-train under SLURM: time-aware, self-requeueing until --training-steps is reached.
#
#   sbatch apps/train/slurm/submit-training-simple.sh [--distributed] [--exp_name=NAME] \
#          [--continue] [--use_torch_distributed_ckpt] [any pyrecover-train flag ...]
#   bash   apps/train/slurm/submit-training-simple.sh ...   # submits itself with the site settings
#
# How it works: SLURM sends SIGUSR2 to this batch shell STOP_WARNING seconds before the time limit
# (--signal=B:USR2@N below); the shell forwards it to the training step; the trainer saves a
# checkpoint and exits 75. The trainer also stops on its own when the time left gets short (it
# reads the job's end time from SLURM). On exit 75 this script requeues the job (--requeue), the
# job starts again with SLURM_RESTART_COUNT+1 and resumes from the latest checkpoint. Exit 0 =
# training finished; anything else is an error and is not retried.
#
#SBATCH --job-name=pyrecover
#SBATCH --time=01:00:00
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --signal=B:USR2@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=pyrecover-%j.out
# Keep the warning's lead (300 s above) well under --time: with `sbatch --time=5` it would come
# at once and every allocation would stop right after starting (override: --signal=B:USR2@30).
# One task per GPU: for 4 GPUs per node set --ntasks-per-node=4 and --gpus-per-node=4 (or pass
# them to sbatch). Partition and account: PARTITION/ACCOUNT below, or sbatch -p/-A.

# ---- site settings: edit here or export before submitting ---------------------------------------
PARTITION=${PARTITION:-}          # e.g. gpu        (used when this script submits itself)
ACCOUNT=${ACCOUNT:-}              # e.g. a-project  (used when this script submits itself)
MODULES=${MODULES:-}              # e.g. "cuda/12.4 python/3.11" (module load; empty = none)
PYTHON_ENV=${PYTHON_ENV:-}        # a virtualenv/conda prefix to activate; empty = as is
CONTAINER=${CONTAINER:-}          # prefix for the task command, e.g. "apptainer exec --nv img.sif"
TRAIN_CMD=${TRAIN_CMD:-pyrecover-train}
STAGE_DATASET=${STAGE_DATASET:-0} # 1 = copy --dataset to node-local $SLURM_TMPDIR first
MAX_RESTARTS=${MAX_RESTARTS:-50}  # stop requeueing after this many restarts (a safety net)
REQUEUE=${REQUEUE:-auto}          # auto: requeue unless part of a job array / chain; 0: never
# -------------------------------------------------------------------------------------------------

set -u

if [ -z "${SLURM_JOB_ID:-}" ]; then
    # Not inside a job: submit this very script with the site settings.
    args=()
    [ -n "$PARTITION" ] && args+=(--partition="$PARTITION")
    [ -n "$ACCOUNT" ] && args+=(--account="$ACCOUNT")
    exec sbatch ${args[@]+"${args[@]}"} "$0" "$@"
fi

distributed=0
exp_name=default-exp
continue_run=0
dcp=0
passthrough=()
dataset=""
expect_dataset=0
for arg in "$@"; do
    if [ "$expect_dataset" = 1 ]; then dataset=$arg; expect_dataset=0; continue; fi
    case $arg in
        --distributed) distributed=1 ;;
        --exp_name=*|--exp-name=*) exp_name=${arg#*=} ;;
        --continue) continue_run=1 ;;
        --use_torch_distributed_ckpt|--use-torch-distributed-ckpt) dcp=1 ;;
        --dataset=*) dataset=${arg#*=} ;;
        --dataset) expect_dataset=1 ;;
        *) passthrough+=("$arg") ;;
    esac
done

log() { echo "[$(date '+%F %T')] submit-training-simple: $*"; }

if [ -n "$MODULES" ]; then
    # shellcheck disable=SC2086
    module load $MODULES || { log "module load $MODULES failed"; exit 1; }
fi
if [ -n "$PYTHON_ENV" ]; then
    if [ -f "$PYTHON_ENV/bin/activate" ]; then
        # shellcheck disable=SC1091
        . "$PYTHON_ENV/bin/activate"
    else
        conda activate "$PYTHON_ENV" || { log "cannot activate $PYTHON_ENV"; exit 1; }
    fi
fi

restarts=${SLURM_RESTART_COUNT:-0}
log "job ${SLURM_JOB_ID}${SLURM_ARRAY_TASK_ID:+ (array task $SLURM_ARRAY_TASK_ID)}, restart $restarts, ${SLURM_NNODES:-1} node(s), ${SLURM_NTASKS:-1} task(s)"

if [ "$STAGE_DATASET" = 1 ] && [ -n "$dataset" ] && [ -e "$dataset" ]; then
    local_dir=${SLURM_TMPDIR:-/tmp/pyrecover-$SLURM_JOB_ID}/dataset
    log "staging $dataset to node-local $local_dir"
    # One copy per node; the copy is complete before the name is used (rename is atomic).
    srun --ntasks="${SLURM_NNODES:-1}" --ntasks-per-node=1 bash -c \
        "mkdir -p '$local_dir.tmp' && cp -r '$dataset' '$local_dir.tmp/' && rm -rf '$local_dir' && mv '$local_dir.tmp' '$local_dir'" \
        || { log "staging failed"; exit 1; }
    dataset="$local_dir/$(basename "$dataset")"
fi

flags=(--experiment_name "$exp_name")
[ -n "$dataset" ] && flags+=(--dataset "$dataset")
[ "$distributed" = 1 ] && flags+=(--distributed)
[ "$dcp" = 1 ] && flags+=(--use-torch-distributed-ckpt)
# A restarted job always resumes; "latest" starts fresh when no checkpoint exists yet.
if [ "$continue_run" = 1 ] || [ "$restarts" -gt 0 ]; then
    flags+=(--resume-from-checkpoint latest)
fi

if [ "$distributed" = 1 ]; then
    ntasks=${SLURM_NTASKS:-1}   # one task per GPU; ddpkit finds the master address and port
else
    ntasks=1
fi

# The batch shell gets SIGUSR2 (--signal=B:...) and SIGTERM (scancel, preemption): forward both
# to the training step, whose tasks save a checkpoint and exit 75.
step_pid=""
# shellcheck disable=SC2317  # called by the traps below
forward() {
    log "received SIG$1: forwarding to the training step"
    [ -n "$step_pid" ] && kill -s "$1" "$step_pid" 2>/dev/null
}
trap 'forward USR2' USR2
trap 'forward TERM' TERM

# shellcheck disable=SC2086
srun --ntasks="$ntasks" --kill-on-bad-exit=1 $CONTAINER "$TRAIN_CMD" ${flags[@]+"${flags[@]}"} ${passthrough[@]+"${passthrough[@]}"} &
step_pid=$!
# `wait` returns early whenever a trapped signal arrives: wait again until the step has exited.
while true; do
    wait "$step_pid"
    rc=$?
    kill -0 "$step_pid" 2>/dev/null || break
done
wait "$step_pid" 2>/dev/null
last=$?
[ "$last" -ne 127 ] && rc=$last
log "training step exited with status $rc"
# From here a SIGTERM means SLURM is ending this run (our own requeue, or a cancel): just go.
trap 'log "SIGTERM: SLURM ends this run"; exit 0' TERM

requeue_job() {
    if command -v slurmclock >/dev/null 2>&1; then
        slurmclock requeue && return 0
    else
        scontrol requeue "$SLURM_JOB_ID" && return 0
    fi
    # SLURM may kill the command before it exits 0: ask SLURM whether the restart was counted.
    scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -qE "(Restarts|RestartCnt)=$((restarts + 1))( |$)"
}

case $rc in
    0)
        log "training finished"
        exit 0
        ;;
    75)
        if [ "$REQUEUE" = 0 ] || { [ "$REQUEUE" = auto ] && [ -n "${SLURM_ARRAY_TASK_ID:-}${PYRECOVER_CHAIN:-}" ]; }; then
            log "stopped early with steps left; not requeueing (the next array task / chained job resumes)"
            exit 0
        fi
        if [ "$restarts" -ge "$MAX_RESTARTS" ]; then
            log "stopped early but already restarted $restarts times (MAX_RESTARTS): not requeueing"
            exit 75
        fi
        log "stopped early with steps left: requeueing job $SLURM_JOB_ID to resume from the latest checkpoint"
        if requeue_job; then
            exit 0
        fi
        log "requeue failed: resubmit with --continue to resume"
        exit 75
        ;;
    *)
        log "training failed (status $rc): not requeueing"
        exit "$rc"
        ;;
esac
