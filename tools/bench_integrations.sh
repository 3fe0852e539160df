#!/bin/sh
# Contrax's drop-ins against open_clip's and sentence-transformers' own
# losses (python/bench/bench_integrations.py): time and peak memory,
# same run, W Gloo processes on the CPU. Results: docs/benchmarks.md.
#   sh tools/bench_integrations.sh [WORLD] [REPEATS] [OUT.json]
set -eu
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$HERE/.venv/bin/python}
echo "load before: $(uptime | sed 's/.*load average: //')"
PYTHONPATH="$HERE/build/python${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$HERE/python/bench/bench_integrations.py" \
  --world "${1:-2}" --repeats "${2:-7}" ${3:+--out "$3"}
echo "load after: $(uptime | sed 's/.*load average: //')"
