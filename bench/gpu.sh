#!/usr/bin/env bash
# What one GPU measures, in stages (each well under 10 minutes on an H100; all: ~35 minutes):
#   mfu     pyrecover-train MFU of the 1b preset (sequence 2048, bf16 autocast, torch.compile,
#           fused AdamW) on a generated corpus (nothing is downloaded)
#   det     the throughput cost of --deterministic: the 1b preset with and without, same shapes
#   resume  the deterministic resume check: a 125m run vs the same run SIGKILLed twice at random
#           moments and resumed, compared bitwise (eager; compiled; FSDP at world size 1), and the
#           control (the default, fast mode: expected to differ)
#   fsdp    --parallelism fsdp at world size 1 vs the DDP path, 1b, same shapes
#   ckpt    checkpoint blocking time async vs sync from GPU memory (~1.5B parameters + AdamW
#           state) and cold load time, against torch.save/torch.load
#   8b      the 8b preset on one GPU: bf16 weights, gradients and AdamW moments (--param-dtype
#           bf16) with activation checkpointing, when they fit
# Every training run also reports its start-up: launch -> first finished step (start event).
#
#   bench/gpu.sh [DIR]                 results (JSON, logs) go to DIR, default
#                                      bench/results/gpu-<device>/ (gpu-h100, ...); run from a copy
#                                      of the repo
#   bench/gpu.sh --only det,resume DIR some stages (a later run adds to DIR; the summary reads all)
#   bench/gpu.sh --cpu-smoke DIR       every stage with tiny sizes on CPU (checks the script)
#
# It makes a virtualenv (python3 -m venv --system-site-packages, so a preinstalled CUDA torch is
# reused; else `pip install torch`, or $TORCH_SPEC), installs ./packages/* and ./apps/train into
# it (only the dependencies it lacks are fetched; PIP_FIND_LINKS=wheels/ PIP_NO_INDEX=1 works
# offline), and runs. Knobs (environment): GPU_BENCH_VENV (default /tmp/pyrecover-gpu-venv),
# GPU_BENCH_WORK (scratch on the disk to measure; default a temp dir, removed at the end; needs
# ~40 GB free), GPU_BENCH_STEPS (40), GPU_BENCH_BATCH (8), GPU_BENCH_REPEATS (2), TORCH_SPEC,
# GPU_BENCH_RESUME (the resume checks: "det-eager det-compiled det-fsdp det-bf16 default-eager").
set -euo pipefail

