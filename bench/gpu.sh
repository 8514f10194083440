#!/usr/bin/env bash
# Everything issue 28 measures on one GPU, in two calls of at most 10 minutes each (15 device-
# minutes in all, a machine's start included). Each call guards its own time: a run that would not
# end before the call's budget is skipped and says so; every run writes its results under DIR as
# it ends, and each call ends with the one table of all results in DIR so far (DIR/table.md).
#
#   call a  (~7 min on an H100)
#     det      1b (seq 2048, batch 8, bf16 autocast, compile, fused AdamW): --deterministic, then
#              the default at the same shapes; the last step of each profiled: the kernels each
#              mode runs (torch.profiler, top kernels by CUDA time) and the attention kernel
#     startup  the default run's final checkpoint resumed by a new process, the page cache
#              dropped (a requeue on another node): start-up in parts (imports, process group,
#              CUDA init, data, model, load, compile with the cache in the experiment, first step)
#     fsdp     1b with --parallelism fsdp (world size 1): tokens/s vs the default run's (DDP path)
#     ckpt     async save of the 1b state (18 GB) from GPU memory as pyrecover-train makes it
#              (overlapped with the next forward and backward): the caller's blocking vs torch.save
#   call b  (~6 min)
#     8b       --model-size 8b --param-dtype bf16 --activation-checkpointing, batch 1: a
#              --deterministic run with a save at step 3, SIGKILLed after step 5, resumed from
#              step 3 to 5: steps 4-5 bitwise (losses, grad norms); then the default with compile
#              resumed from that checkpoint: MFU, and a resumed 8b run's start-up
#     resume   125m: a --deterministic --compile run SIGKILLed twice and resumed vs its straight
#              twin, bitwise (model, optimizer, data, RNGs) with the fast attention kernels
#
#   bench/gpu.sh --call a [DIR]       one call (DIR: default bench/results/gpu-<device>/)
#   bench/gpu.sh --call b [DIR]
#   bench/gpu.sh --only det,fsdp DIR  some stages (same order; a later run adds to DIR)
#   bench/gpu.sh --cpu-smoke DIR      every stage with tiny sizes on CPU (checks the script)
#   bench/gpu.sh --plan               the calls, their stages and time estimates; runs nothing
#
# It makes a virtualenv (python3 -m venv --system-site-packages, so a preinstalled CUDA torch is
# reused; else `pip install torch`, or $TORCH_SPEC), installs ./packages/* and ./apps/train into it
# (only the dependencies it lacks are fetched; PIP_FIND_LINKS=wheels/ PIP_NO_INDEX=1 works
# offline), and runs. Knobs (environment): GPU_BENCH_BUDGET_S (seconds one call may take, 570),
# GPU_BENCH_VENV (/tmp/pyrecover-gpu-venv), GPU_BENCH_WORK (scratch on the disk to measure; default
# a temp dir, removed at the end), GPU_BENCH_STEPS (25), GPU_BENCH_BATCH (8), GPU_BENCH_RESUME
# (the resume checks: "det-compiled"; also det-eager det-fsdp det-bf16 default-eager), TORCH_SPEC.
set -euo pipefail

STAGES="det startup fsdp ckpt 8b resume"
CALL_A="det startup fsdp ckpt"
CALL_B="8b resume"
usage() {
  echo "usage: bench/gpu.sh [--call a|b | --only STAGE,...] [--cpu-smoke] [--plan] [DIR]" \
       "(stages: ${STAGES// /, })" >&2
  exit 2
}
plan() {
  cat <<'EOF'
bench/gpu.sh, two calls (each under the 10-minute limit of one command; ~13 minutes of the 15
with the machine's start): run call b at once after call a, while the machine is still warm.
  call a  det (1b, --deterministic and default, profiled)  ~190 s
          startup (resume of the default run, cold cache)  ~40 s
          fsdp (1b FSDP vs the default run)                 ~90 s
          ckpt (async save blocking from GPU memory)        ~80 s    + setup ~25 s = ~7 min
  call b  8b (det save/kill/resume bitwise, default MFU)    ~250 s
          resume (125m det compiled, bitwise)               ~70 s    + setup ~25 s = ~6 min
EOF
  exit 0
}
SMOKE=0
DIR=""
ONLY="$STAGES"
while (( $# )); do
  case "$1" in
    --cpu-smoke) SMOKE=1 ;;
    --plan) plan ;;
    --call) (( $# > 1 )) || usage
            case "$2" in a) ONLY="$CALL_A" ;; b) ONLY="$CALL_B" ;; *) usage ;; esac; shift ;;
    --only) (( $# > 1 )) || usage; ONLY="${2//,/ }"; shift ;;
    --only=*) ONLY="${1#--only=}"; ONLY="${ONLY//,/ }" ;;
    -h|--help) sed -n '2,38p' "$0"; exit 0 ;;
    -*) echo "bench/gpu.sh: unknown option $1" >&2; usage ;;
    *) [[ -z "$DIR" ]] || { echo "bench/gpu.sh: one DIR only (got $DIR and $1)" >&2; usage; }
       DIR="$1" ;;
  esac
  shift
