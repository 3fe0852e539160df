#!/usr/bin/env bash
# tools/gpu_check.sh on a machine without a GPU (CTest gpu_check_without_gpu):
# it must say that no GPU was found, name the build it checked, write the
# report and exit 3, quickly. Skipped (77) where torch sees a GPU: there the
# script is the GPU acceptance run itself, run by hand, not a unit test.
# Usage: gpu_check_test.sh PYTHON BUILD_DIR
set -u
py=$1 build=$2
if "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)'; then
  echo "skipped: this machine has a GPU; run tools/gpu_check.sh itself"
  exit 77
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
log=$(CONTRAX_GPU_CHECK_BUILD=$build CONTRAX_GPU_CHECK_OUT=$out CONTRAX_GPU_CHECK_PYTHON=$py \
  bash "$(dirname "$0")/../tools/gpu_check.sh" 2>&1)
st=$?
echo "$log"
fail() { echo "FAIL: $*"; exit 1; }
[ $st -eq 3 ] || fail "exit status $st, expected 3 (no GPU: nothing checked on a GPU)"
grep -q "gpu_check: no GPU found (torch sees 0 CUDA devices" <<<"$log" || fail "no 'no GPU found' line"
grep -q "nothing was checked on a GPU" <<<"$log" || fail "does not say that nothing was checked"
grep -q "$build/contrax built (contrax " <<<"$log" || fail "does not name the build it checked"
grep -q "^no GPU found: " "$out/report.md" || fail "the report does not say so"
grep -q "^torch: .*GPUs seen by torch: 0" "$out/report.md" || fail "the report does not name torch"
echo "ok"
