"""Plan every bundled trace (traces/*.trace.parquet) at a budget and print a Markdown table:
baseline peak, budget, predicted peak, predicted overhead, swaps and recomputations. A budget the
policy cannot meet is reported with the smallest budget it meets (what `capuchin plan` says
when it exits with status 2), and that budget is planned too.

    python benchmarks/plan_examples.py                       # --budget 50%, policy capuchin
    python benchmarks/plan_examples.py --budget 70% --policies capuchin,swap,recompute
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from capuchin.errors import InfeasibleBudgetError
from capuchin.planner.api import load_problem, make_plan
from capuchin.planner.budget import format_bytes

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", default="50%")
    ap.add_argument("--policies", default="capuchin")
    args = ap.parse_args()
    print(
        "| trace | policy | baseline peak | budget | predicted peak | predicted overhead "
        "| swaps | recomputations | solve (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for path in sorted((ROOT / "traces").glob("*.trace.parquet")):
        problem = load_problem(path)
        for policy in args.policies.split(","):
            budget = args.budget
            while True:
                t = time.perf_counter()
                try:
                    plan = make_plan(problem, budget, policy)
                except InfeasibleBudgetError as err:
                    print(
                        f"| {path.name} | {policy} | {format_bytes(problem.peak_bytes)} | "
                        f"{budget} | infeasible: smallest feasible "
                        f"{format_bytes(err.smallest_feasible_bytes)} "
                        f"({100 * err.smallest_feasible_bytes / problem.peak_bytes:.1f}%) "
                        f"| | | | {time.perf_counter() - t:.2f} |"
                    )
                    budget = err.smallest_feasible_bytes
                    continue
                s = plan.summary()
                label = budget if isinstance(budget, str) else format_bytes(budget)
                print(
                    f"| {path.name} | {policy} | {format_bytes(s['baseline_peak_bytes'])} | "
                    f"{label} ({format_bytes(s['budget_bytes'])}) | "
                    f"{format_bytes(s['predicted_peak_bytes'])} | "
                    f"{100 * s['predicted_overhead']:.2f}% | {s['swap_count']} | "
                    f"{s['recompute_count']} | {time.perf_counter() - t:.2f} |"
                )
                break


if __name__ == "__main__":
    main()