done
for stage in $ONLY; do
  [[ " $STAGES " == *" $stage "* ]] || { echo "bench/gpu.sh: unknown stage '$stage'" >&2; usage; }
done
want() { [[ " $ONLY " == *" $1 "* ]]; }
command -v python3 >/dev/null || { echo "bench/gpu.sh: python3 not found: install Python >= 3.10" >&2; exit 1; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "$DIR" ]]; then
  [[ "$SMOKE" == 0 ]] || { echo "bench/gpu.sh: --cpu-smoke needs a DIR (not the committed results)" >&2; usage; }
  gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | tr '[:upper:]' '[:lower:]')" || true
  slug="$(grep -oE '\b[a-z]+[0-9]{2,4}[a-z]*\b' <<< "${gpu#nvidia }" | head -n 1)" || true
  [[ -n "$slug" ]] || { echo "bench/gpu.sh: no GPU name from nvidia-smi: give DIR" >&2; usage; }
  DIR="$REPO/bench/results/gpu-$slug"
fi
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
VENV="${GPU_BENCH_VENV:-/tmp/pyrecover-gpu-venv}"
if [[ -n "${GPU_BENCH_WORK:-}" ]]; then
  WORK="$GPU_BENCH_WORK"; mkdir -p "$WORK"; OWN_WORK=0
else
  WORK="$(mktemp -d /tmp/pyrecover-gpu-XXXXXX)"; OWN_WORK=1
fi
BIGCKPT=""  # the 8b checkpoint's folder (on /dev/shm when the disk is too small)
SMI_PID=""
cleanup() {
  [[ -n "$SMI_PID" ]] && kill "$SMI_PID" 2>/dev/null || true
  [[ -n "$BIGCKPT" ]] && rm -rf "$BIGCKPT"
  if [[ "$OWN_WORK" == 1 ]]; then rm -rf "$WORK"; else rm -rf "$WORK/ckpt" "$WORK"/gpu-*; fi
}
trap cleanup EXIT
T0=$SECONDS
BUDGET="${GPU_BENCH_BUDGET_S:-570}"
CALL_ID="$(date -u +%Y%m%dT%H%M%S)-$$"  # ratios are only taken between runs of one call
say() { printf '[gpu.sh %4ds] %s\n' "$((SECONDS - T0))" "$*" | tee -a "$DIR/gpu.log"; }
left() { echo $(( BUDGET - (SECONDS - T0) )); }
fits_in() {  # SECONDS NAME: is there time for a run that takes about SECONDS? (else a skip note)
  local need=$1 name=$2
  if (( $(left) < need )); then
    say "$name: skipped, $(left) s left of this call's $BUDGET s (it needs ~$need s)"
    "$PY" "$REPO/bench/gpu.py" note "$DIR/$name.json" --skipped "out of this call's time" \
      --label "$name" >/dev/null
    return 1
  fi
}
limit() { local l=$(( $(left) - 10 )); (( l < $1 )) && echo "$l" || echo "$1"; }  # CAP: timeout

if [[ "$SMOKE" == 1 ]]; then
  SIZE=tiny SEQ=64 BATCH=2 STEPS=12 SKIP=4 DEVICE=cpu
  TRAIN_FLAGS=(--device cpu --model-dtype bf16 --fused-optimizer)  # eager: CPU compile is slow
  COMPILED=()
  BIG=tiny BIG_SEQ=64 BIG_BYTES=0  # the 8b stage's flags on the tiny model
  RESUME_SIZE=tiny RESUME_FLAGS=(--device cpu --sequence-length 64 --batch-size 2)
  RESUME_STEPS=24 RESUME_EVERY=4
  DOCS=200 BUDGET="${GPU_BENCH_BUDGET_S:-1800}"
else
  SIZE=1b SEQ=2048 BATCH="${GPU_BENCH_BATCH:-8}" STEPS="${GPU_BENCH_STEPS:-25}" SKIP=10 DEVICE=cuda
  TRAIN_FLAGS=(--device cuda --model-dtype bf16 --compile --fused-optimizer)
  COMPILED=(--compile --fused-optimizer)
  BIG=8b BIG_SEQ=2048 BIG_BYTES=8  # bf16 weights + grads + AdamW moments: 8 bytes a parameter
  RESUME_SIZE=125m RESUME_FLAGS=(--device cuda --sequence-length 2048 --batch-size 4)
  RESUME_STEPS=30 RESUME_EVERY=5
  DOCS=4000
fi

# -- 1. the environment ----------------------------------------------------------------------
say "call $CALL_ID: stages '$ONLY', ${BUDGET} s; results in $DIR, scratch in $WORK, venv $VENV (smoke=$SMOKE)"
{ date -u; uname -a; python3 --version; nvidia-smi 2>/dev/null || echo "no nvidia-smi"; df -h "$WORK" /dev/shm; } \
  > "$DIR/env.txt" 2>&1
if [[ ! -x "$VENV/bin/python" ]]; then
  if python3 -m venv --system-site-packages "$VENV" >> "$DIR/gpu.log" 2>&1; then
    # When python3 is itself a virtualenv (conda, /opt/.../.venv) that holds the CUDA torch,
    # --system-site-packages reaches only the base interpreter: make its packages visible too.
    python3 -c 'import site, sys; sys.prefix != sys.base_prefix and print("\n".join(site.getsitepackages()))' \
      > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_outer_python.pth"
  else
    say "python3 -m venv failed (Debian: apt install python3-venv): using python3 itself"
    rm -rf "$VENV"; mkdir -p "$VENV/bin"; ln -s "$(command -v python3)" "$VENV/bin/python"
  fi
fi
PY="$VENV/bin/python"
# pip honours PIP_INDEX_URL / PIP_FIND_LINKS / PIP_NO_INDEX: wheels in a folder work offline.
PIP=("$PY" -m pip install -q --disable-pip-version-check)
if ! "$PY" -c "import torch" 2>/dev/null; then
  say "no torch in the venv or the system: pip install ${TORCH_SPEC:-torch}"
  "${PIP[@]}" "${TORCH_SPEC:-torch}"
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" \
  | tee -a "$DIR/env.txt"
if [[ "$SMOKE" == 0 ]] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "bench/gpu.sh: torch in $VENV sees no CUDA GPU: install a CUDA build (TORCH_SPEC='torch==X' with" \
       "PIP_INDEX_URL of your CUDA), or run with --cpu-smoke to check the script on CPU" >&2
  exit 1
fi

# -- 2. install the packages -----------------------------------------------------------------
missing=()
for mod in numpy pyarrow fsspec orjson; do
  "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if (( ${#missing[@]} )); then
  say "pip install ${missing[*]}"
  "${PIP[@]}" "${missing[@]}" || say "could not install ${missing[*]}"
fi
# The sources in place: nothing to build (an offline machine has no hatchling to build with).
PYTHONPATH="$(printf '%s/src:' "$REPO"/packages/* "$REPO/apps/train")${PYTHONPATH:-}"
export PYTHONPATH
"$PY" -c "import slurmclock, ddpkit, ckptstore, parquetlm, pyrecover_train" || {
  echo "bench/gpu.sh: the packages do not import in $VENV (see above)" >&2; exit 1; }
say "installed (the sources in place)"

# -- 3. the runs ------------------------------------------------------------------------------
[[ -f "$WORK/corpus.parquet" ]] || "$PY" "$REPO/bench/gpu.py" corpus "$WORK/corpus.parquet" --docs "$DOCS" >> "$DIR/gpu.log"
DATA=(--dataset "$WORK/corpus.parquet" --tokenizer byte --cache-dir "$WORK/cache")
KEEP=0  # run_train: keep the run's experiment folder (its checkpoint) for the next stage

smi_start() {
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -l 1 \
      > "$DIR/$1.smi.csv" 2>/dev/null &
    SMI_PID=$!
  fi
}
smi_stop() {
  [[ -n "$SMI_PID" ]] && { kill "$SMI_PID" 2>/dev/null || true; wait "$SMI_PID" 2>/dev/null || true; SMI_PID=""; }
}

run_train() {  # NAME SIZE SEQ BATCH SECONDS UNTIL [FLAGS...]: one bounded run, then its figures
  # UNTIL: "kill:N" (SIGKILLed once step N is logged: no final save) or "end" (to its last step)
  local name=$1 size=$2 seq=$3 batch=$4 cap=$5 until=$6 rc=0 stop=()
  shift 6
  [[ "$until" == end ]] && stop=(--to-end) || stop=(--steps "${until#kill:}")
  rm -rf "$DIR/$name.metrics.jsonl" "$DIR/$name.log"
  [[ "$KEEP" == 1 ]] || rm -rf "$WORK/ckpt"
  smi_start "$name"
  say "$name: pyrecover-train --model-size $size, seq $seq, batch $batch $*"
  "$PY" "$REPO/bench/gpu.py" train "$DIR/$name.metrics.jsonl" "${stop[@]}" \
    --log "$DIR/$name.log" --timeout "$(limit "$cap")" -- "${DATA[@]}" --model-size "$size" \
    --sequence-length "$seq" --batch-size "$batch" --log-every 1 --eval-every 0 \
    --checkpoint-dir "$WORK/ckpt" --experiment-name "$name" \
    --metrics "$DIR/$name.metrics.jsonl" "$@" || rc=$?
  smi_stop
  if [[ $rc != 0 ]]; then
    local why="over its time"
    [[ $rc == 124 ]] || why="$(tail -n 1 "$DIR/$name.log")"
    say "$name: exit $rc ($why)"
    "$PY" "$REPO/bench/gpu.py" note "$DIR/$name.json" --failed "exit $rc" --label "$name" \
      --log "$DIR/$name.log" >/dev/null
    return $rc
  fi
}
figures() {  # NAME SKIP [PROFILED_STEP] [EXP]: MFU, tokens/s, start-up, kernels of a finished run
  local name=$1 skip=$2 profiled=${3:-0} exp=${4:-$1}
  local trace="$WORK/ckpt/$exp/profile-steps$profiled-$profiled-rank0.json" kernels=()
  [[ -f "$trace" ]] && kernels=(--trace "$trace")
  "$PY" "$REPO/bench/gpu.py" mfu "$DIR/$name.metrics.jsonl" "$DIR/$name.json" --skip "$skip" \
    --exclude "$profiled" --label "$name" --smi "$DIR/$name.smi.csv" --log "$DIR/$name.log" \
    --extra "{\"call\": \"$CALL_ID\"}" "${kernels[@]}" | tee -a "$DIR/gpu.log"
  rm -f "$trace"
}
drop_cache() { "$PY" "$REPO/bench/gpu.py" drop-cache "$1"; }

FAILED=0
PROFILE=(--profile --profile-step-start "$STEPS" --profile-step-end "$STEPS")

# det: --deterministic and the default, same shapes, each profiled at its last step ------------
if want det; then
  if fits_in 100 "det-on-$SIZE" && run_train "det-on-$SIZE" "$SIZE" "$SEQ" "$BATCH" 240 \
      "kill:$STEPS" "${TRAIN_FLAGS[@]}" --training-steps 1000 --checkpoint-frequency 0 \
      --deterministic "${PROFILE[@]}"; then
    figures "det-on-$SIZE" "$SKIP" "$STEPS"
  else FAILED=1; fi
  # The default run ends with a final save: the checkpoint the startup stage resumes.
  KEEP=1
  if fits_in 110 "det-off-$SIZE" && run_train "det-off-$SIZE" "$SIZE" "$SEQ" "$BATCH" 240 end \
      "${TRAIN_FLAGS[@]}" --training-steps "$STEPS" --checkpoint-frequency 0 "${PROFILE[@]}"; then
    figures "det-off-$SIZE" "$SKIP" "$STEPS"
  else FAILED=1; fi
  KEEP=0
fi

# startup: the default run's checkpoint resumed by a new process, as a requeue meets it ---------
if want startup; then
  if [[ ! -d "$WORK/ckpt/det-off-$SIZE" ]]; then  # no det stage in this call: make a checkpoint
    KEEP=1
    fits_in 90 "startup-base-$SIZE" && run_train "det-off-$SIZE" "$SIZE" "$SEQ" "$BATCH" 200 end \
      "${TRAIN_FLAGS[@]}" --training-steps 2 --checkpoint-frequency 0 || FAILED=1
    KEEP=0
  fi
  if [[ -d "$WORK/ckpt/det-off-$SIZE" ]] && fits_in 45 "startup-$SIZE"; then
    drop_cache "$WORK/ckpt/det-off-$SIZE"  # the checkpoint read from the disk, not the page cache
    KEEP=1
    last=$("$PY" "$REPO/bench/gpu.py" last-step "$WORK/ckpt/det-off-$SIZE")
    if run_train "startup-$SIZE" "$SIZE" "$SEQ" "$BATCH" 150 "kill:$((last + 2))" \
        "${TRAIN_FLAGS[@]}" --training-steps 1000 --checkpoint-frequency 0 \
        --experiment-name "det-off-$SIZE" --resume-from-checkpoint latest; then
      "$PY" "$REPO/bench/gpu.py" startup "$DIR/startup-$SIZE.metrics.jsonl" "$DIR/startup-$SIZE.json" \
        --label "startup-$SIZE: a resumed $SIZE run, page cache dropped" --log "$DIR/startup-$SIZE.log" \
        --extra "{\"call\": \"$CALL_ID\"}" | tee -a "$DIR/gpu.log"
    else FAILED=1; fi
    KEEP=0
  fi
  rm -rf "$WORK/ckpt"
fi

# fsdp: FSDP2 at world size 1 vs the default run (the DDP path) of this call -------------------
if want fsdp; then
  if fits_in 100 "fsdp-$SIZE" && run_train "fsdp-$SIZE" "$SIZE" "$SEQ" "$BATCH" 240 "kill:$STEPS" \
      "${TRAIN_FLAGS[@]}" --training-steps 1000 --checkpoint-frequency 0 --parallelism fsdp; then
    figures "fsdp-$SIZE" "$SKIP"
  else FAILED=1; fi
fi

# ckpt: an async save from GPU memory as the trainer makes it ---------------------------------
if want ckpt && fits_in 90 "ckpt-$SIZE"; then
  say "ckpt-$SIZE: async save blocking vs torch.save, the $SIZE state"
  shape=(--batch "$BATCH" --seq "$SEQ")
  "$PY" "$REPO/bench/gpu.py" ckpt "$DIR/ckpt-$SIZE.json" --model-size "$SIZE" "${shape[@]}" \
    --dir "$WORK" --device "$DEVICE" --call "$CALL_ID" 2>&1 | tee "$DIR/ckpt-$SIZE.log" \
    | tee -a "$DIR/gpu.log" || FAILED=1
fi

# 8b: bf16 weights + activation checkpointing; a deterministic save / kill / resume; MFU ---------
if want 8b; then
  big_flags=(--param-dtype bf16 --activation-checkpointing --no-async-checkpoint --model-dtype bf16
             --device "$DEVICE" --fused-optimizer --keep-last 1)
  need=$("$PY" "$REPO/bench/gpu.py" fits --model-size "$BIG" --bytes-per-param "$BIG_BYTES" \
         --checkpoint-bytes-per-param 6 "$DIR/fits-$BIG.json" --where "$WORK" /dev/shm | tee -a "$DIR/gpu.log" | tail -n 1)
  if [[ "$need" == skip* ]]; then
    say "8b: $need"
  else
    BIGCKPT="$need/pyrecover-gpu-8b-$$"; mkdir -p "$BIGCKPT"
    big() {  # NAME CAP UNTIL [FLAGS]: a run of the 8b experiment (its checkpoint in BIGCKPT)
      local name=$1 cap=$2 until=$3; shift 3
      local saved_work=$WORK; WORK="$BIGCKPT"; KEEP=1
      run_train "$name" "$BIG" "$BIG_SEQ" 1 "$cap" "$until" "${big_flags[@]}" \
        --experiment-name "8b" "$@" || { local rc=$?; WORK=$saved_work; KEEP=0; return $rc; }
      WORK=$saved_work; KEEP=0
    }
    # the straight run: a save at step 3, SIGKILLed once step 5 is logged (no second save)
    if fits_in 110 "8b-det-straight" && big "8b-det-straight" 240 kill:5 --deterministic \
        --training-steps 1000 --checkpoint-frequency 3; then
      if fits_in 60 "8b-det-resumed" && big "8b-det-resumed" 150 kill:5 --deterministic \
          --training-steps 1000 --checkpoint-frequency 3 --resume-from-checkpoint latest; then
        "$PY" "$REPO/bench/gpu.py" same-steps "$DIR/8b-det-resume.json" --steps 4 5 \
          --label "8b --deterministic: killed after step 5, resumed from step 3" \
          "$DIR/8b-det-straight.metrics.jsonl" "$DIR/8b-det-resumed.metrics.jsonl" \
          | tee -a "$DIR/gpu.log" || FAILED=1
      else FAILED=1; fi
      # the default, compiled, resumed from the same checkpoint: MFU, and an 8b resume's start-up
      if fits_in 150 "8b-mfu" && big "8b-mfu" 300 kill:15 "${COMPILED[@]}" --training-steps 1000 \
          --checkpoint-frequency 0 --resume-from-checkpoint latest; then
        figures "8b-mfu" 7 0 8b
      else FAILED=1; fi
    else FAILED=1; fi
    rm -rf "$BIGCKPT"; BIGCKPT=""
  fi
fi

# resume: the deterministic resume checks (straight vs SIGKILLed + resumed, bitwise) ----------
resume_check() {  # NAME [FLAGS...]
  local name=$1
  shift
  fits_in 80 "$name" || return 0
  say "$name: $RESUME_SIZE, $RESUME_STEPS steps, a save every $RESUME_EVERY, 2 SIGKILLs: $*"
  "$PY" "$REPO/bench/gpu.py" resume-check "$DIR/$name.json" --work "$WORK/$name" \
    --steps "$RESUME_STEPS" --every "$RESUME_EVERY" --kills 2 --timeout "$(limit 200)" -- "${DATA[@]}" \
    --model-size "$RESUME_SIZE" --model-dtype bf16 "${RESUME_FLAGS[@]}" "$@" \
    2>&1 | tee -a "$DIR/gpu.log"
  return "${PIPESTATUS[0]}"
}
resume_case() {  # CASE
  case "$1" in
    det-eager) resume_check resume-det-eager --deterministic ;;
    det-compiled) resume_check resume-det-compiled --deterministic "${COMPILED[@]}" ;;
    det-fsdp) resume_check resume-det-fsdp --deterministic --parallelism fsdp ;;
    det-bf16) resume_check resume-det-bf16 --deterministic --param-dtype bf16 ;;
    default-eager) resume_check resume-default-eager ;;  # the control: on a GPU expected to differ
    *) say "unknown resume case '$1' (det-eager det-compiled det-fsdp det-bf16 default-eager)"; return 1 ;;
  esac
}
if want resume; then
  for case in ${GPU_BENCH_RESUME:-det-compiled}; do
    resume_case "$case" || FAILED=1
  done
fi

# -- 4. the table ------------------------------------------------------------------------------
"$PY" "$REPO/bench/gpu.py" summary "$DIR" | tee -a "$DIR/gpu.log"
say "call $CALL_ID done in $((SECONDS - T0)) s$( [[ $FAILED == 1 ]] && echo ', with failures (see above)')"
exit "$FAILED"
