#!/usr/bin/env bash
# The loss benchmark on LibTorch 1.13.1 (bookworm, build/) and 2.6.0 (the
# trixie root's build-trixie/), alternated, three rounds. Build both first
# (bash tools/setup.sh; bash tools/trixie.sh -- true); run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
ARGS="bench-losses --nproc 2 --batch 4096 --width 256 --iters 3 --threads 1 --modes floor,contrax"
for round in 1 2 3; do
  echo "== round $round, bookworm (LibTorch 1.13.1), load $(cut -d' ' -f1 /proc/loadavg)"
  build/contrax $ARGS 2>&1 | grep -E "^\| clip"
  echo "== round $round, trixie (LibTorch 2.6.0), load $(cut -d' ' -f1 /proc/loadavg)"
  bash tools/trixie.sh -- build-trixie/contrax $ARGS 2>&1 | grep -E "^\| clip"
done
