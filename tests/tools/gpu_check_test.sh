#!/usr/bin/env bash
# tools/gpu_check.sh on a machine without a GPU (CTest gpu_check_without_gpu):
# it must say that no GPU was found, name the build it checked, write the
# report and exit 3, quickly; --quick must say so before building anything.
# Also tools/same_curve.py, which --quick uses to compare a resumed run with
# an uninterrupted one. Skipped (77) where torch sees a GPU: there the
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
  bash "$(dirname "$0")/../../tools/gpu_check.sh" 2>&1)
st=$?
echo "$log"
fail() { echo "FAIL: $*"; exit 1; }
[ $st -eq 3 ] || fail "exit status $st, expected 3 (no GPU: nothing checked on a GPU)"
grep -q "gpu_check: no GPU found (torch sees 0 CUDA devices" <<<"$log" || fail "no 'no GPU found' line"
grep -q "nothing was checked on a GPU" <<<"$log" || fail "does not say that nothing was checked"
grep -q "$build/contrax built (contrax " <<<"$log" || fail "does not name the build it checked"
grep -q "^no GPU found: " "$out/report.md" || fail "the report does not say so"
grep -q "^torch: .*GPUs seen by torch: 0" "$out/report.md" || fail "the report does not name torch"

log=$(CONTRAX_GPU_CHECK_OUT=$out/quick CONTRAX_GPU_CHECK_PYTHON=$py bash "$(dirname "$0")/../../tools/gpu_check.sh" --quick 2>&1)
st=$?
echo "$log"
[ $st -eq 3 ] || fail "--quick: exit status $st, expected 3"
grep -q "gpu_check: no GPU found (torch sees 0 CUDA devices" <<<"$log" || fail "--quick: no 'no GPU found' line"
grep -q "nothing built (--quick builds only where a GPU is)" <<<"$log" || fail "--quick: does not say it built nothing"
log=$(bash "$(dirname "$0")/../../tools/gpu_check.sh" --fast 2>&1)
st=$?
[ $st -eq 2 ] && grep -q "usage: bash tools/gpu_check.sh \[--quick\]" <<<"$log" || fail "--fast: exit $st, $log"

same="$py $(dirname "$0")/../../tools/same_curve.py"
printf '%s\n' '{"step":1,"loss":5.25,"lr":0.001,"rows":8}' '{"step":2,"loss":4.5,"lr":0.002,"rows":8}' >"$out/a.jsonl"
cp "$out/a.jsonl" "$out/b.jsonl"
$same "$out/a.jsonl" "$out/b.jsonl" | grep -q "steps 1-2 equal bit for bit" || fail "same_curve: equal curves not equal"
printf '%s\n' '{"step":1,"loss":5.25,"lr":0.001,"rows":8}' '{"step":2,"loss":4.500000000000001,"lr":0.002,"rows":8}' \
  >"$out/b.jsonl"
log=$($same "$out/a.jsonl" "$out/b.jsonl")
[ $? -eq 1 ] && grep -q "step 2 differs" <<<"$log" || fail "same_curve: a last-bit difference not found: $log"
head -n 1 "$out/a.jsonl" >"$out/b.jsonl"
log=$($same "$out/a.jsonl" "$out/b.jsonl")
[ $? -eq 1 ] && grep -q "lacks steps \[2\]" <<<"$log" || fail "same_curve: a missing step not found: $log"
# tools/fused_verdict.py, the check's last line: switch on only when exact
# and faster at every loss and batch size.
verdict="$py $(dirname "$0")/../../tools/fused_verdict.py"
run() {  # run LOSS IMPL B MS ...: one gpu_losses.py --json line
  local results="" sep=""
  while [ $# -ge 4 ]; do
    results="$results$sep{\"loss\": \"$1\", \"impl\": \"$2\", \"B\": $3, \"result\": [$4, $4, $4, 10]}"
    sep=", "
    shift 4
  done
  echo "{\"device\": \"GPU X\", \"torch\": \"t\", \"cuda\": \"c\", \"dtype\": \"bf16\", \"width\": 768, \"results\": [$results]}"
}
run clip "Contrax clip_loss" 4096 2.0 clip "plain PyTorch (autocast)" 4096 3.0 siglip "Contrax siglip_loss" 4096 2.5 >"$out/aten.json"
run clip "Contrax clip_loss" 4096 1.5 siglip "Contrax siglip_loss" 4096 2.0 >"$out/fused.json"
log=$($verdict "$out/aten.json" "$out/fused.json" --exact 1)
[ $? -eq 0 ] && [ "$(tail -n 1 <<<"$log" | cut -c1-63)" = "VERDICT: the fused CUDA kernels are exact and faster on GPU X a" ] ||
  fail "fused_verdict: exact and faster not a switch-on: $log"
grep -q "| clip | 4096 | 1.50 ms | 2.00 ms | plain PyTorch (autocast) 3.00 ms |" <<<"$log" || fail "fused_verdict table: $log"
log=$($verdict "$out/aten.json" "$out/fused.json" --exact 0)
[ $? -eq 1 ] && grep -q "^VERDICT: keep the fused CUDA kernels opt-in on GPU X: an exactness step failed$" <<<"$log" ||
  fail "fused_verdict: an inexact run switched on: $log"
run clip "Contrax clip_loss" 4096 2.5 siglip "Contrax siglip_loss" 4096 2.0 >"$out/fused.json"
log=$($verdict "$out/aten.json" "$out/fused.json" --exact 1)
[ $? -eq 1 ] && grep -q "not faster at clip B = 4096 (2.50 ms fused, 2.00 ms ATen)" <<<"$log" ||
  fail "fused_verdict: a slower kernel switched on: $log"
echo "ok"
