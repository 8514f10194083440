#!/bin/bash
# shellcheck disable=SC2154  # info, end: set by queue_standin.sh, which sources this
# queue_standin.sh's successor-early policy (sourced), as slurmclock's supervisor/handover.py:
# take_over (a successor that started while its predecessor runs asks it to hand over and waits,
# bounded, until it has ended), plan_early and submit_early_when_due (the successor submitted
# while this job trains, without a dependency), and SIGUSR1 (this job's successor started: the
# step loop ends, the job saves and stops).
holding() { squeue -h -j "$1" -o %T 2>/dev/null | grep -qE 'RUNNING|COMPLETING|CONFIGURING'; }

take_over() {
    [ -n "${PREDECESSOR:-}" ] && holding "$PREDECESSOR" || return 0
    scancel --batch --signal=USR1 "$PREDECESSOR"
    ev handover "predecessor=$PREDECESSOR"
    local until=$(($(date +%s) + 60))  # bounded; then cancelled
    while holding "$PREDECESSOR" && [ "$(date +%s)" -lt "$until" ]; do sleep 0.1; done
    holding "$PREDECESSOR" && scancel "$PREDECESSOR"
    ev handed "predecessor=$PREDECESSOR"
}

plan_early() {
    local start submit own
    start=$(date -d "$(grep -oE 'StartTime=[^ ]+' <<<"$info" | cut -d= -f2)" +%s)
    submit=$(date -d "$(grep -oE 'SubmitTime=[^ ]+' <<<"$info" | cut -d= -f2)" +%s)
    own=$((start - submit))
    waits=$(tr ':' '\n' <<<"${WAITS:-}:$own" | grep -E '^[0-9]+$' | tail -8 | paste -sd:)
    at=$(tr ':' '\n' <<<"$waits" | sort -n | awk -v s="$start" -v e="$end" -v lead="$LEAD" '
        { w[NR] = $1 }
        END {
            if (NR == 0) { printf "%d", s + (e - s) / 2; exit }
            m = (NR % 2) ? w[(NR + 1) / 2] : (w[NR / 2] + w[NR / 2 + 1]) / 2
            at = e - m - lead; printf "%d", (at < s ? s : at)
        }')
    ev plan "at=$at waits=$waits"
    trap 'handed=1' USR1
}

submit_early_when_due() {
    [ -z "$early" ] && [ -n "${at:-}" ] && [ "$(date +%s)" -ge "$at" ] || return 0
    # shellcheck disable=SC2086  # SUBMIT_ARGS: sbatch options, split on purpose
    early=$(sbatch --parsable --export="ALL,PREDECESSOR=$SLURM_JOB_ID,WAITS=$waits" $SUBMIT_ARGS \
        "$STANDIN") || early=""
    at=""  # once: a refusal falls back to the successor at the stop
    ev early "successor=$early"
}
