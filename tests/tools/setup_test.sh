#!/usr/bin/env bash
# tools/setup.sh's own errors (CTest setup_errors), each before it installs or
# writes anything: a CONTRAX_TORCH that is not pypi, system or python, and a
# CONTRAX_PYTHON that cannot import torch, are usage errors (2); a first
# install of PyPI's torch onto a file system without room for it stops at
# once with how much it needs and where (1), checked on a 64 MB tmpfs
# (skipped, 77, where mounting one is not permitted).
set -u
setup="$(cd "$(dirname "$0")/../.." && pwd)/tools/setup.sh"
fail() { echo "FAIL: $*"; exit 1; }
small=$(mktemp -d)
trap 'umount "$small" 2>/dev/null; rm -rf "$small"' EXIT

log=$(CONTRAX_TORCH=conda bash "$setup" 2>&1)
st=$?
echo "$log"
[ $st -eq 2 ] || fail "CONTRAX_TORCH=conda: exit status $st, expected 2"
grep -q "setup: CONTRAX_TORCH must be pypi, system or python, but is 'conda'" <<<"$log" || fail "no message naming CONTRAX_TORCH"

# CONTRAX_TORCH=python with an interpreter that has no torch: a usage error.
log=$(CONTRAX_TORCH=python CONTRAX_PYTHON=/bin/false bash "$setup" 2>&1)
st=$?
echo "$log"
[ $st -eq 2 ] || fail "CONTRAX_PYTHON without torch: exit status $st, expected 2"
grep -q "setup: CONTRAX_TORCH=python builds against the torch of CONTRAX_PYTHON, but '/bin/false' cannot import torch; set CONTRAX_PYTHON to the interpreter that has it" <<<"$log" ||
  fail "no message naming CONTRAX_PYTHON"

if ! mount -t tmpfs -o size=64m tmpfs "$small" 2>/dev/null; then
  echo "skipped: mounting a tmpfs is not permitted here (the space check needs a small file system)"
  exit 77
fi
log=$(CONTRAX_TORCH=pypi CONTRAX_VENV=$small/venv CONTRAX_CACHE=$small/cache CONTRAX_BUILD_DIR=$small/build \
  bash "$setup" 2>&1)
st=$?
echo "$log"
[ $st -eq 1 ] || fail "no room: exit status $st, expected 1"
grep -q "setup: a first install of PyPI's torch needs about 10 GB free (wheels in $small/cache, unpacked in $small/venv), but the file system of $small/cache has 0 GB free" <<<"$log" ||
  fail "no message saying how much room is needed and where"
[ -z "$(ls -A "$small")" ] || fail "it wrote into the small file system: $(ls -A "$small")"
echo "ok"
