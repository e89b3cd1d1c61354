#!/usr/bin/env bash
# Everything a GPU machine should check, in one command, with one Markdown report:
#
#   bash scripts/gpu-check.sh OUTDIR             # on a machine with CUDA (about 10-20 minutes)
#   bash scripts/gpu-check.sh --dry-run OUTDIR   # the same plumbing on CPU, small sizes; exits 0
#
# Runs from the source tree (PYTHONPATH to a link named capuchin; nothing is installed, no network):
# needs python3 with torch, pandas, pyarrow, networkx, click, pytest (not ortools). Steps:
#   1. environment: versions, the device's name;
#   2. the `gpu`-marked tests;
#   3. the main job on the device: trace -> plan 80%/50% -> run, per bundled example (--device),
#      and dynamic mode (run --budget --device), with per-iteration report lines and, on CUDA,
#      the allocator's counters after each run;
#   4. benchmarks/runtime.py, benchmarks/runtime_profile.py (where a managed step's host time
#      goes: timers, then cProfile), scripts/gpu_host_probe.py (each CUDA call's host time) and
#      benchmarks/dynamic.py on the device;
#   5. bitwise: plain vs plain, plan, dynamic mode (scripts/gpu_bitwise.py), deterministic kernels.
# Each step's output is OUTDIR/<step>.log; OUTDIR/gpu-check.md has the device, each step's exit
# status and the tail of its log. Exit status: the number of failed steps (0: all passed).
#
# A lent GPU machine has a fixed allowance of time, so two knobs keep a run inside it:
#   GPU_CHECK_SECONDS=N   every step runs under `timeout` with what is left of N seconds; a step
#                         with under 15 s left is not started (exit 124 in the report: not run);
#   GPU_CHECK_STEPS="a b" only the named steps (environment always runs);
#   GPU_CHECK_EXAMPLES="mlp" the bundled examples of the main job and the benchmarks.
set -uo pipefail

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
if [ $# -ne 1 ]; then
  echo "usage: bash scripts/gpu-check.sh [--dry-run] OUTDIR" >&2
  exit 2
fi
OUT="$1"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"

# import capuchin from this checkout (the repository root is the package)
mkdir -p "$OUT/.pythonpath"
ln -sfn "$ROOT" "$OUT/.pythonpath/capuchin"
export PYTHONPATH="$OUT/.pythonpath${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Note [Determinism precondition] (runtime/device.py): deterministic cuBLAS for bitwise checks
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
cd "$ROOT" || exit 2

if [ "$DRY" = 1 ]; then
  DEV=cpu; STEPS=3; TRACE_STEPS=4; EXAMPLES="mlp"; PCTS="80"; BENCH_ARGS="--steps 3 --repeats 1"; PROFILED=mlp
  DYN_ARGS="--steps 3 --repeats 1 --percents 80"
else
  DEV=cuda; STEPS=6; TRACE_STEPS=20; EXAMPLES="${GPU_CHECK_EXAMPLES:-mlp cnn transformer}"; PCTS="80 50"; BENCH_ARGS="--steps 6 --repeats 2"
  PROFILED=transformer
  DYN_ARGS="--steps 5 --repeats 2 --percents 80,60,50"
fi
EX_COMMA="$(echo $EXAMPLES | tr ' ' ',')"
REPORT="$OUT/gpu-check.md"
FAILED=0
STEPS_DONE=()

LIMIT="${GPU_CHECK_SECONDS:-0}"
ONLY="${GPU_CHECK_STEPS:-}"

step() {  # step NAME COMMAND...: run, log, record
  local name="$1"; shift
  local log="$OUT/$name.log"
  if [ -n "$ONLY" ] && [ "$name" != environment ] && [[ " $ONLY " != *" $name "* ]]; then
    return 0
  fi
  echo "== $name" >&2
  local t0=$SECONDS
  local rc
  if [ "$LIMIT" -gt 0 ]; then
    local left=$((LIMIT - SECONDS))
    if [ "$left" -lt 15 ]; then
      echo "not run: ${left} s left of GPU_CHECK_SECONDS=$LIMIT" >"$log"
      rc=124
    else
      # a new process group per step, so that timeout ends the step's children too
      timeout -k 5 "$left" bash -c '"$@"' step "$@" >"$log" 2>&1
      rc=$?
      [ $rc -eq 124 ] && echo "stopped: GPU_CHECK_SECONDS=$LIMIT ran out" >>"$log"
    fi
  else
    ( "$@" ) >"$log" 2>&1
    rc=$?
  fi
  local dt=$((SECONDS - t0))
  if [ $rc -ne 0 ]; then FAILED=$((FAILED + 1)); fi
  STEPS_DONE+=("$name|$rc|$dt")
  echo "   exit $rc, ${dt} s ($log)" >&2
  return 0
}

env_check() {
  "$PY" - "$DEV" <<'EOF'
import sys
import click, networkx, pandas, pyarrow, pytest, torch
dev = sys.argv[1]
print(f"python {sys.version.split()[0]}; torch {torch.__version__} (cuda {torch.version.cuda}); "
      f"pandas {pandas.__version__}; pyarrow {pyarrow.__version__}; networkx {networkx.__version__}; "
      f"click {click.__version__}; pytest {pytest.__version__}")
try:
    import ortools  # noqa: F401
    print("ortools: present")
except ImportError:
    print("ortools: absent (the ilp policy is unavailable; nothing here needs it)")
if dev == "cuda":
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --dry-run on a CPU host")
    p = torch.cuda.get_device_properties(0)
    print(f"device: {torch.cuda.get_device_name(0)}, {p.total_memory / 2**30:.1f} GiB, "
          f"sm{p.major}{p.minor}, {torch.cuda.device_count()} visible")
else:
    import platform
    print(f"device: cpu ({platform.processor() or platform.machine()}), dry run")
import capuchin
print(f"capuchin {capuchin.__version__} from {capuchin.__file__}")
EOF
}

gpu_tests() {
  "$PY" -m pytest -p no:cacheprovider -q -rA -m gpu \
    tests/test_runtime.py tests/test_trace_cuda.py tests/test_trace_budget.py tests/test_cuda_races.py
  local rc=$?
  [ $rc -eq 5 ] && return 0  # nothing collected (no gpu test selected) is not a failure
  return $rc
}

summary_of() {  # a report's per-iteration lines
  "$PY" - "$1" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
b = r["budget_bytes"]
print(f"  device {r.get('device')}, budget {b} B")
for it in r["iterations"]:
    peak = it["peak_bytes"] or 0
    print(f"  it {it['iteration']}: peak {peak} ({peak / b:.3f} x budget) evictions "
          f"{it['evictions']}+{it['passive_evictions']} late {it['late_prefetches']} "
          f"stall {it['stall_s'] * 1e3:.1f} ms short {it['passive_short_bytes']} "
          f"diverged {it['diverged']} time {it['time_s'] * 1e3:.1f} ms")
EOF
}

cli() {  # the capuchin command in-process, then the CUDA allocator's counters: per run, the
  # retries and full syncs that swap-outs freed in host time cost (docs/runtime.md, On CUDA)
  "$PY" - "$@" <<'EOF'
import runpy
import sys

import torch

sys.argv = ["capuchin", *sys.argv[1:]]
rc = 0
try:
    runpy.run_module("capuchin", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
if torch.cuda.is_available() and torch.cuda.is_initialized():
    s = torch.cuda.memory_stats()
    keys = ("num_ooms", "num_alloc_retries", "num_sync_all_streams", "num_device_alloc")
    print("  allocator: " + ", ".join(f"{k} {s.get(k, 'n/a')}" for k in keys)
          + f", reserved peak {s.get('reserved_bytes.all.peak', 0)} B", flush=True)
sys.exit(rc)
EOF
}

main_job() {
  local rc=0 n pct
  for n in $EXAMPLES; do
    echo "---- $n: trace on $DEV"
    # 20 steps: 1 warm-up, 2 recorded, then the plain step and the runtime probe's rounds
    # (Note [Plain step] in tracer/record.py), whose per-op figures a CUDA plan charges
    "$PY" -m capuchin trace --device "$DEV" --force --iterations 2 --warmup 1 \
      -o "$OUT/$n.trace.parquet" "traces/$n.py" --steps "$TRACE_STEPS" --device "$DEV" \
      || { rc=1; continue; }
    "$PY" -m capuchin show "$OUT/$n.trace.parquet" | head -12
    for pct in $PCTS; do
      echo "---- $n: plan at $pct%, run"
      "$PY" -m capuchin plan "$OUT/$n.trace.parquet" --budget "$pct%" --force \
        -o "$OUT/$n.$pct.plan.json" || { rc=1; continue; }
      cli run --plan "$OUT/$n.$pct.plan.json" --report "$OUT/$n.$pct.report.json" \
        --force "traces/$n.py" --steps "$STEPS" --device "$DEV" || { rc=1; continue; }
      summary_of "$OUT/$n.$pct.report.json" || rc=1
    done
    local budget
    budget=$("$PY" -c "import sys; from capuchin.planner.problem import Problem; from capuchin.tracer.reader import load_trace; print(Problem.from_trace(load_trace(sys.argv[1])).peak_bytes * 6 // 10)" "$OUT/$n.trace.parquet") || { rc=1; continue; }
    echo "---- $n: dynamic mode at 60% ($budget B)"
    cli run --budget "$budget" --device "$DEV" --report "$OUT/$n.dynamic.report.json" \
      --force "traces/$n.py" --steps "$STEPS" --device "$DEV" || { rc=1; continue; }
    summary_of "$OUT/$n.dynamic.report.json" || rc=1
  done
  return $rc
}

bitwise() {
  local rc=0 n
  for n in $EXAMPLES; do
    [ -f "$OUT/$n.trace.parquet" ] || { echo "$n: no trace (main job failed)"; rc=1; continue; }
    "$PY" scripts/gpu_bitwise.py --device "$DEV" --example "$n" --trace "$OUT/$n.trace.parquet" \
      --steps 4 || rc=1
  done
  return $rc
}

# the step functions run in a child bash under timeout: they and what they read go to its environment
export PY DEV OUT STEPS TRACE_STEPS EXAMPLES PCTS
export -f env_check gpu_tests summary_of cli main_job bitwise

step environment env_check
step gpu-tests gpu_tests
step main-job main_job
step bitwise bitwise
# shellcheck disable=SC2086
step benchmark-runtime "$PY" benchmarks/runtime.py --device "$DEV" --examples "$EX_COMMA" $BENCH_ARGS
# where a managed step's host time goes (the CUDA backend's functions timed too)
step profile "$PY" benchmarks/runtime_profile.py "$PROFILED" --budget 50% --device "$DEV"
# the same run under cProfile (every thread on Python 3.12+): where inside those functions
step cprofile "$PY" benchmarks/runtime_profile.py "$PROFILED" --budget 50% --device "$DEV" \
  --cprofile 40
# the host time of each CUDA call the runtime makes per op and per swap
[ "$DRY" = 1 ] || step host-probe "$PY" scripts/gpu_host_probe.py
# shellcheck disable=SC2086
step benchmark-dynamic "$PY" benchmarks/dynamic.py --device "$DEV" --workloads "$EX_COMMA" $DYN_ARGS

{
  echo "# capuchin GPU check"
  echo
  if [ "$DRY" = 1 ]; then
    echo "**Dry run on CPU** (the plumbing only, small sizes; no GPU figure here)."
  fi
  echo
  grep -E "^device:" "$OUT/environment.log" | head -1 | sed 's/^/- /'
  grep -E "^python " "$OUT/environment.log" | head -1 | sed 's/^/- /'
  echo "- commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)," \
    "CUBLAS_WORKSPACE_CONFIG=$CUBLAS_WORKSPACE_CONFIG," \
    "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-}"
  echo "- command: bash scripts/gpu-check.sh $([ "$DRY" = 1 ] && echo '--dry-run ')$OUT"
  echo
  echo "| step | exit | seconds | log |"
  echo "|---|---|---|---|"
  for s in "${STEPS_DONE[@]}"; do
    IFS='|' read -r name rc dt <<<"$s"
    echo "| $name | $rc | $dt | $name.log |"
  done
  for s in "${STEPS_DONE[@]}"; do
    IFS='|' read -r name rc dt <<<"$s"
    echo
    echo "## $name (exit $rc)"
    echo
    echo '```'
    grep -v '^USDT' "$OUT/$name.log" | tail -40
    echo '```'
  done
} >"$REPORT"
echo "wrote $REPORT ($FAILED failed step(s))" >&2
exit "$FAILED"
