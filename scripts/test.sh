#!/usr/bin/env bash
# The test command of the README: set up, then run the whole suite (CPU; `gpu` tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m pytest -q "$@"
