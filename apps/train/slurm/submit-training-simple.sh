#!/bin/bash
# pyrecover-train under SLURM: time-aware, self-requeueing until --training-steps is reached.
#
#   sbatch apps/train/slurm/submit-training-simple.sh [--distributed] [--exp_name NAME] \
#          [--continue] [--use_torch_distributed_ckpt] [any pyrecover-train flag ...]
#   bash   apps/train/slurm/submit-training-simple.sh ...   # submits itself with the site settings
#
# How it works: the trainer reads the job's end time from SLURM and stops on its own when the
# time left is what its next step, its final save and the end of the job need (all measured; the
# end of each allocation -- process exit, srun teardown, the requeue -- is recorded in the job's
# timeline and read by the next allocation). It saves a checkpoint and exits 75. The step runs
# under `slurmclock supervise`, which starts it again in this allocation or requeues the job
# (SLURM starts it again with SLURM_RESTART_COUNT+1; it resumes from the latest checkpoint) after
# anything but "done" or a user's stop:
#   exit 0                        training finished: the job ends
#   exit 75                       stopped early with steps left: requeued
#   the time limit                requeued at SLURM's SIGTERM, before the step has exited (slurmd
#                                 waits max(KillWait, 5) s before its SIGKILL); the final save in
#                                 flight completes or is discarded, the newest durable one stands
#   preempted                     REQUEUE mode: SLURM requeues it; CANCEL mode: requeued at the
#                                 SIGTERM; with GraceTime the trainer saves and exits 75: requeued
#   a crash (any other exit, a    started again in this allocation from the newest durable
#   signal, OOM, a dead rank)     checkpoint when the time left holds the measured start-up and a
#                                 few steps (no queue), else requeued; the MAX_FAILURES-th failure
#                                 in a row at one checkpoint ends the chain: one "gave up" line
#                                 here and in `slurmclock timeline`
#   a node lost (dead, frozen,    named within seconds of ddpkit's report; the step is ended and
#   cut off)                      started again on the nodes left: a spare (SPARE_NODES), else
#                                 fewer nodes down to MIN_NODES -- without waiting for SLURM to
#                                 mark the node DOWN (--no-kill keeps the allocation); below
#                                 MIN_NODES: requeued without the node
#   exit 74                       the checkpoint store could not be reached: tried again after a
#                                 pause, not counted as a failure
#   exit 2                        a usage error: not retried
#   scancel / slurmclock stop     not requeued (the trainer saves first on `slurmclock stop`)
#
# Signals: SLURM's warning (--signal=B:USR2@300 below) is information: the script exports its
# lead as PYRECOVER_SIGNAL_LEAD, so a warning that agrees with the known end time changes nothing
# and one that arrives without a known end time sets it (receipt + lead). That is why the lead can
# stay at 300 s, even in a 5-minute job. `slurmclock stop JOBID` (SIGTERM to this script) means
# "save and stop now": forwarded to the step, the trainer saves and exits, no requeue.
#
#SBATCH --job-name=pyrecover
#SBATCH --time=01:00:00
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --signal=B:USR2@300
#SBATCH --requeue
#SBATCH --no-kill
#SBATCH --open-mode=append
#SBATCH --output=pyrecover-%j.out
# If you submit with another --signal=B:USR2@N, also export PYRECOVER_SIGNAL_LEAD=N (a job cannot
# read its own --signal setting; this script reads the #SBATCH line above).
# One task per GPU: for 4 GPUs per node set --ntasks-per-node=4 and --gpus-per-node=4 (or pass
# them to sbatch). Partition and account: PARTITION/ACCOUNT below, or sbatch -p/-A.
# --no-kill: a node that fails does not end the allocation; the supervisor goes on without it.
# Nodes: train on N nodes with a hot spare: sbatch --nodes=N+1 with SPARE_NODES=1; keep the world
# size fixed (never fewer nodes): MIN_NODES=N.

# ---- site settings: edit here or export before submitting ---------------------------------------
PARTITION=${PARTITION:-}          # e.g. gpu        (used when this script submits itself)
ACCOUNT=${ACCOUNT:-}              # e.g. a-project  (used when this script submits itself)
MODULES=${MODULES:-}              # e.g. "cuda/12.4 python/3.11" (module load; empty = none)
PYTHON_ENV=${PYTHON_ENV:-}        # a virtualenv/conda prefix to activate; empty = as is
CONTAINER=${CONTAINER:-}          # prefix for the task command, e.g. "apptainer exec --nv img.sif"
TRAIN_CMD=${TRAIN_CMD:-pyrecover-train}
STAGE_DATASET=${STAGE_DATASET:-0} # 1 = copy --dataset to node-local $SLURM_TMPDIR first
MAX_RESTARTS=${MAX_RESTARTS:-50}  # stop requeueing after this many restarts (a safety net)
MAX_FAILURES=${MAX_FAILURES:-3}   # stop after this many failures in a row at the same checkpoint
REQUEUE=${REQUEUE:-auto}          # auto: requeue unless part of a job array / chain; 1: always;
                                  # 0: never (an unfinished run then ends with its exit status);
                                  # successor: instead of a requeue, sbatch the next job after this
                                  # one (--dependency=afterany): no requeue hold (121 s at SLURM's
                                  # default), see docs/guides/slurm.md; successor-early: that job
                                  # is submitted while this one trains (it waits in the queue,
                                  # planned from the chain's waits) and this one hands over to it
                                  # when it starts: two jobs of the chain in the queue for a while
