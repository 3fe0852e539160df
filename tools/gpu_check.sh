#!/usr/bin/env bash
# The GPU acceptance run: the one command to run whenever a machine with
# NVIDIA GPUs is at hand.
#
#   bash tools/gpu_check.sh --quick    # about 6 min on one GPU, offline; report in gpu_check/report.md
#   bash tools/gpu_check.sh            # everything, for machines with time
#
# --quick is for a short lease on a machine without network and with its own
# PyTorch (the python3 on PATH, or CONTRAX_GPU_CHECK_PYTHON): it builds only
# what it runs against that torch, with every core, taking CLI11, JSON,
# GoogleTest, Gloo's headers and Fashion-MNIST from the offline bundle
# (tools/gpu_bundle.sh, carried into the checkout as .bundle/) where apt
# cannot reach a mirror, and checks what matters most:
#   1. no hidden host synchronisation in any loss (sync-debug mode "error"),
#   2. `contrax verify` on CUDA in fp64, fp32, bf16 and fp16 against the fp64
#      reference, and two ranks on the one GPU over Gloo,
#   3. device_test (its CUDA cases and its CPU ones), precision_test and grad_cache_test,
#      and the engine's CUDA panel kernels (opt-in, CONTRAX_FUSED_KERNELS=1)
#      against the ATen path (cuda_panels_test) and in `contrax verify` fp64,
#   4. `contrax train --device cuda` stopped at step 50 and resumed, its curve
#      bitwise equal to an uninterrupted run's,
#   5. compute-sanitizer's memcheck, racecheck and synccheck on the panel
#      kernels' test (cuda_panels_test; the sanitizer from the bundle's
#      sanitizer.tar.xz, PyPI's nvidia-cuda-sanitizer-api where installed, or
#      the PATH), the hazards the CPU's SIMT emulator does not model,
#   6. the losses against plain PyTorch, memeff and siglip-kernel
#      (python/bench/gpu_losses.py; the peers from the bundle where carried),
#      at B = 4,096, 16,384 and 65,536, once with the ATen passes and once with
#      the fused kernels (CONTRAX_FUSED_KERNELS=1), side by side, ending with
#      one line (tools/fused_verdict.py): whether the fused kernels are exact
#      and faster on this GPU and may become the default (docs/engine.md),
#   7. the default recipe's examples/s beside the plain PyTorch DDP program of
#      the same recipe (the bundle's peers/, through tools/peer_gpu.py) on the
#      same GPU.
#
# The full run
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
# Both write every output, with the GPU, driver, torch and CUDA named, to the
# report. Without a GPU they say that no GPU was found and exit 3 (nothing
# was checked on a GPU); --quick says so before building anything, the full
# run after checking what the CPU can see (the build is a CUDA build when nvcc
# exists).
#
# Environment: CONTRAX_GPU_CHECK_OUT (report folder, default gpu_check),
# CONTRAX_GPU_CHECK_BUILD (an existing build folder), CONTRAX_GPU_CHECK_PYTHON
# (the interpreter of the build's torch, default .venv's; with --quick the
# python3 on PATH), CONTRAX_GPU_CHECK_TIMEOUT (seconds per step, default 900;
# 300 with --quick), CONTRAX_BUNDLE (the offline bundle, default .bundle), and
# tools/setup.sh's variables.
set -uo pipefail
cd "$(dirname "$0")/.."

QUICK=0
case "${1:-}" in
  --quick) QUICK=1 ;;
  "") ;;
  *) echo "usage: bash tools/gpu_check.sh [--quick]" >&2; exit 2 ;;
esac
OUT=${CONTRAX_GPU_CHECK_OUT:-gpu_check}
LIMIT=${CONTRAX_GPU_CHECK_TIMEOUT:-$([ $QUICK = 1 ] && echo 300 || echo 900)}
VENV=${CONTRAX_VENV:-.venv}
BUNDLE=${CONTRAX_BUNDLE:-.bundle}
# The data set: Debian's package where installed, else the bundle's copy.
DATA=/usr/share/datasets/fashion-mnist
[ -f "$DATA/train-images-idx3-ubyte.gz" ] || DATA=$BUNDLE/fashion-mnist
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

if [ $QUICK = 1 ]; then
  PY=${CONTRAX_GPU_CHECK_PYTHON:-$(command -v python3 || echo python3)}
else
  PY=${CONTRAX_GPU_CHECK_PYTHON:-$VENV/bin/python}
  [ -x "$PY" ] || PY=python3
