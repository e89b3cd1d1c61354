#!/usr/bin/env bash
# The main job on a bundled example: set up, trace -> plan at 50% of the peak -> run under the plan,
# then print the baseline vs managed peak (PyTorch's allocator accounting) and time per iteration.
#   bash scripts/example.sh [transformer|cnn|mlp]   (default: transformer; outputs in ./out/example/)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
NAME="${1:-transformer}"
OUT="out/example"
mkdir -p "$OUT"
SCRIPT="traces/$NAME.py"
STEPS=5
# the trace: 1 warm-up + 2 recorded iterations, then 1 + 3 plain ones timed (Note [Plain step])
# One intra-op thread: on a small shared host, 2 OpenMP threads made the same iteration anywhere
# from 1x to 10x slower from run to run, which drowns the comparison (the swap copies run on their
# own thread either way).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

echo "== trace: $SCRIPT"
capuchin trace --force --device cpu --iterations 2 --warmup 1 -o "$OUT/$NAME.trace.parquet" "$SCRIPT" --steps 7

echo "== plan at 50% of the traced peak"
BUDGET=""
for pct in 50 60 70 80 90; do
  if capuchin plan "$OUT/$NAME.trace.parquet" --budget "$pct%" --force -o "$OUT/$NAME.plan.json"; then
    BUDGET="$pct%"; break
  fi
  echo "   (no plan fits $pct%; trying more)"
done
if [ -z "$BUDGET" ]; then
  echo "   no plan fits 90%; running an empty plan (the runtime still measures)"
  BUDGET="100%"
  capuchin plan "$OUT/$NAME.trace.parquet" --budget 100% --force -o "$OUT/$NAME.plan.json"
fi
capuchin plan "$OUT/$NAME.trace.parquet" --budget 100% --force -o "$OUT/$NAME.noop.json" >/dev/null

echo "== baseline: the same script under a plan that evicts nothing"
capuchin run --plan "$OUT/$NAME.noop.json" --report "$OUT/$NAME.baseline.json" --force "$SCRIPT" --steps $STEPS
echo "== managed: under the $BUDGET plan"
capuchin run --plan "$OUT/$NAME.plan.json" --report "$OUT/$NAME.managed.json" --force "$SCRIPT" --steps $STEPS

python3 - "$OUT/$NAME.baseline.json" "$OUT/$NAME.managed.json" "$BUDGET" <<'EOF'
import json, sys
base, man = (json.load(open(p)) for p in sys.argv[1:3])
def steady(r):
    its = [i for i in r["iterations"] if i["complete"]][1:]
    return max(i["peak_bytes"] or 0 for i in its), sum(i["time_s"] for i in its) / len(its)
bp, bt = steady(base)
mp, mt = steady(man)
mib = 2 ** 20
print(f"\n{'':10s} {'peak MiB':>10s} {'ms/iter':>10s}")
print(f"{'baseline':10s} {bp / mib:10.1f} {bt * 1e3:10.1f}")
print(f"{'capuchin':10s} {mp / mib:10.1f} {mt * 1e3:10.1f}   budget {man['budget_bytes'] / mib:.1f} MiB ({sys.argv[3]} of the traced peak)")
print(f"peak {mp / bp - 1:+.0%}, time {mt / bt - 1:+.0%}")
EOF
