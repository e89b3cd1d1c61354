"""Capuchin's distance from the optimum: a proven lower bound (planner/bound.py) on every
fitting plan's extra time, against the capuchin plan, per trace and budget. Prints a table.

    python benchmarks/lower_bound.py                      # DTR's U-Net and ResNet-32, 80/60/40%
    python benchmarks/lower_bound.py --traces t.parquet --fractions 0.6 --time-limit 60
    python benchmarks/lower_bound.py --lp-only --cuts replay_memory,kept_resident  # LP alone

gap = (capuchin's extra - bound) / capuchin's extra: capuchin is at most that fraction of its own
extra time above the optimum (0: proven optimal). found: the best plan ``search_plans`` found from
capuchin's (``--search-steps`` simulated plans, seed 0): the optimum is at most that, so capuchin
is at least (capuchin - found) / capuchin above it ("capuchin above found"), and the bound at most
(found - bound) / found below it ("bound below found"). ``ls_ms`` and ``ls_gap``: the
``capuchin-ls`` plan's extra time and its gap to the bound. Extra times are the simulator's (ns
above the baseline iteration); "% iter" is capuchin's as a fraction of the baseline iteration.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from capuchin.tracer.dtr_import import dtr_logs_path

DTR_ZIP = dtr_logs_path()  # ../shared/data/dtr-logs.zip, or $CAPUCHIN_DTR_LOGS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--traces",
        nargs="*",
        type=Path,
        help="trace files (default: DTR U-Net, ResNet-32 from --dtr-zip)",
    )
    ap.add_argument("--dtr-zip", type=Path, default=DTR_ZIP)
    ap.add_argument("--fractions", default="0.8,0.6,0.4")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds per bound")
    ap.add_argument("--search-steps", type=int, default=30_000, help="plans search_plans tries")
    ap.add_argument(
        "--lp-only",
        action="store_true",
        help="only the LP bound per cell (no capuchin plan, search or CP-SAT)",
    )
    ap.add_argument(
        "--cuts",
        default="",
        help="cut families added to bound.CUTS, comma-separated (e.g. replay_memory)",
    )
    args = ap.parse_args(argv)

    from capuchin.planner.bound import CUTS, lower_bound
    from capuchin.planner.improve import search_plans
    from capuchin.planner.problem import Problem
    from capuchin.planner.registry import get_policy
    from capuchin.planner.simulator import simulate
    from capuchin.tracer.dtr_import import import_dtr_log
    from capuchin.tracer.reader import load_trace

    fracs = [float(f) for f in args.fractions.split(",")]
    cuts = (*CUTS, *(c for c in args.cuts.split(",") if c))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = list(args.traces or [])
        if not paths:
            for m in ("unet", "resnet32"):
                paths.append(
                    import_dtr_log(f"{args.dtr_zip}/{m}", Path(tmp) / f"dtr-{m}.trace.parquet")
                )
        for path in paths:
            problem = Problem.from_trace(load_trace(path))
            name = Path(path).name.replace(".trace.parquet", "")
            for f in fracs:
                budget = int(problem.peak_bytes * f)
                if args.lp_only:
                    rows.append(_lp_row(problem, budget, name, f, cuts, lower_bound))
                    print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
                    continue
                c = time.process_time()
                ds = get_policy("capuchin")(problem, budget).decisions
                cap_cpu = time.process_time() - c
                sim = simulate(problem, ds)
                extra = sim.time_ns - problem.time_ns if sim.peak_bytes <= budget else None
                ls_sim = simulate(problem, get_policy("capuchin-ls")(problem, budget).decisions)
                ls = ls_sim.time_ns - problem.time_ns if ls_sim.peak_bytes <= budget else None
                t = time.perf_counter()
                c = time.process_time()
                b = lower_bound(problem, budget, time_limit_s=args.time_limit, cuts=cuts)
                bound_wall, bound_cpu = time.perf_counter() - t, time.process_time() - c
                c = time.process_time()
                found = search_plans(problem, budget, ds, steps=args.search_steps).extra_ns
                search_cpu = time.process_time() - c
                rows.append(
                    dict(
                        trace=name,
                        budget=f"{f:.0%}",
                        capuchin_ms=_ms(extra),
                        capuchin_pct=f"{100 * extra / problem.time_ns:.2f}"
                        if extra is not None
                        else "over",
                        found_ms=_ms(found),
                        bound_ms=_ms(b.bound_ns),
                        lp_ms=_ms(b.lp_ns),
                        cpsat_ms=_ms(b.cpsat_ns),
                        gap=(
                            f"{b.gap(extra):.1%}"
                            if extra is not None and b.gap(extra) is not None
                            else "-"
                        ),
                        cap_above_found=_frac(extra, found, extra),
                        ls_ms=_ms(ls),
                        ls_gap=(
                            f"{b.gap(ls):.1%}" if ls is not None and b.gap(ls) is not None else "-"
                        ),
                        bound_below_found=_frac(found, b.bound_ns, found),
                        cpsat=b.cpsat_status,
                        cands=b.candidates,
                        vars=b.variables,
                        bound_wall_s=f"{bound_wall:.0f}",
                        bound_cpu_s=f"{bound_cpu:.0f}",
                        capuchin_cpu_s=f"{cap_cpu:.1f}",
                        search_cpu_s=f"{search_cpu:.0f}",
                    )
                )
                print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    cols = list(rows[0]) if rows else []
    print()
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    print(f"(load average {os.getloadavg()[0]:.1f}; python {sys.version.split()[0]})")
    return 0


def _lp_row(problem, budget, name, f, cuts, lower_bound) -> dict:
    """``--lp-only``: the LP bound of one cell (to 0.1 us), its model's size and solve time."""
    t = time.perf_counter()
    b = lower_bound(problem, budget, cpsat=False, cuts=cuts)
    return dict(
        trace=name,
        budget=f"{f:.0%}",
        lp_ms="-" if b.lp_ns is None else f"{b.lp_ns / 1e6:.4f}",
        cuts="+".join(cuts),
        vars=b.variables,
        constraints=b.constraints,
        lp_s=f"{b.lp_s:.1f}",
        wall_s=f"{time.perf_counter() - t:.1f}",
    )


def _frac(a, b, of) -> str:
    """(a - b) / of as a percentage; "-" where undefined, "0%" where ``of`` is 0."""
    if a is None or b is None or of is None or math.isinf(b):
        return "-"
    if of <= 0:
        return "0%"
    return f"{max(0.0, (a - b) / of):.1%}"


def _ms(ns) -> str:
    if ns is None:
        return "-"
    if isinstance(ns, float) and math.isinf(ns):
        return "inf"
    return f"{ns / 1e6:.2f}"


if __name__ == "__main__":
    sys.exit(main())
