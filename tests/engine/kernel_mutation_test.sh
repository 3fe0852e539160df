#!/usr/bin/env bash
# The mutation test of the CUDA panel kernels (issue 51): faults planted in a
# copy of src/engine/kernels/ must each make the emulated kernels' check
# (tests/engine/mutation/kernels_check.cpp, run under the SIMT emulator) fail; the
# test fails if any goes unnoticed, if the unmutated copy does not pass, or if
# a mutation no longer applies (its line changed: update it here).
#
#   kernel_mutation_test.sh <c++ compiler> <source dir>
set -euo pipefail
CXX=$1
SRC=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
flags=(-O1 -std=c++17 -Wno-unknown-pragmas -I"$SRC/tests")
"$CXX" "${flags[@]}" -c "$SRC/tests/support/simt.cpp" -o "$work/simt.o"

# Builds the check against the kernels in $1 (a folder holding
# engine/kernels/) and runs it; its status is the check's.
check() {
  "$CXX" "${flags[@]}" -I"$1" "$SRC/tests/engine/mutation/kernels_check.cpp" "$work/simt.o" -o "$work/check"
  timeout 120 "$work/check" >"$work/out" 2>&1
}

if ! check "$SRC/src"; then
  echo "FAIL: the unmutated kernels do not pass the check:"; cat "$work/out"; exit 1
fi
echo "unmutated: $(tail -n 1 "$work/out")"

# file | line as it is | line as planted
mutations=(
  "cuda_strip_reduce.cuh|  __syncthreads();|"
  "cuda_strip_reduce.cuh|  for (int off = kWarp / 2; off > 0; off /= 2) {|  for (int off = 8; off > 0; off /= 2) {"
  "cuda_lse_panel.cuh|  if (a.pos_row != nullptr) {  // multi-positive labels: the rows' positive sums and counts|  if (false) {"
  "panel_grid.h|  for (int64_t c = c_begin + tid; c < c_end; c += kThreads) {|  for (int64_t c = c_begin + tid; c <= c_end; c += kThreads) {"
  "panel_grid.h|  if (a.row_lse && t < a.rows) {|  if (a.row_lse && t <= a.rows) {"
  "panel_grid.h|  if (c >= a.cols) return;|  if (c > a.cols) return;"
  "panel_grid.h|  for (int64_t c = c_begin + lane; c < c_end; c += kWarp) {|  for (int64_t c = c_begin + lane; c <= c_end; c += kWarp) {"
  "panel_grid.h|  for (int64_t j = q.begin + lane; j < q.end; j += kWarp) {|  for (int64_t j = q.begin + lane; j <= q.end; j += kWarp) {"
)
unnoticed=0
for m in "${mutations[@]}"; do
  IFS='|' read -r file from to <<<"$m"
  rm -rf "$work/m" && mkdir -p "$work/m/engine" && cp -r "$SRC/src/engine/kernels" "$work/m/engine/"
  f="$work/m/engine/kernels/$file"
  if [ "$(grep -cxF -- "$from" "$f")" != 1 ]; then
    echo "FAIL: the mutation of $file no longer applies: no single line '$from'"; exit 1
  fi
  content=$(cat "$f")
  printf '%s\n' "${content/"$from"/"$to"}" >"$f"
  if check "$work/m"; then
    echo "UNNOTICED: $file: '$from' -> '$to'"
    unnoticed=$((unnoticed + 1))
  else
    echo "caught: $file: '$from' -> '$to': $(grep -m1 FAIL "$work/out" || tail -n 1 "$work/out")"
  fi
done
if [ "$unnoticed" -gt 0 ]; then
  echo "FAIL: $unnoticed of ${#mutations[@]} planted faults went unnoticed"; exit 1
fi
echo "every one of ${#mutations[@]} planted faults was caught"
