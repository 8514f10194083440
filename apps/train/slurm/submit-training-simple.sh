#!/bin/bash
# pyrecover-train under SLURM: time-aware, self-requeueing until --training-steps is reached.
#
#   sbatch apps/train/slurm/submit-training-simple.sh [--distributed] [--exp_name NAME] \
#          [--continue] [--use_torch_distributed_ckpt] [any pyrecover-train flag ...]
#   bash   apps/train/slurm/submit-training-simple.sh ...   # submits itself with the site settings
#
# How it works: the trainer reads the job's end time from SLURM and stops on its own when the
# time left is what its next step, its final save and the end of the job need (all measured; the
# end of each allocation -- process exit, srun teardown, this script's requeue -- is recorded in
# the job's timeline by `slurmclock mark`/`slurmclock requeue` and read by the next allocation).
# It saves a checkpoint and exits 75; this script then requeues the job, which starts again with
# SLURM_RESTART_COUNT+1 and resumes from the latest checkpoint. Exit 0 = training finished;
# anything else is an error and is not retried.
#
# Signals: SLURM's warning (--signal=B:USR2@300 below) is information: the script exports its
# lead as PYRECOVER_SIGNAL_LEAD, so a warning that agrees with the known end time changes nothing
# and one that arrives without a known end time sets it (receipt + lead). That is why the lead can
# stay at 300 s, even in a 5-minute job. SIGTERM (scancel, preemption, `slurmclock stop JOBID`)
# means "save and stop now": it is forwarded, the trainer saves and exits, and the job is NOT
# requeued -- unless the TERM is SLURM's own at the time limit, when it is.
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
# If you submit with another --signal=B:USR2@N, also export PYRECOVER_SIGNAL_LEAD=N (a job cannot
# read its own --signal setting; this script reads the #SBATCH line above).
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
SLURMCLOCK_DIR=${SLURMCLOCK_DIR:-} # job timelines, on a file system all nodes see (default
                                  # ~/.cache/slurmclock)
# -------------------------------------------------------------------------------------------------

set -u

if [ -z "${SLURM_JOB_ID:-}" ]; then
    # Not inside a job: submit this very script with the site settings.
    args=()
    [ -n "$PARTITION" ] && args+=(--partition="$PARTITION")
    [ -n "$ACCOUNT" ] && args+=(--account="$ACCOUNT")
    exec sbatch ${args[@]+"${args[@]}"} "$0" "$@"
fi

log() { echo "[$(date '+%F %T')] submit-training-simple: $*"; }
usage_error() { log "usage error: $*"; exit 2; }

distributed=0
exp_name=default-exp
continue_run=0
dcp=0
passthrough=()
dataset=""
while [ $# -gt 0 ]; do
    arg=$1
    shift
    case $arg in
        --distributed) distributed=1 ;;
        --exp_name=*|--exp-name=*|--experiment_name=*|--experiment-name=*) exp_name=${arg#*=} ;;
        --exp_name|--exp-name|--experiment_name|--experiment-name)
            [ $# -gt 0 ] || usage_error "$arg needs a value (--exp_name NAME or --exp_name=NAME)"
            exp_name=$1
            shift
            ;;
        --continue) continue_run=1 ;;
        --use_torch_distributed_ckpt|--use-torch-distributed-ckpt) dcp=1 ;;
        --dataset=*) dataset=${arg#*=} ;;
        --dataset)
            [ $# -gt 0 ] || usage_error "--dataset needs a value (a parquet file or folder)"
            dataset=$1
            shift
            ;;
        *) passthrough+=("$arg") ;;  # the trainer's own flags, the original's included
    esac
done
[ -n "$exp_name" ] || usage_error "--exp_name is empty"
# Until the step runs, SLURM's warning (at once in a job shorter than its lead) must not end the
# shell (bash's default for USR2): the trainer reads the end time from SLURM itself.
trap 'log "received SIGUSR2 before training started: the trainer reads the end time itself"' USR2

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

# The job's timeline (slurmclock's per-job file): what the end of each allocation took is
# measured here and read by the next allocation. Without slurmclock the marks are skipped.
[ -n "$SLURMCLOCK_DIR" ] && export SLURMCLOCK_DIR
have_clock=0
command -v slurmclock >/dev/null 2>&1 && have_clock=1
mark() { [ "$have_clock" = 1 ] && slurmclock mark "$@" >/dev/null 2>&1; return 0; }
mark start