STAGES="mfu det resume fsdp ckpt 8b"
usage() {
  echo "usage: bench/gpu.sh [--cpu-smoke] [--only STAGE,...] [DIR]   (stages: ${STAGES// /, })" >&2
  exit 2
}
SMOKE=0
DIR=""
ONLY="$STAGES"
while (( $# )); do
  case "$1" in
    --cpu-smoke) SMOKE=1 ;;
    --only) (( $# > 1 )) || usage; ONLY="${2//,/ }"; shift ;;
    --only=*) ONLY="${1#--only=}"; ONLY="${ONLY//,/ }" ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
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
SMI_PID=""
cleanup() {
  [[ -n "$SMI_PID" ]] && kill "$SMI_PID" 2>/dev/null || true
  if [[ "$OWN_WORK" == 1 ]]; then rm -rf "$WORK"; else rm -rf "$WORK/ckpt" "$WORK"/gpu-ckpt-*; fi
}
trap cleanup EXIT
T0=$SECONDS
say() { printf '[gpu.sh %4ds] %s\n' "$((SECONDS - T0))" "$*" | tee -a "$DIR/gpu.log"; }

if [[ "$SMOKE" == 1 ]]; then
  SIZE=tiny SEQ=64 BATCH=2 STEPS=12 SKIP=4 LOG_EVERY=2 REPEATS=1 DEVICE=cpu
  TRAIN_FLAGS=(--device cpu --model-dtype bf16 --fused-optimizer)  # eager: CPU compile is slow
  COMPILED=()
  BIG=tiny BIG_SEQ=64 BIG_BYTES=0  # the 8b stage's flags on the tiny model
  RESUME_SIZE=tiny RESUME_FLAGS=(--device cpu --sequence-length 64 --batch-size 2)
  RESUME_STEPS=24 RESUME_EVERY=4
  DOCS=200
else
  SIZE=1b SEQ=2048 BATCH="${GPU_BENCH_BATCH:-8}" STEPS="${GPU_BENCH_STEPS:-40}" SKIP=10 LOG_EVERY=5
  REPEATS="${GPU_BENCH_REPEATS:-2}" DEVICE=cuda
  TRAIN_FLAGS=(--device cuda --model-dtype bf16 --compile --fused-optimizer)
  COMPILED=(--compile --fused-optimizer)
  BIG=8b BIG_SEQ=2048 BIG_BYTES=8  # bf16 weights + grads + AdamW moments: 8 bytes a parameter
  RESUME_SIZE=125m RESUME_FLAGS=(--device cuda --sequence-length 2048 --batch-size 4)
  RESUME_STEPS=30 RESUME_EVERY=5
  DOCS=4000
fi

# -- 1. the environment ----------------------------------------------------------------------
say "results in $DIR, scratch in $WORK, venv in $VENV (smoke=$SMOKE)"
{ date -u; uname -a; python3 --version; nvidia-smi 2>/dev/null || echo "no nvidia-smi"; df -h "$WORK"; } \
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
# Only what is missing is fetched (the venv reuses what the machine has); then ours, without
# dependencies or build isolation, so an offline machine with the dependencies works too.
missing=()
for mod in numpy pyarrow fsspec orjson hatchling; do
  "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if (( ${#missing[@]} )); then
  say "pip install ${missing[*]}"
  "${PIP[@]}" "${missing[@]}" || say "could not install ${missing[*]}"
fi
if "$PY" -c "import hatchling" 2>/dev/null; then
  "${PIP[@]}" --no-deps --no-build-isolation "$REPO"/packages/* "$REPO/apps/train"
else
  say "no hatchling to build with: using the sources in place (PYTHONPATH)"
  PYTHONPATH="$(printf '%s/src:' "$REPO"/packages/* "$REPO/apps/train")${PYTHONPATH:-}"
  export PYTHONPATH
fi
"$PY" -c "import slurmclock, ddpkit, ckptstore, parquetlm, pyrecover_train" || {
  echo "bench/gpu.sh: the packages do not import in $VENV (see above)" >&2; exit 1; }
say "installed"

# -- 3. the runs ------------------------------------------------------------------------------
"$PY" "$REPO/bench/gpu.py" corpus "$WORK/corpus.parquet" --docs "$DOCS" >> "$DIR/gpu.log"
DATA=(--dataset "$WORK/corpus.parquet" --tokenizer byte --cache-dir "$WORK/cache")

run_train() {  # NAME SIZE SEQ BATCH ACCUM SECONDS [FLAGS...]: one bounded run; status 0 = ok
  local name=$1 size=$2 seq=$3 batch=$4 accum=$5 limit=$6 rc=0
  shift 6
  rm -rf "$WORK/ckpt" "$DIR/$name.metrics.jsonl" "$DIR/$name.log"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -l 1 \
      > "$DIR/$name.smi.csv" 2>/dev/null &
    SMI_PID=$!
  fi
  say "$name: pyrecover-train --model-size $size, seq $seq, batch $batch x accum $accum $*"
  # SIGKILLed once step $STEPS is logged: the measurement needs no final save (8b: 48 GB).
  "$PY" "$REPO/bench/gpu.py" train "$DIR/$name.metrics.jsonl" --steps "$STEPS" \
    --log "$DIR/$name.log" --timeout "$limit" -- "${DATA[@]}" --model-size "$size" \
    --sequence-length "$seq" --batch-size "$batch" --grad-accum "$accum" \
    --training-steps "$((STEPS + 1000))" --log-every "$LOG_EVERY" --eval-every 0 \
    --checkpoint-frequency 0 --checkpoint-dir "$WORK/ckpt" --experiment-name "$name" \
    --metrics "$DIR/$name.metrics.jsonl" "${TRAIN_FLAGS[@]}" "$@" || rc=$?
  [[ -n "$SMI_PID" ]] && { kill "$SMI_PID" 2>/dev/null || true; wait "$SMI_PID" 2>/dev/null || true; SMI_PID=""; }
  rm -rf "$WORK/ckpt"
  if [[ $rc != 0 ]]; then
    say "$name: exit $rc ($( [[ $rc == 124 ]] && echo "over ${limit}s" || tail -n 1 "$DIR/$name.log"))"
    return $rc
  fi
  "$PY" "$REPO/bench/gpu.py" mfu "$DIR/$name.metrics.jsonl" "$DIR/$name.json" --skip "$SKIP" \
    --label "$name: $size, seq $seq, batch $batch x $accum $*" --smi "$DIR/$name.smi.csv" \
    --extra "{\"model_size\": \"$size\", \"seq\": $seq, \"batch\": $batch, \"grad_accum\": $accum}" \
    | tee -a "$DIR/gpu.log"
}

FIT_BATCH=0 FIT_ACCUM=0
run_fit() {  # NAME SIZE SECONDS [FLAGS...]: batch $BATCH, halved (accumulation doubled) on OOM
  local name=$1 size=$2 limit=$3 batch=$BATCH accum=1
  shift 3
  while ! run_train "$name" "$size" "$SEQ" "$batch" "$accum" "$limit" "$@"; do
    grep -qi "out of memory" "$DIR/$name.log" && (( batch > 1 )) || return 1
    say "$name: out of memory at batch $batch: again with batch $((batch / 2)) x accum $((accum * 2))"
    batch=$((batch / 2)) accum=$((accum * 2))
  done
  FIT_BATCH=$batch FIT_ACCUM=$accum
}

FAILED=0
if want mfu; then
  run_fit "mfu-$SIZE" "$SIZE" 600 || FAILED=1
fi

# -- 4. what --deterministic costs: the same shapes with and without, one after the other -------
if want det; then
  if run_fit "det-on-$SIZE" "$SIZE" 600 --deterministic; then
    run_train "det-off-$SIZE" "$SIZE" "$SEQ" "$FIT_BATCH" "$FIT_ACCUM" 600 || FAILED=1
  else
    FAILED=1
  fi
fi

# -- 5. the deterministic resume check: straight vs SIGKILLed twice + resumed, bitwise ----------
resume_check() {  # NAME [FLAGS...]
  local name=$1
  shift
  say "$name: $RESUME_SIZE, $RESUME_STEPS steps, a save every $RESUME_EVERY, 2 SIGKILLs: $*"
  "$PY" "$REPO/bench/gpu.py" resume-check "$DIR/$name.json" --work "$WORK/$name" \
    --steps "$RESUME_STEPS" --every "$RESUME_EVERY" --kills 2 -- "${DATA[@]}" \
    --model-size "$RESUME_SIZE" --model-dtype bf16 "${RESUME_FLAGS[@]}" "$@" \
    2>&1 | tee -a "$DIR/gpu.log"
  return "${PIPESTATUS[0]}"
}
resume_case() {  # CASE: one of RESUME_CASES
  case "$1" in
    det-eager) resume_check resume-det-eager --deterministic ;;
    det-compiled) (( ${#COMPILED[@]} == 0 )) || resume_check resume-det-compiled --deterministic "${COMPILED[@]}" ;;
    det-fsdp) resume_check resume-det-fsdp --deterministic --parallelism fsdp ;;
    det-bf16) resume_check resume-det-bf16 --deterministic --param-dtype bf16 ;;  # bf16 weights + moments
    default-eager) resume_check resume-default-eager ;;  # the control: on a GPU expected to differ
    *) say "unknown resume case '$1' (det-eager det-compiled det-fsdp det-bf16 default-eager)"; return 1 ;;
  esac
}
if want resume; then
  for case in ${GPU_BENCH_RESUME:-det-eager det-compiled det-fsdp det-bf16 default-eager}; do
    resume_case "$case" || FAILED=1
  done
fi

# -- 6. FSDP at world size 1 vs the DDP path ----------------------------------------------------
if want fsdp; then
  if run_fit "mfu-fsdp-$SIZE" "$SIZE" 600 --parallelism fsdp; then
    run_train "mfu-ddp-$SIZE" "$SIZE" "$SEQ" "$FIT_BATCH" "$FIT_ACCUM" 600 || FAILED=1
  else
    FAILED=1
  fi
fi

# -- 7. checkpoints from GPU memory ----------------------------------------------------------
if want ckpt; then
  say "checkpoint save/load of the $SIZE state, $REPEATS rounds"
  "$PY" "$REPO/bench/gpu.py" ckpt "$DIR/ckpt-$SIZE.json" --model-size "$SIZE" --repeats "$REPEATS" \
    --dir "$WORK" --device "$DEVICE" 2>&1 | tee "$DIR/ckpt-$SIZE.log" | tee -a "$DIR/gpu.log" \
    || FAILED=1
fi

# -- 8. the 8b preset on one GPU: bf16 weights, activation checkpointing ------------------------
if want 8b; then
  if (( BIG_BYTES == 0 )) || "$PY" "$REPO/bench/gpu.py" fits --model-size "$BIG" \
      --bytes-per-param "$BIG_BYTES" "$DIR/fits-$BIG.json" | tee -a "$DIR/gpu.log"; then
    run_train "mfu-$BIG-bf16" "$BIG" "$BIG_SEQ" 1 1 900 --param-dtype bf16 \
      --activation-checkpointing || FAILED=1
  fi
fi

# -- 9. summary ------------------------------------------------------------------------------
"$PY" "$REPO/bench/gpu.py" summary "$DIR" | tee -a "$DIR/gpu.log"
say "done in $((SECONDS - T0)) s$( [[ $FAILED == 1 ]] && echo ', with failures (see above)')"
exit "$FAILED"
