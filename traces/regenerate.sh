#!/usr/bin/env bash
# Re-records the bundled traces from the example scripts (CPU). Usage: bash traces/regenerate.sh
# Each trace: 1 warm-up iteration, then 3 recorded ones; the script is stopped after them.
set -euo pipefail
cd "$(dirname "$0")"
for name in cnn transformer mlp; do
  capuchin trace --force --device cpu --iterations 3 --warmup 1 -o "$name.trace.parquet" "$name.py" --steps 6
done
