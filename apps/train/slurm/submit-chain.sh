#!/bin/bash
# For clusters that forbid requeue: submit N jobs that run one after the other
# (--dependency=afterany), each resuming from the latest checkpoint. Jobs that start after the
# training is finished exit at once ("already at step N").
#
#   apps/train/slurm/submit-chain.sh N [sbatch options --] [submit-training-simple.sh flags ...]
#   apps/train/slurm/submit-chain.sh 5 --time=04:00:00 -- --exp_name=big --distributed
#
# PARTITION / ACCOUNT from the environment are passed to every sbatch.
set -euo pipefail

if [ $# -lt 1 ] || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 N [sbatch options --] [training flags ...]  (N = number of jobs, >= 1)" >&2
    exit 2
fi
n=$1
shift
sbatch_opts=()
if [[ " $* " == *" -- "* ]]; then
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do sbatch_opts+=("$1"); shift; done
    shift
fi
[ -n "${PARTITION:-}" ] && sbatch_opts+=(--partition="$PARTITION")
[ -n "${ACCOUNT:-}" ] && sbatch_opts+=(--account="$ACCOUNT")

script="$(cd "$(dirname "$0")" && pwd)/submit-training-simple.sh"
prev=""
for i in $(seq 1 "$n"); do
    dep=()
    [ -n "$prev" ] && dep=(--dependency=afterany:"$prev")
    # --continue: every job resumes from latest (the first starts fresh when there is none).
    prev=$(PYRECOVER_CHAIN=1 sbatch --parsable --no-requeue --export=ALL,PYRECOVER_CHAIN=1 \
        ${dep[@]+"${dep[@]}"} ${sbatch_opts[@]+"${sbatch_opts[@]}"} "$script" --continue "$@")
    prev=${prev%%;*}
    echo "job $i/$n: $prev${dep:+ (after ${dep[0]#--dependency=afterany:})}"
done