fi
# Which GPUs: nvidia-smi's view and PyTorch's (they can disagree: a driver
# without devices, CUDA_VISIBLE_DEVICES, a CPU-only torch).
gpu_facts() {
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
}
no_gpu() {  # no_gpu WHAT-WAS-BUILT
  echo "no GPU found: $1; nothing was checked on a GPU" >>"$REPORT"
  say "no GPU found (torch sees $gpus CUDA devices; nvidia-smi: $smi)."
  say "$1. The GPU checks need a machine with NVIDIA GPUs; nothing was checked on a GPU."
  exit 3
}
has_gpu() { [ "$gpus" -gt 0 ] 2>/dev/null; }
# The filter of the cases of tests/LAYER/NAME.cpp in its layer's program
# (tests/CMakeLists.txt writes them at configure time), as one argument.
file_cases() { awk -v n="$2" '$1 == n { print "--gtest_filter=" $2 }' "$BUILD/tests/test_filters/$1.txt"; }

# compute-sanitizer: the bundle's (unpacked into the report folder), PyPI's
# where installed in the interpreter's environment, or the PATH's; empty when
# none is found.
sanitizer() {
  if [ -f "$BUNDLE/sanitizer.tar.xz" ]; then
    mkdir -p "$OUT/sanitizer" && tar -C "$OUT/sanitizer" -xJf "$BUNDLE/sanitizer.tar.xz" &&
      echo "$OUT/sanitizer/compute-sanitizer/compute-sanitizer" && return
  fi
  local pypi
  pypi=$("$PY" -c 'import glob, nvidia, os; print(next(iter(sorted(glob.glob(os.path.join(list(nvidia.__path__)[0], "cu*", "compute-sanitizer", "compute-sanitizer")))), ""))' 2>/dev/null)
  [ -n "$pypi" ] && echo "$pypi" && return
  command -v compute-sanitizer || true
}

# The quick checks (see the top): one GPU, the machine's own torch.
quick_checks() {
  local name
  name=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')
  say "$gpus GPU(s): $name"
  echo "device: $gpus x $name" >>"$REPORT"
  local pypath="$BUILD/python"
  # memeff and siglip-kernel are pure-Python wheels: the bundle carries them unpacked.
  [ -d "$BUNDLE/pylib" ] && pypath="$pypath:$BUNDLE/pylib"
  step "no hidden host synchronisations (sync-debug mode \"error\")" \
    env PYTHONPATH="$pypath" "$PY" -m pytest -q -rs python/tests/test_cuda_sync.py
  for dt in fp64 fp32 bf16 fp16; do
    step "contrax verify, CUDA, one process, $dt" "$BUILD/contrax" verify --device cuda --nproc 1 --dtype "$dt"
  done
  step "contrax verify, CUDA, two ranks on one GPU over Gloo, fp64" \
    "$BUILD/contrax" verify --device cuda --backend gloo --nproc 2 --dtype fp64
  step "device_test (its CPU and CUDA cases)" "$BUILD/tests/check_tests" "$(file_cases check device_test)"
  step "precision_test" "$BUILD/tests/check_tests" "$(file_cases check precision_test)"
  step "grad_cache_test" "$BUILD/tests/parallel_tests" "$(file_cases parallel grad_cache_test)"
  # The fused kernels' exactness: each of these steps must pass for the verdict.
  local before=$failures exact=1
  step "the CUDA panel kernels against the ATen path (cuda_panels_test)" \
    "$BUILD/tests/losses_tests" "$(file_cases losses cuda_panels_test)"
  step "contrax verify, CUDA, one process, fp64, with the CUDA panel kernels (CONTRAX_FUSED_KERNELS=1)" \
    env CONTRAX_FUSED_KERNELS=1 "$BUILD/contrax" verify --device cuda --nproc 1 --dtype fp64
  local san
  san=$(sanitizer)
  if [ -n "$san" ]; then
    for tool in memcheck racecheck synccheck; do
      step "compute-sanitizer --tool $tool on the CUDA panel kernels (cuda_panels_test)" \
        "$san" --tool "$tool" --error-exitcode 1 --target-processes all "$BUILD/tests/losses_tests" \
        "$(file_cases losses cuda_panels_test)"
    done
  else
    exact=0
    say "no compute-sanitizer (bundle, PyPI's nvidia-cuda-sanitizer-api or PATH): the kernels are not sanitized"
    echo "no compute-sanitizer found: memcheck, racecheck and synccheck were not run" >>"$REPORT"
  fi
  [ $failures -eq "$before" ] || exact=0
  local train=("$BUILD/contrax" train --device cuda --nproc 1 --max-steps 100 --no-eval --no-verify --no-plot
               --data "$DATA")
  step "contrax train --device cuda: 100 steps, and 50 + 50 stopped and resumed, bitwise the same curve" bash -c \
    "$(printf '%q ' "${train[@]}") --overwrite --run-dir '$OUT/train_whole' &&
     $(printf '%q ' "${train[@]}") --overwrite --stop-at-step 50 --run-dir '$OUT/train_resumed' &&
     $(printf '%q ' "${train[@]}") --resume --run-dir '$OUT/train_resumed' &&
     '$PY' tools/same_curve.py '$OUT/train_whole/metrics.jsonl' '$OUT/train_resumed/metrics.jsonl'"
  step "the losses against plain PyTorch and the peers, ATen passes (python/bench/gpu_losses.py)" \
    bash -c "PYTHONPATH='$pypath' '$PY' python/bench/gpu_losses.py --iters 5 --json >'$OUT/losses_aten.json'"
  step "the losses against plain PyTorch and the peers, fused kernels (CONTRAX_FUSED_KERNELS=1)" \
    bash -c "CONTRAX_FUSED_KERNELS=1 PYTHONPATH='$pypath' '$PY' python/bench/gpu_losses.py --iters 5 --json \
      >'$OUT/losses_fused.json'"
  # The verdict's own status is not a failure of the check: "keep them opt-in" is an answer.
  "$PY" tools/fused_verdict.py "$OUT/losses_aten.json" "$OUT/losses_fused.json" --exact "$exact" \
    >"$OUT/verdict.md" 2>&1
  { echo; echo "## the fused CUDA kernels on this GPU"; echo; cat "$OUT/verdict.md"; } >>"$REPORT"
  step "the default recipe's examples/s: contrax train --device cuda, 300 steps" \
    "$BUILD/contrax" train --device cuda --nproc 1 --max-steps 300 --no-eval --no-verify --no-plot --overwrite \
    --data "$DATA" --run-dir "$OUT/train_speed"
  if [ -f "$BUNDLE/peers/simclr_torch_ddp.py" ]; then
    step "the same recipe in plain PyTorch DDP on the same GPU (the bundle's peer, tools/peer_gpu.py), 300 steps" \
      "$PY" tools/peer_gpu.py "$BUNDLE/peers/simclr_torch_ddp.py" --spawn 1 --data "$DATA" --max-steps 300 \
      --no-eval --json
  else
    say "no peer program in $BUNDLE/peers: the side-by-side run is skipped"
    echo "no peer program in $BUNDLE/peers: the side-by-side run was skipped" >>"$REPORT"
  fi
}

