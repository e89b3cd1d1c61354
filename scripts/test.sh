#!/usr/bin/env bash
# The test command of the README: set up, then run the whole suite (CPU; `gpu` tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One intra-op thread, as the benchmarks use: op timings steer dynamic mode's choices.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python3 -m pytest -q "$@"