TIME_LIMIT=${TIME_LIMIT:-}        # e.g. 4:00:00: sbatch --time for this job and every successor
                                  # (empty: the #SBATCH line, or the running job's own limit)
TIME_MIN=${TIME_MIN:-}            # whole minutes, e.g. 30: sbatch --time-min (backfill may start
                                  # the job earlier with a limit down to it); needs
                                  # REQUEUE=successor and TIME_LIMIT; raised by the supervisor to
                                  # the measured start-up + a save + 20 steps
MIN_NODES=${MIN_NODES:-1}         # after a node loss, go on with no fewer nodes than this
SPARE_NODES=${SPARE_NODES:-0}     # nodes of the allocation kept idle to replace a lost one
SLURMCLOCK_DIR=${SLURMCLOCK_DIR:-} # job timelines, on a file system all nodes see (default
                                  # ~/.cache/slurmclock)
# -------------------------------------------------------------------------------------------------

set -u

log() { echo "[$(date '+%F %T')] submit-training-simple: $*"; }
usage_error() { log "usage error: $*"; exit 2; }

case $REQUEUE in
    auto|0|1|successor|successor-early) ;;
    *) usage_error "REQUEUE=$REQUEUE: give auto (requeue unless in an array or a chain), 1, 0, successor or successor-early" ;;
esac
if [ -n "$TIME_MIN" ]; then
    [[ $TIME_MIN =~ ^[1-9][0-9]*$ ]] || usage_error "TIME_MIN=$TIME_MIN: give whole minutes >= 1 (e.g. TIME_MIN=30)"
    # SLURM keeps the lowered limit of a requeued job for every later allocation (measured on
    # 22.05): only a new job asks for TIME_LIMIT again.
    [ "${REQUEUE%-early}" = successor ] || usage_error "TIME_MIN=$TIME_MIN needs REQUEUE=successor: a requeued job keeps the lowered limit for every later allocation"
    [ -n "$TIME_LIMIT" ] || usage_error "TIME_MIN=$TIME_MIN needs TIME_LIMIT (the limit each successor asks for, e.g. TIME_LIMIT=1:00:00)"
fi
orig_args=("$@")
[[ $MIN_NODES =~ ^[1-9][0-9]*$ ]] || usage_error "MIN_NODES=$MIN_NODES: give a whole number >= 1"
[[ $SPARE_NODES =~ ^[0-9]+$ ]] || usage_error "SPARE_NODES=$SPARE_NODES: give a whole number >= 0"

if [ -z "${SLURM_JOB_ID:-}" ]; then
    # Not inside a job: submit this very script with the site settings, once SLURM says the
    # partition can give what it asks for (else sbatch accepts a job that pends for ever).
    args=()
    [ -n "$PARTITION" ] && args+=(--partition="$PARTITION")
    [ -n "$ACCOUNT" ] && args+=(--account="$ACCOUNT")
    [ -n "$TIME_LIMIT" ] && args+=(--time="$TIME_LIMIT")
    [ -n "$TIME_MIN" ] && args+=(--time-min="$TIME_MIN")
    if ! said=$(sbatch --test-only ${args[@]+"${args[@]}"} "$0" "$@" 2>&1); then
        log "not submitted: SLURM cannot give this job what it asks for (sbatch --test-only: $(echo "$said" | tail -1)); ask for fewer nodes (--nodes, or a range --nodes=MIN-MAX) or another partition"
        exit 1
    fi
    exec sbatch ${args[@]+"${args[@]}"} "$0" "$@"
fi

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

# The job's timeline (slurmclock's per-job file): what the end of each allocation took, the
# checkpoints and the failures, read by the next allocation.
[ -n "$SLURMCLOCK_DIR" ] && export SLURMCLOCK_DIR

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

if [ -z "$CONTAINER" ] && ! command -v "$TRAIN_CMD" >/dev/null 2>&1; then
    log "TRAIN_CMD=$TRAIN_CMD: not found here (set TRAIN_CMD to the trainer's command, or PYTHON_ENV / MODULES to what provides it)"
    exit 127
fi

