#!/usr/bin/env bash
# What one GPU runs in under 10 minutes: pyrecover-train MFU for the 1b preset (sequence 2048,
# bf16 autocast, torch.compile, fused AdamW) on a generated corpus (nothing is downloaded),
# checkpoint blocking time async vs sync from GPU memory (~1.5B parameters + AdamW state) and
# cold load time against torch.save/torch.load, and the 8b shape's MFU when it fits in memory.
#
#   bench/gpu.sh DIR                 results (JSON, logs) go to DIR; run from a copy of the repo
#   bench/gpu.sh --cpu-smoke DIR     every step with tiny sizes on CPU (checks the script)
#
# It makes a virtualenv (python3 -m venv --system-site-packages, so a preinstalled CUDA torch is
# reused; else `pip install torch`, or $TORCH_SPEC), installs ./packages/* and ./apps/train into
# it (only the dependencies it lacks are fetched; PIP_FIND_LINKS=wheels/ PIP_NO_INDEX=1 works
# offline), and runs. Knobs (environment): GPU_BENCH_VENV (default /tmp/pyrecover-gpu-venv),
# GPU_BENCH_WORK (scratch on the disk to measure; default a temp dir, removed at the end; needs
# ~40 GB free), GPU_BENCH_STEPS (40), GPU_BENCH_BATCH (8), GPU_BENCH_REPEATS (2), TORCH_SPEC.
set -euo pipefail

usage() { echo "usage: bench/gpu.sh [--cpu-smoke] DIR   (DIR: where results and logs go)" >&2; exit 2; }
SMOKE=0
DIR=""
for arg in "$@"; do
  case "$arg" in
    --cpu-smoke) SMOKE=1 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    -*) echo "bench/gpu.sh: unknown option $arg" >&2; usage ;;
    *) [[ -z "$DIR" ]] || { echo "bench/gpu.sh: one DIR only (got $DIR and $arg)" >&2; usage; }
       DIR="$arg" ;;
  esac
done
[[ -n "$DIR" ]] || usage
command -v python3 >/dev/null || { echo "bench/gpu.sh: python3 not found: install Python >= 3.10" >&2; exit 1; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
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
  DOCS=200
else
  SIZE=1b SEQ=2048 BATCH="${GPU_BENCH_BATCH:-8}" STEPS="${GPU_BENCH_STEPS:-40}" SKIP=10 LOG_EVERY=5
  REPEATS="${GPU_BENCH_REPEATS:-2}" DEVICE=cuda
  TRAIN_FLAGS=(--device cuda --model-dtype bf16 --compile --fused-optimizer)
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

# -- 3. MFU ----------------------------------------------------------------------------------
"$PY" "$REPO/bench/gpu.py" corpus "$WORK/corpus.parquet" --docs "$DOCS" >> "$DIR/gpu.log"

run_train() {  # NAME SIZE BATCH ACCUM SECONDS: one bounded pyrecover-train run; status 0 = ok
  local name=$1 size=$2 batch=$3 accum=$4 limit=$5 rc=0
  rm -rf "$WORK/ckpt"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -l 1 \
      > "$DIR/$name.smi.csv" 2>/dev/null &
    SMI_PID=$!
  fi
  say "$name: pyrecover-train --model-size $size, batch $batch x accum $accum, $STEPS steps"
  timeout "$limit" "$PY" -m pyrecover_train --dataset "$WORK/corpus.parquet" --tokenizer byte \
    --cache-dir "$WORK/cache" --model-size "$size" --sequence-length "$SEQ" \
    --batch-size "$batch" --grad-accum "$accum" --training-steps "$STEPS" \
    --log-every "$LOG_EVERY" --eval-every 0 --checkpoint-frequency 0 \
    --checkpoint-dir "$WORK/ckpt" --experiment_name "$name" --metrics "$DIR/$name.metrics.jsonl" \
    "${TRAIN_FLAGS[@]}" > "$DIR/$name.log" 2>&1 || rc=$?
  [[ -n "$SMI_PID" ]] && { kill "$SMI_PID" 2>/dev/null || true; wait "$SMI_PID" 2>/dev/null || true; SMI_PID=""; }
  rm -rf "$WORK/ckpt"  # the run's final checkpoint: disk for the checkpoint benchmark
  if [[ $rc != 0 ]]; then
    say "$name: exit $rc ($( [[ $rc == 124 ]] && echo "over ${limit}s" || tail -n 1 "$DIR/$name.log"))"
    return $rc
  fi
  "$PY" "$REPO/bench/gpu.py" mfu "$DIR/$name.metrics.jsonl" "$DIR/$name.json" --skip "$SKIP" \
    --label "$name: $size, seq $SEQ, batch $batch x $accum" --smi "$DIR/$name.smi.csv" \
    --extra "{\"model_size\": \"$size\", \"seq\": $SEQ, \"batch\": $batch, \"grad_accum\": $accum}" \
    | tee -a "$DIR/gpu.log"
}

FAILED=0
if ! run_train "mfu-$SIZE" "$SIZE" "$BATCH" 1 300; then
  if grep -qi "out of memory" "$DIR/mfu-$SIZE.log"; then
    say "out of memory at batch $BATCH: again with batch $((BATCH / 2)) x accum 2"
    run_train "mfu-$SIZE" "$SIZE" "$((BATCH / 2))" 2 300 || FAILED=1
  else
    FAILED=1
  fi
fi

# -- 4. checkpoints from GPU memory ----------------------------------------------------------
say "checkpoint save/load of the $SIZE state, $REPEATS rounds"
"$PY" "$REPO/bench/gpu.py" ckpt "$DIR/ckpt-$SIZE.json" --model-size "$SIZE" --repeats "$REPEATS" \
  --dir "$WORK" --device "$DEVICE" 2>&1 | tee "$DIR/ckpt-$SIZE.log" | tee -a "$DIR/gpu.log" \
  || FAILED=1

# -- 5. the 8b shape, when it fits -----------------------------------------------------------
if "$PY" "$REPO/bench/gpu.py" fits --model-size 8b "$DIR/fits-8b.json" | tee -a "$DIR/gpu.log"; then
  run_train mfu-8b 8b 1 1 240 || say "8b: did not run to the end (see $DIR/mfu-8b.log)"
fi

# -- 6. summary ------------------------------------------------------------------------------
"$PY" "$REPO/bench/gpu.py" summary "$DIR" | tee -a "$DIR/gpu.log"
say "done in $((SECONDS - T0)) s$( [[ $FAILED == 1 ]] && echo ', with failures (see above)')"
exit "$FAILED"
