#!/usr/bin/env bash
# The layers' include boundaries: each probe (tests/CMakeLists.txt) includes a
# header of a layer that is not below the probe's own, with the include path
# of the own layer's sources or of its tests (tests/<layer>), and must fail to
# compile because that header is not found; each control probe includes a
# header of a layer below and must compile. All of them are built by one
# build command that keeps going past failures (one per probe took 0.3 s of
# the build tool's start each, 35 of the test's 64 s), and each probe's
# outcome is read from its object file and the compiler's message.
# Usage: layers_test.sh BUILD_DIR CONTROL_TARGET... -- TARGET:HEADER...
set -uo pipefail
build=$1
shift
log=$(mktemp)
trap 'rm -f "$log"' EXIT
controls=()
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
  controls+=("$1")
  shift
done
shift
targets=("${controls[@]}")
for probe in "$@"; do targets+=("${probe%%:*}"); done
objects() { find "$build/tests/CMakeFiles/$1.dir" -name '*.o' 2>/dev/null; }
# A probe compiled by an earlier run would not be built again: start from none.
for target in "${targets[@]}"; do objects "$target" | xargs -r rm -f; done
keep_going=(-k 0)
grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja' "$build/CMakeCache.txt" || keep_going=(-k)
cmake --build "$build" --target "${targets[@]}" -- "${keep_going[@]}" >"$log" 2>&1
failed=0
for control in "${controls[@]}"; do
  if [ -z "$(objects "$control")" ]; then
    cat "$log"
    echo "FAIL: $control (a header of a layer below) does not compile"
    exit 1
  fi
  echo "ok: $control compiles"
done
for probe in "$@"; do
  target=${probe%%:*} header=${probe#*:}
  if [ -n "$(objects "$target")" ]; then
    echo "FAIL: $target compiled: $header is visible from a layer it is not below"
    failed=1
  elif grep -q "layer_probes/$target.cpp:1:[0-9]*: fatal error: $header: No such file or directory" "$log"; then
    echo "ok: $target: $header not found"
  else
    grep -A5 "layer_probes/$target.cpp" "$log"
    echo "FAIL: $target failed, but not because $header was not found"
    failed=1
  fi
done
[ "$failed" -eq 0 ] && echo "all $# upward includes rejected"
exit "$failed"
