"""Planner speed: time per stage on a generated 24-layer transformer trace (~100k ops) and on the
bundled example traces. Prints a table; ``--csv FILE`` also writes it.

    python benchmarks/planner_speed.py                     # 24 layers x ~2000 ops/layer
    python benchmarks/planner_speed.py --ops-per-layer 200 # a smaller one
    python benchmarks/planner_speed.py --examples-only

Stages: generate (synthetic event table), write+load (Parquet round trip), problem
(``Problem.from_trace``), policy (the Capuchin policy's decisions), build (lineage, simulation,
action table), json (serialization). Targets (issue 3): under 30 s for 100k ops, under 2 s for the
bundled examples.
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
import time
from pathlib import Path

from capuchin.planner.budget import parse_budget
from capuchin.planner.build import build_plan
from capuchin.planner.problem import Problem
from capuchin.planner.registry import get_policy
from capuchin.planner.synthetic import trace_from_ops, transformer_ops
from capuchin.tracer.reader import load_trace, write_trace

ROOT = Path(__file__).resolve().parent.parent


def plan_stages(trace, budget: str, policy: str) -> dict:
    row = {}
    cpu = time.process_time()
    t = time.perf_counter()
    problem = Problem.from_trace(trace)
    row["problem_s"] = time.perf_counter() - t
    budget_bytes = parse_budget(budget, problem.peak_bytes)
    t = time.perf_counter()
    decisions = get_policy(policy)(problem, budget_bytes)
    row["policy_s"] = time.perf_counter() - t
    t = time.perf_counter()
    plan, sim = build_plan(problem, decisions, policy=policy, budget_bytes=budget_bytes)
    row["build_s"] = time.perf_counter() - t
    t = time.perf_counter()
    plan.to_json()
    row["json_s"] = time.perf_counter() - t
    row.update(ops=problem.n_ops, decisions=len(plan.records),
               fits=plan.predictions.feasible,
               overhead_pct=100 * plan.predictions.predicted_overhead)
    row["plan_total_s"] = row["problem_s"] + row["policy_s"] + row["build_s"] + row["json_s"]
    row["plan_cpu_s"] = time.process_time() - cpu  # the machine may be shared: CPU time too
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--ops-per-layer", type=int, default=2000,
                    help="forward ops per layer (the iteration has about twice as many)")
    ap.add_argument("--budget", default="50%", help="budget for the generated trace")
    ap.add_argument("--example-budget", default="90%",
                    help="budget for the bundled traces (50%% is below what two of them allow)")
    ap.add_argument("--policy", default="capuchin")
    ap.add_argument("--examples-only", action="store_true")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()

    rows = []
    for path in sorted((ROOT / "traces").glob("*.trace.parquet")):
        t = time.perf_counter()
        trace = load_trace(path)
        row = {"trace": path.name, "generate_s": 0.0, "io_s": time.perf_counter() - t}
        row["budget"] = args.example_budget
        row.update(plan_stages(trace, args.example_budget, args.policy))
        rows.append(row)
    if not args.examples_only:
        t = time.perf_counter()
        ops, sizes, persistent = transformer_ops(args.layers, args.ops_per_layer,
                                                 hidden_bytes=1 << 16)
        trace = trace_from_ops(ops, sizes, persistent=persistent, bandwidth_bytes_per_s=12e9)
        gen = time.perf_counter() - t
        with tempfile.TemporaryDirectory() as d:
            t = time.perf_counter()
            p = write_trace(trace.events, trace.meta, Path(d) / "big.trace.parquet")
            trace = load_trace(p)
            io = time.perf_counter() - t
        row = {"trace": f"synthetic transformer {args.layers}x{args.ops_per_layer}",
               "generate_s": gen, "io_s": io, "budget": args.budget}
        row.update(plan_stages(trace, args.budget, args.policy))
        rows.append(row)

    cols = ["trace", "ops", "budget", "generate_s", "io_s", "problem_s", "policy_s", "build_s",
            "json_s", "plan_total_s", "plan_cpu_s", "decisions", "fits", "overhead_pct"]
    w = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    print("  ".join(c.ljust(n) for c, n in zip(cols, w, strict=True)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(n) for c, n in zip(cols, w, strict=True)))
    print(f"(policy {args.policy}; wall-clock seconds; plan_total_s = problem + policy + build "
          f"+ json, plan_cpu_s its process CPU time; "
          f"python {sys.version.split()[0]})")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
            wr.writeheader()
            wr.writerows(rows)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    return "" if v is None else str(v)


if __name__ == "__main__":
    main()
