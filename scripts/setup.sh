#!/usr/bin/env bash
# Installs capuchin and everything it needs on a fresh machine (CPU PyTorch first: it is a local wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet "torch==2.13.0"
python3 -m pip install --quiet -e ".[test]"
