#!/bin/bash
# queue_replay.py's training job: a stand-in that behaves as pyrecover-train does towards SLURM
# (start-up, steps, a final save before the real deadline, then the policy's way to the next
# allocation) and costs no CPU (each part is a sleep of its measured, time-scaled length).
#
# Environment (set by queue_replay.py): STATE (a folder), POLICY (requeue | successor |
# successor-early), STARTUP, STEP, SAVE, MARGIN (seconds), SUBMIT_ARGS (the sbatch options this
# job was submitted with, for a successor), STANDIN (this script's path); successor-early: LEAD
# (seconds), and from the job before: PREDECESSOR, WAITS (as slurmclock's supervisor/handover.py:
# the successor is submitted while this job trains, the chain's median wait + LEAD before the
# end, half of the allocation before any wait is known; when it starts, this job hands over).
set -u
now() { date +%s.%N; }
ev() { echo "$1 $(now) ${SLURM_JOB_ID} ${*:2}" >>"$STATE/events.log"; }

# SLURM's own record of this allocation (StartTime, EndTime, TimeLimit, TimeMin, SubmitTime).
info=$(scontrol -o show job "$SLURM_JOB_ID")
ev alloc "$info"
trap 'ev killed; exit 143' TERM
# The deadline as the trainer reads it: slurmclock (the limit this allocation got), else scontrol.
end=$(slurmclock end-time --epoch 2>/dev/null) || {
    end=$(date -d "$(grep -oE 'EndTime=[^ ]+' <<<"$info" | cut -d= -f2)" +%s)
}
ev deadline "end=$end"
handed=0
early=""
if [ "$POLICY" = successor-early ]; then
    # shellcheck source=bench/queue_early.sh
    . "$(dirname "$STANDIN")/queue_early.sh"
    take_over
    plan_early
fi
sleep "$STARTUP"
steps=$(cat "$STATE/steps" 2>/dev/null || echo 0)
ms() { awk "BEGIN { printf \"%d\", ($1) * 1000 }"; }
need=$(ms "$STEP + $SAVE + $MARGIN")
step_ms=$(ms "$STEP")
endms=$((end * 1000))
done_here=0
while [ $((endms - $(date +%s%3N))) -ge "$need" ] && [ "$handed" = 0 ]; do
    [ "$POLICY" = successor-early ] && submit_early_when_due
    sleep "$STEP"
    done_here=$((done_here + 1))
    [ "$done_here" = 1 ] && ev first_step
done
sleep "$SAVE"
steps=$((steps + done_here))
echo "$steps" >"$STATE/steps.tmp" && mv "$STATE/steps.tmp" "$STATE/steps"
ev saved "steps=$steps here=$done_here step_ms=$step_ms"
if [ "$POLICY" = successor-early ] && [ -n "$early" ]; then
    ev stop "successor=$early early handed=$handed"
    exit 0
fi
if [ "${POLICY%-early}" = successor ]; then
    # shellcheck disable=SC2086  # SUBMIT_ARGS: sbatch options, split on purpose
    next=$(sbatch --parsable --dependency=afterany:"$SLURM_JOB_ID" $SUBMIT_ARGS "$STANDIN")
    ev stop "successor=$next"
    exit 0
fi
ev stop requeue
trap '' TERM
scontrol requeue "$SLURM_JOB_ID"
sleep 60
