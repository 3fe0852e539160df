#!/usr/bin/env bash
# The layers' include boundaries: each probe (tests/CMakeLists.txt) includes a
# header of a layer that is not below the probe's own, with the include path
# of the own layer's sources or of its tests (tests/<layer>), and must fail to
# compile because that header is not found; each control probe includes a
# header of a layer below and must compile.
# Usage: layers_test.sh BUILD_DIR CONTROL_TARGET... -- TARGET:HEADER...
set -uo pipefail
build=$1
shift
log=$(mktemp)
trap 'rm -f "$log"' EXIT
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
  control=$1
  shift
  if ! cmake --build "$build" --target "$control" >"$log" 2>&1; then
    cat "$log"
    echo "FAIL: $control (a header of a layer below) does not compile"
    exit 1
  fi
  echo "ok: $control compiles"
done
shift
failed=0
for probe in "$@"; do
  target=${probe%%:*} header=${probe#*:}
  if cmake --build "$build" --target "$target" >"$log" 2>&1; then
    echo "FAIL: $target compiled: $header is visible from a layer it is not below"
    failed=1
  elif grep -q "$header: No such file or directory" "$log"; then
    echo "ok: $target: $header not found"
  else
    cat "$log"
    echo "FAIL: $target failed, but not because $header was not found"
    failed=1
  fi
done
[ "$failed" -eq 0 ] && echo "all $# upward includes rejected"
exit "$failed"