if [ $QUICK = 1 ]; then
  gpu_facts
  has_gpu || no_gpu "nothing built (--quick builds only where a GPU is)"
  BUILD=${CONTRAX_GPU_CHECK_BUILD:-build}
  if [ -z "${CONTRAX_GPU_CHECK_BUILD:-}" ]; then
    step "build against $PY's torch, every core (tools/setup.sh, CONTRAX_TORCH=python, the offline bundle where apt cannot reach a mirror)" \
      env CONTRAX_TORCH=python CONTRAX_PYTHON="$PY" CONTRAX_BUILD_DIR="$BUILD" CONTRAX_BUNDLE="$BUNDLE" \
      CONTRAX_TARGETS="contrax_cli contrax_python check_tests parallel_tests losses_tests" bash tools/setup.sh
  fi
  quick_checks
  say "report: $REPORT ($failures failed step(s))"
  say "$(grep -h '^VERDICT' "$OUT/verdict.md" 2>/dev/null || echo 'VERDICT: none (the benchmarks did not run)')"
  [ $failures -eq 0 ]
  exit
fi

BUILD=${CONTRAX_GPU_CHECK_BUILD:-}
if [ -z "$BUILD" ]; then
  BUILD=build
  step "build (tools/setup.sh, all targets)" env CONTRAX_TARGETS=all bash tools/setup.sh
fi

gpu_facts
if ! has_gpu; then
  built="no build checked"
  [ -x "$BUILD/contrax" ] && built="$BUILD/contrax built ($("$BUILD/contrax" --version 2>&1 | head -n 1))"
  if ldd "$BUILD/contrax" 2>/dev/null | grep -q 'libtorch_cuda'; then
    built="$built, linked against LibTorch's CUDA and NCCL libraries"
  fi
  no_gpu "$built"
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
     --no-plot --overwrite --data '$DATA' --run-dir '$OUT/train_cuda' &&
   '$BUILD/contrax' train --device cuda --nproc ${worlds##* } --max-steps 100 --resume --no-verify --no-plot \
     --data '$DATA' --run-dir '$OUT/train_cuda'"
for path in auto materialised tiled ring; do
  step "CLIP loss vs an open_clip-style loss, b=4096, d=768, bf16 autocast, path $path" \
    env PYTHONPATH="$BUILD/python" "$PY" python/bench/bench_clip.py --device cuda --world "${worlds##* }" \
    --batch 4096 --width 768 --iters 10 --autocast --path "$path"
done

step "contrax bench-tiled --device cuda, d=768" "$BUILD/contrax" bench-tiled --device cuda --width 768 \
  --batches 16384,65536 --iters 5

say "report: $REPORT ($failures failed step(s))"
[ $failures -eq 0 ]
