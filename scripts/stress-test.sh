#!/usr/bin/env bash
# Runs the test suite under an artificial load: two CPU-burning processes beside pytest, the
# suite repeated RUNS times (default 3), each run's time and result printed. The suite must pass
# on a busy machine; this is how that is checked.
#   bash scripts/stress-test.sh            # the fast tier (-m "not slow"), 3 times
#   bash scripts/stress-test.sh --full     # the whole suite, 3 times
#   RUNS=1 bash scripts/stress-test.sh -- tests/test_runtime.py   # extra pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
marker=(-m "not slow")
if [[ "${1:-}" == "--full" ]]; then
    marker=()
    shift
fi
[[ "${1:-}" == "--" ]] && shift
runs="${RUNS:-3}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

burners=()
stop() { for p in "${burners[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap stop EXIT
for _ in 1 2; do
    (while :; do :; done) &
    burners+=("$!")
done

failed=0
for i in $(seq 1 "$runs"); do
    start=$(date +%s)
    if python3 -m pytest -q -p no:cacheprovider -n "${CAPUCHIN_TEST_WORKERS:-2}" "${marker[@]}" "$@" >"/tmp/capuchin-stress-$i.log" 2>&1; then
        status=passed
    else
        status=FAILED
        failed=1
    fi
    end=$(date +%s)
    echo "run $i/$runs: $status in $((end - start)) s, load $(cut -d' ' -f1-3 /proc/loadavg): $(tail -n 1 "/tmp/capuchin-stress-$i.log")"
done
exit "$failed"