# The step's nodes and tasks: `slurmclock supervise` puts --nodes, --nodelist and --ntasks first
# (the tasks per node are the job's: one per GPU; ddpkit finds the master address and port).
# Without --distributed the trainer is one task on one node.
if [ "$distributed" = 1 ]; then
    one=()
    place=(--min-nodes "$MIN_NODES")
else
    one=(--ntasks=1)
    place=(--step-nodes 1 --tasks-per-node 1)
fi
# shellcheck disable=SC2206  # CONTAINER is a command prefix: split on purpose
step=(srun ${one[@]+"${one[@]}"} --kill-on-bad-exit=1 $CONTAINER "$TRAIN_CMD"
      ${flags[@]+"${flags[@]}"} ${passthrough[@]+"${passthrough[@]}"})

# `slurmclock supervise` runs the step, forwards SLURM's signals (USR2 through srun when it is
# news; SIGTERM to the tasks through SLURM, as srun kills the step on its own SIGTERM) and decides
# what comes next (see the table above); its lines go to this log with this script's name.
requeue=1
if [ "$REQUEUE" = 0 ]; then
    requeue=0
elif [ "$REQUEUE" = auto ] && [ -n "${SLURM_ARRAY_TASK_ID:-}${PYRECOVER_CHAIN:-}" ]; then
    requeue=successor  # the next array task / chained job resumes
fi
supervise=(--name submit-training-simple --max-restarts "$MAX_RESTARTS"
           --max-failures "$MAX_FAILURES" --spare-nodes "$SPARE_NODES" "${place[@]}"
           --resume-hint "submit again with --continue (or scontrol requeue {job} while SLURM lists the job)")
[ "$requeue" = 0 ] && supervise+=(--no-requeue)
if [ "${REQUEUE%-early}" = successor ]; then
    # The next job: this script (SLURM's copy: its #SBATCH lines) with the same arguments and
    # resources, resuming; the supervisor submits it at the stop instead of a requeue.
    next=(--job-name="${SLURM_JOB_NAME:-pyrecover}" --nodes="${SLURM_JOB_NUM_NODES:-1}")
    [ -n "${SLURM_JOB_PARTITION:-}" ] && next+=(--partition="$SLURM_JOB_PARTITION")
    [ -n "${SLURM_JOB_ACCOUNT:-}" ] && next+=(--account="$SLURM_JOB_ACCOUNT")
    limit=$TIME_LIMIT
    [ -n "$limit" ] || limit=$(squeue -h -j "$SLURM_JOB_ID" -o %l 2>/dev/null)
    [ -n "$limit" ] && next+=(--time="$limit")
    supervise+=(--successor "$(printf '%q ' "${next[@]}" "$0" --continue ${orig_args[@]+"${orig_args[@]}"})")
    [ -n "$TIME_MIN" ] && supervise+=(--time-min "$TIME_MIN")
    [ "$REQUEUE" = successor-early ] && supervise+=(--successor-early)
fi
[ "$requeue" = successor ] && supervise+=(--next-job-resumes)
# The run is one chain of jobs (requeues, successors, resubmits with --continue) for
# `slurmclock status/timeline`: recorded under the experiment's name; --continue goes on with it.
supervise+=(--run "$exp_name")
[ "$continue_run" = 1 ] && supervise+=(--continue-run)
# A step started again in this allocation resumes from the newest checkpoint.
[ "$continue_run" = 1 ] || [ "$restarts" -gt 0 ] || supervise+=(--relaunch-args "--resume-from-checkpoint latest")
if command -v slurmclock >/dev/null 2>&1; then
    trap '' TERM USR2  # ignored (not lost to bash's default) until the supervisor handles them
    [ "$REQUEUE" = successor-early ] && trap '' USR1  # the early successor's "hand over"
    exec slurmclock supervise "${supervise[@]}" -- "${step[@]}"
fi

# Without slurmclock where this script runs (the trainer inside CONTAINER has it): a requeue after
# exit 75 only -- no requeue at the time limit, after preemption or a crash.
log "slurmclock not found on PATH here: requeueing only after exit 75; install slurmclock (stdlib only: pip install ./packages/slurmclock) where this script runs, or set PYTHON_ENV"
trap 'log "received SIGTERM: forwarding to the training step"; scancel --signal=TERM "$SLURM_JOB_ID"' TERM
"${step[@]}" &
pid=$!
while true; do
    wait "$pid"
    rc=$?
    kill -0 "$pid" 2>/dev/null || break
done
log "training step exited with status $rc"
trap 'exit 0' TERM  # our own requeue's SIGTERM
if [ "$rc" = 75 ] && [ "$requeue" = 1 ] && [ "$restarts" -lt "$MAX_RESTARTS" ]; then
    log "stopped early with steps left: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID" && exit 0
    log "requeue failed: resubmit with --continue to resume"
fi
exit "$rc"
