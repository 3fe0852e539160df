#!/usr/bin/env bash
# The GPU acceptance run: the one command to run whenever a machine with
# NVIDIA GPUs is at hand.
#
#   bash tools/gpu_check.sh            # report in gpu_check/report.md
#
# On a machine with GPUs it
#   1. builds Contrax and its tests against this machine's PyTorch (tools/setup.sh;
#      CONTRAX_GPU_CHECK_BUILD=<dir> reuses a finished build instead),
#   2. runs the whole suite (the GPU tests run instead of skipping), and on
#      its own the test that no loss makes the CPU wait for the GPU,
#   3. runs `contrax verify` on CUDA over NCCL (one GPU per rank; W = 2, and
#      W = 3 and 4 where the GPUs exist) in fp64, fp32, bf16 and fp16 against
#      the single-device fp64 reference,
#   4. runs the ring at real sizes (blocks of 8192 x 1024 fp32 = 32 MiB) at each
#      of those world sizes, each under a hard timeout,
#   5. trains the default recipe on the GPUs (`contrax train --device cuda`),
#      stopped half-way and resumed (each rank's checkpoint onto its own GPU),
#      and evaluates it,
#   6. benchmarks Contrax's CLIP loss (each memory path) against an open_clip-style
#      loss (all_gather with gradient + cross_entropy under bf16 autocast) at
#      b = 4096 rows per rank, d = 768 (python/bench/bench_clip.py), and the
#      tiled path against the materialised one on one GPU (contrax bench-tiled),
# and writes every output, with the device named, to the report. Without a GPU
# it checks what the CPU can see (the build is a CUDA build when nvcc exists),
# says that no GPU was found and why, and exits 3 (nothing was checked on a GPU).
#
# Environment: CONTRAX_GPU_CHECK_OUT (report folder, default gpu_check),
# CONTRAX_GPU_CHECK_BUILD (an existing build folder), CONTRAX_GPU_CHECK_PYTHON
# (the interpreter of the build's torch, default .venv's), CONTRAX_GPU_CHECK_TIMEOUT
# (seconds per step, default 900), and tools/setup.sh's variables.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${CONTRAX_GPU_CHECK_OUT:-gpu_check}
LIMIT=${CONTRAX_GPU_CHECK_TIMEOUT:-900}
VENV=${CONTRAX_VENV:-.venv}
mkdir -p "$OUT"
REPORT=$OUT/report.md
failures=0

say() { echo "gpu_check: $*"; }
# step NAME COMMAND...: runs under the hard timeout, appends its output to the report.
step() {
  local name=$1
  shift
  say "$name"
  {
    echo
    echo "## $name"
    echo
    echo '```'
    echo "\$ $*"
  } >>"$REPORT"
  local t0=$SECONDS
  timeout --kill-after=30 "$LIMIT" "$@" >>"$REPORT" 2>&1
  local st=$?
  {
    echo '```'
    echo "exit status $st after $((SECONDS - t0)) s$([ $st -eq 124 ] && echo " (timed out at $LIMIT s)")"
  } >>"$REPORT"
  if [ $st -ne 0 ]; then
    failures=$((failures + 1))
    say "  FAILED (exit $st); see $REPORT"
  fi
}

{
  echo "# Contrax GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), host $(hostname)"
} >"$REPORT"

BUILD=${CONTRAX_GPU_CHECK_BUILD:-}
if [ -z "$BUILD" ]; then
  BUILD=build
  step "build (tools/setup.sh, all targets)" env CONTRAX_TARGETS=all bash tools/setup.sh
fi
PY=${CONTRAX_GPU_CHECK_PYTHON:-$VENV/bin/python}
[ -x "$PY" ] || PY=python3

# Which GPUs: nvidia-smi's view and PyTorch's (they can disagree: a driver
# without devices, CUDA_VISIBLE_DEVICES, a CPU-only torch).
if command -v nvidia-smi >/dev/null; then
  smi=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -n 4 | tr '\n' ';')
