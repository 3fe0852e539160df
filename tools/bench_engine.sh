#!/bin/sh
# The loss engine's benchmarks (issue 15), each contender against the GEMM
# floor of the old algorithm measured in the same run: one direction in one
# process (three GEMMs), symmetric CLIP and NT-Xent at W = 2 and 4 (six and
# twelve GEMM units), and tiled symmetric CLIP at B = 32768 with the floor and
# the materialised path measured (4 GiB buffers); bench-losses also measures
# the old GEMMs into a buffer allocated before the clock (floor_kept), the
# floor of an old algorithm that kept its buffer as contrax does. With
# OLD=path/to/contrax the
# same commands run for that binary too, alternated with this one, so that
# before/after figures come from one run. Each command holds `flock $LOCK`.
#   sh tools/bench_engine.sh [ROUNDS]        (default 1 round)
set -eu
ROUNDS=${1:-1}
HERE=$(cd "$(dirname "$0")/.." && pwd)
NEW=${CONTRAX:-$HERE/build/contrax}
LOCK=${LOCK:-/tmp/cpu.lock}
run() {
  bin=$1
  label=$2
  modes=$3
  echo "## $label ($bin), load $(uptime | sed 's/.*load average: //')"
  flock "$LOCK" "$bin" bench-tiled --threads 1 --batches 4096,8192 --iters 5 --max-materialised 8192 | grep '^|'
  flock "$LOCK" "$bin" bench-losses --nproc 2,4 --batch 4096 --width 256 --iters 3 --threads 1 --modes "$modes" | grep '^|'
  flock "$LOCK" "$bin" bench-losses --loss nt_xent --nproc 2,4 --batch 4096 --width 256 --iters 3 --threads 1 --modes "$modes" | grep '^|'
  flock "$LOCK" "$bin" bench-tiled --symmetric --threads 2 --batches 32768 --iters 1 --max-materialised 32768 | grep '^|'
}
i=0
while [ "$i" -lt "$ROUNDS" ]; do
  i=$((i + 1))
  run "$NEW" "this build, round $i" floor,floor_kept,contrax
  if [ -n "${OLD:-}" ]; then run "$OLD" "OLD, round $i" floor,contrax; fi
done