# The warning signal's lead for the trainer: from the environment, else from this script's own
# #SBATCH --signal line (SLURM keeps the submitted script as $0). Unknown: USR2 stops at once.
if [ -z "${PYRECOVER_SIGNAL_LEAD:-}" ]; then
    spec=$(grep -m1 -oE '^#SBATCH[[:space:]]+--signal=[^[:space:]]+' "$0" 2>/dev/null)
    spec=${spec##*=}
    [[ ${spec##*@} =~ ^[0-9]+$ ]] && PYRECOVER_SIGNAL_LEAD=${spec##*@}
fi
if [ -n "${PYRECOVER_SIGNAL_LEAD:-}" ]; then
    export PYRECOVER_SIGNAL_LEAD
    log "warning signal lead: ${PYRECOVER_SIGNAL_LEAD} s (information for the trainer's time budget)"
fi

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

# The batch shell gets SIGUSR2 (--signal=B:...) and SIGTERM (scancel, preemption, `slurmclock
# stop`, the time limit): forward both to the training step. USR2 is information for the
# trainer's budget; after TERM the trainer saves and exits 75 at once. USR2 goes through srun,
# which passes it on; TERM must not (srun answers its own SIGTERM by killing the step within a
# second, SLURM 22.05): it goes to the step's tasks through SLURM (scancel without --batch).
step_pid=""
term=""  # "request" or "limit" once SIGTERM arrived
# shellcheck disable=SC2317  # called by the traps below
forward() {
    if [ "$1" = USR2 ] && warning_agrees; then
        log "received SIGUSR2: agrees with the end time SLURM gives ($left s left, lead ${PYRECOVER_SIGNAL_LEAD} s): not forwarded"
        mark signal name=USR2 forwarded=0
        return 0
    fi
    log "received SIG$1: forwarding to the training step"
    if [ "$1" = TERM ]; then
        scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null \
            || { [ -n "$step_pid" ] && kill -s TERM "$step_pid" 2>/dev/null; }
    elif [ -n "$step_pid" ]; then
        kill -s "$1" "$step_pid" 2>/dev/null
    fi
    mark signal "name=$1"
    if [ "$1" = TERM ] && [ -z "$term" ]; then
        # SLURM's own TERM at the time limit is the only one after which requeueing is right
        # (a cancelled job must stay cancelled); it comes at or after the end time.
        term=request
        if [ "$have_clock" = 1 ]; then
            left=$(slurmclock seconds-left 2>/dev/null)
            [[ $left =~ ^-?[0-9]+$ ]] && [ "$left" -le 2 ] && term=limit
        fi
    fi
    return 0
}
# A warning that agrees with the end time SLURM gives tells the trainer nothing it does not know
# (it reads that end time itself) -- and in a job shorter than the lead it comes at once, maybe
# while the trainer is still importing, when a signal would kill it. Only news is forwarded: a
# warning earlier than the lead says (preemption, a shortened limit, a manual one), or any
# warning when SLURM gives no end time.
# shellcheck disable=SC2317  # called by forward
warning_agrees() {
    [ "$have_clock" = 1 ] && [[ ${PYRECOVER_SIGNAL_LEAD:-} =~ ^[0-9]+$ ]] || return 1
    left=$(slurmclock seconds-left 2>/dev/null)
    [[ $left =~ ^-?[0-9]+$ ]] && [ "$left" -le $((PYRECOVER_SIGNAL_LEAD + 35)) ]
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
mark exited "rc=$rc"
log "training step exited with status $rc"
# From here a SIGTERM means SLURM is ending this run (our own requeue, or a cancel): just go.
trap 'log "SIGTERM: SLURM ends this run"; exit 0' TERM

requeue_job() {
    if [ "$have_clock" = 1 ]; then
        slurmclock requeue && return 0  # also marks `requeued` in the job's timeline
    else
        scontrol requeue "$SLURM_JOB_ID" && return 0
    fi
    # SLURM may kill the command before it exits 0: ask SLURM whether the restart was counted.
    scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -qE "(Restarts|RestartCnt)=$((restarts + 1))( |$)"
}

requeue_or_end() {  # $1: why the run ended with steps left
    if [ "$REQUEUE" = 0 ] || { [ "$REQUEUE" = auto ] && [ -n "${SLURM_ARRAY_TASK_ID:-}${PYRECOVER_CHAIN:-}" ]; }; then
        log "$1; not requeueing (the next array task / chained job resumes)"
        exit 0
    fi
    if [ "$restarts" -ge "$MAX_RESTARTS" ]; then
        log "$1, but already restarted $restarts times (MAX_RESTARTS): not requeueing"
        exit 75
    fi
    log "$1: requeueing job $SLURM_JOB_ID to resume from the latest checkpoint"
    if requeue_job; then
        exit 0
    fi
    log "requeue failed: resubmit with --continue to resume"
    exit 75
}

case $rc in
    0)
        log "training finished"
        exit 0
        ;;
    75)
        if [ "$term" = request ]; then
            log "stopped on request (SIGTERM: scancel, preemption or slurmclock stop): not requeueing; resubmit with --continue to resume"
            exit 0
        fi
        requeue_or_end "stopped early with steps left"
        ;;
    *)
        if [ "$term" = limit ]; then
            # SLURM ended the step at the time limit (an exit slower than the budget allowed, or
            # a run without one): the checkpoints are verified, so the next allocation resumes.
            requeue_or_end "the training step ended at the time limit (status $rc)"
        fi
        log "training failed (status $rc): not requeueing"
        exit "$rc"
        ;;
esac
