"""One policy's predicted overhead per trace and budget, and its smallest feasible budget.

    python benchmarks/capuchin_cells.py traces/*.trace.parquet D...     # capuchin, 80/60/50/40%
    python benchmarks/capuchin_cells.py --policy capuchin-ls --fractions 0.6,0.5 --no-search T

For each trace: ``compare.evaluate`` at each fraction of the baseline peak (the simulator's
predicted overhead, % of the baseline iteration, and the plan's extra time in ms) and, unless
``--no-search``, ``compare.smallest_feasible_budget`` (bisection at 1% of the peak). One table,
a row per trace; ``--json`` writes the figures. Traces are files (``capuchin import-dtr`` for the
DTR logs). A short companion of plan_quality.py for a policy change: run it on the code before
and after, and compare the tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def cells(path: str, policy: str, fractions: list[float], search: bool) -> dict:
    from capuchin.planner.compare import evaluate, smallest_feasible_budget
    from capuchin.planner.problem import Problem
    from capuchin.tracer.reader import load_trace

    t0 = time.process_time()
    problem = Problem.from_trace(load_trace(path))
    row: dict = {"trace": Path(path).name.removesuffix(".trace.parquet"), "cells": {}}
    recs = []
    for f in fractions:
        rec, _plan = evaluate(problem, policy, int(problem.peak_bytes * f))
        recs.append(rec)
        extra_ms = rec.predicted_overhead * problem.time_ns / 1e6 if rec.feasible else None
        row["cells"][f] = {
            "feasible": rec.feasible,
            "overhead_pct": round(100 * rec.predicted_overhead, 2),
            "extra_ms": None if extra_ms is None else round(extra_ms, 2),
        }
    if search:
        got = smallest_feasible_budget(problem, policy, known=recs)
        row["smallest_frac"] = round(got / problem.peak_bytes, 3)
    row["cpu_s"] = round(time.process_time() - t0, 1)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--policy", default="capuchin")
    ap.add_argument("--fractions", default="0.8,0.6,0.5,0.4")
    ap.add_argument("--no-search", action="store_true", help="skip the smallest feasible budget")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    fractions = [float(x) for x in args.fractions.split(",")]
    rows = []
    head = " | ".join(f"{f:.0%}" for f in fractions)
    print(f"| trace | {head} | smallest feasible | CPU s |")
    print("|---" * (len(fractions) + 3) + "|")
    for path in args.traces:
        row = cells(path, args.policy, fractions, not args.no_search)
        rows.append(row)
        shown = []
        for f in fractions:
            c = row["cells"][f]
            ok = c["feasible"]
            shown.append(f"{c['overhead_pct']:+.2f}% ({c['extra_ms']} ms)" if ok else "over")
        small = f"{row['smallest_frac']:.1%}" if "smallest_frac" in row else ""
        print(f"| {row['trace']} | {' | '.join(shown)} | {small} | {row['cpu_s']} |", flush=True)
    print(
        f"(policy {args.policy}; the simulator's predicted overhead, % of the baseline iteration)"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
