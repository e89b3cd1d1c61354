#!/usr/bin/env bash
# Re-records the bundled traces from the example scripts (CPU). Usage: bash traces/regenerate.sh
# Each trace: 1 warm-up iteration, then 3 recorded ones; the script is stopped after them. One
# intra-op thread, on a quiet machine: the op times are what plans are predicted from.
set -euo pipefail
cd "$(dirname "$0")"
for name in cnn transformer mlp; do
  OMP_NUM_THREADS=1 capuchin trace --force --device cpu --iterations 3 --warmup 1 -o "$name.trace.parquet" "$name.py" --steps 6
done
