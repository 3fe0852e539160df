#!/bin/sh
# Training throughput side by side: `contrax train` (as shipped; with
# glibc's default heap trimming; and with CONTRAX_FUSED_ENCODER=0, torch's
# modules in the default layout instead of the fused channels-last encoder,
# for comparison) against the plain PyTorch DDP
# program ../shared/peers/simclr_torch_ddp.py run as its users run it (no
# tunables), on the same PyPI torch that contrax is built against (.venv). Same recipe (contrax's `--recipe-variant peer`: the 32-64-128
# encoder, crop scale 0.2-1, temperature 0.2, which the peer implements; the
# default recipe has since changed), global batch 256, 2 processes x 1 thread, STEPS steps
# each, alternating, REPEATS rounds, each run alone under `flock $LOCK` (the
# lock other benchmarks on this machine take too).
#   sh tools/bench_vs_peer.sh [STEPS] [REPEATS]
# Prints one line per run: implementation, round, load average before it, and
# examples/s over the whole loop (each implementation's own figure).
set -eu
STEPS=${1:-300}
REPEATS=${2:-3}
HERE=$(cd "$(dirname "$0")/.." && pwd)
CONTRAX=${CONTRAX:-$HERE/build/contrax}
PEER=${PEER:-$HERE/../shared/peers/simclr_torch_ddp.py}
DATA=${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
PY=${PYTHON:-$HERE/.venv/bin/python}
LOCK=${LOCK:-/tmp/cpu.lock}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
load() { uptime | sed 's/.*load average: //'; }
i=0
while [ "$i" -lt "$REPEATS" ]; do
  i=$((i + 1))
  flock "$LOCK" sh -c "cd '$WORK' && l=\$(uptime | sed 's/.*load average: //') &&
    eps=\$('$CONTRAX' train --recipe-variant peer --max-steps $STEPS --data '$DATA' --run-dir run$i --no-eval --no-verify --no-plot --json 2>/dev/null |
      '$PY' -c 'import json,sys; print(\"%.1f\" % json.load(sys.stdin)[\"examples_per_s\"])') &&
    echo \"contrax round $i load \$l examples_per_s \$eps\""
  flock "$LOCK" sh -c "cd '$WORK' && l=\$(uptime | sed 's/.*load average: //') &&
    eps=\$(GLIBC_TUNABLES=glibc.malloc.trim_threshold=131072 '$CONTRAX' train --recipe-variant peer --max-steps $STEPS --data '$DATA' --run-dir trim$i --no-eval --no-verify --no-plot --json 2>/dev/null |
      '$PY' -c 'import json,sys; print(\"%.1f\" % json.load(sys.stdin)[\"examples_per_s\"])') &&
    echo \"contrax-glibc-default-trim round $i load \$l examples_per_s \$eps\""
  flock "$LOCK" sh -c "cd '$WORK' && l=\$(uptime | sed 's/.*load average: //') &&
    eps=\$(CONTRAX_FUSED_ENCODER=0 '$CONTRAX' train --recipe-variant peer --max-steps $STEPS --data '$DATA' --run-dir unfused$i --no-eval --no-verify --no-plot --json 2>/dev/null |
      '$PY' -c 'import json,sys; print(\"%.1f\" % json.load(sys.stdin)[\"examples_per_s\"])') &&
    echo \"contrax-unfused-encoder round $i load \$l examples_per_s \$eps\""
  flock "$LOCK" sh -c "cd '$WORK' && l=\$(uptime | sed 's/.*load average: //') &&
    eps=\$('$PY' -m torch.distributed.run --nproc_per_node 2 '$PEER' --data '$DATA' --max-steps $STEPS --no-eval --json 2>/dev/null |
      grep '^{' | '$PY' -c 'import json,sys; print(\"%.1f\" % json.loads(sys.stdin.readline())[\"examples_per_s\"])') &&
    echo \"pytorch-ddp round $i load \$l examples_per_s \$eps\""
done