else
  smi="not installed"
fi
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
torch_cuda=$("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null || echo "torch not importable with $PY")
{
  echo
  echo "torch: $torch_cuda; GPUs seen by torch: $gpus"
  echo "nvidia-smi: $smi"
} >>"$REPORT"
if [ "$gpus" -eq 0 ] 2>/dev/null || ! [ "$gpus" -gt 0 ] 2>/dev/null; then
  built="no build checked"
  [ -x "$BUILD/contrax" ] && built="$BUILD/contrax built ($("$BUILD/contrax" --version 2>&1 | head -n 1))"
  if ldd "$BUILD/contrax" 2>/dev/null | grep -q 'libtorch_cuda'; then
    built="$built, linked against LibTorch's CUDA and NCCL libraries"
  fi
  echo "no GPU found: $built; nothing was checked on a GPU" >>"$REPORT"
  say "no GPU found (torch sees $gpus CUDA devices; nvidia-smi: $smi)."
  say "$built. The GPU checks (suite on CUDA, verify over NCCL, the ring at real sizes,"
  say "the loss benchmark) need a machine with NVIDIA GPUs; nothing was checked on a GPU."
  exit 3
fi

name=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')
say "$gpus GPU(s): $name"
echo "device: $gpus x $name" >>"$REPORT"

step "the whole suite" ctest --test-dir "$BUILD" -j2 --output-on-failure --timeout "$LIMIT"
step "no hidden host synchronisations (sync-debug mode \"error\"; two GPUs: NCCL, static shapes)" \
  env PYTHONPATH="$BUILD/python" "$PY" -m pytest -q -rs python/tests/test_cuda_sync.py
worlds=2
[ "$gpus" -ge 3 ] && worlds="$worlds 3"
[ "$gpus" -ge 4 ] && worlds="$worlds 4"
[ "$gpus" -lt 2 ] && worlds=1
for w in $worlds; do
  # fp64, then each reduced dtype: bf16 and fp16 features are gathered and
  # multiplied in their own dtype on CUDA (src/engine/precision.h), against the
  # fp64 reference on the same rounded inputs at the dtype's tolerance.
  for dt in fp64 fp32 bf16 fp16; do
    step "contrax verify, CUDA, NCCL, W=$w, $dt" "$BUILD/contrax" verify --device cuda --backend nccl --nproc "$w" \
      --dtype "$dt"
  done
  step "the ring at real sizes (8192 x 1024 fp32 blocks, 32 MiB), W=$w" \
    env PYTHONPATH="$BUILD/python" "$PY" python/bench/bench_clip.py --device cuda --world "$w" --batch 8192 \
    --width 1024 --iters 3 --path ring
done
step "contrax train --device cuda, W=${worlds##* }, 100 steps, stopped at 50 and resumed" bash -c \
  "'$BUILD/contrax' train --device cuda --nproc ${worlds##* } --max-steps 100 --stop-at-step 50 --no-eval --no-verify \
     --no-plot --overwrite --run-dir '$OUT/train_cuda' &&
   '$BUILD/contrax' train --device cuda --nproc ${worlds##* } --max-steps 100 --resume --no-verify --no-plot \
     --run-dir '$OUT/train_cuda'"
for path in auto materialised tiled ring; do
  step "CLIP loss vs an open_clip-style loss, b=4096, d=768, bf16 autocast, path $path" \
    env PYTHONPATH="$BUILD/python" "$PY" python/bench/bench_clip.py --device cuda --world "${worlds##* }" \
    --batch 4096 --width 768 --iters 10 --autocast --path "$path"
done

step "contrax bench-tiled --device cuda, d=768" "$BUILD/contrax" bench-tiled --device cuda --width 768 \
  --batches 16384,65536 --iters 5

say "report: $REPORT ($failures failed step(s))"
[ $failures -eq 0 ]
