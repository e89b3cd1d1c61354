#!/usr/bin/env bash
# The test command of the README: set up, then run the whole suite (CPU; `gpu` tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One intra-op thread, as the benchmarks use: op timings steer dynamic mode's choices.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Two workers (pytest-xdist): the project's machines have two cores. Each test stands alone, so
# the split changes no result; `-n 0` runs in one process.
python3 -m pytest -q -n "${CAPUCHIN_TEST_WORKERS:-2}" "$@"
