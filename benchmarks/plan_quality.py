"""Plan quality of every policy on the bundled traces and the eight DTR GPU traces.

For each trace, at 80%, 60% and 40% of its baseline peak: every registered policy's predicted
overhead (the one simulator, planner/simulator.py), and every policy's smallest feasible budget
(bisection, planner/compare.py). Prints a table per trace, a check of capuchin's aims, and writes
everything as CSV.

    python benchmarks/plan_quality.py                       # all traces (~27 min here), CSV in benchmarks/results/
    python benchmarks/plan_quality.py --traces traces/cnn.trace.parquet --no-dtr
    python benchmarks/plan_quality.py --ilp-time-limit 20 --ilp-max-ops 3000   # skip the ILP above

The aims: capuchin's overhead no worse than any heuristic at any budget; within 10% of
the ILP's wherever the ILP proves optimality (overheads as fractions of the baseline iteration:
capuchin <= 1.1 x ILP); a smallest feasible budget no larger than DTR's. The "aims" section lists
every place where capuchin falls short.

The ILP is given ``--ilp-time-limit`` seconds per solve (each call returns within about that:
planner/policies/ilp.py, Note [Sizing the model to the time limit]); ``--ilp-max-ops`` skips it
(the table says so) on traces with more ops (default: never skipped).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from capuchin.outputs import atomic_write
from capuchin.tracer.dtr_import import dtr_logs_path

ROOT = Path(__file__).resolve().parent.parent
DTR_ZIP = dtr_logs_path()
FRACTIONS = (0.8, 0.6, 0.4)
HEURISTICS = ("swap", "recompute", "dtr", "checkpoint-sqrt", "checkpoint-speed", "vdnn")


def _traces(args, tmp: Path) -> list[tuple[str, Path]]:
    from capuchin.tracer.dtr_import import import_dtr_log, list_dtr_logs

    out = []
    paths = args.traces if args.traces else sorted((ROOT / "traces").glob("*.trace.parquet"))
    for p in paths:
        out.append((Path(p).name.replace(".trace.parquet", ""), Path(p)))
    if not args.no_dtr:
        if not zipfile.is_zipfile(args.dtr_zip):
            print(f"note: {args.dtr_zip} not found; DTR traces skipped", file=sys.stderr)
        else:
            for member in list_dtr_logs(args.dtr_zip):
                name = "dtr-" + "-".join(Path(member).name.split("-")[:2])
                path = import_dtr_log(f"{args.dtr_zip}/{member}", tmp / f"{name}.trace.parquet")
                out.append((name, path))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", nargs="*", type=Path, help="trace files (default traces/*)")
    ap.add_argument("--no-dtr", action="store_true", help="leave out the eight DTR traces")
    ap.add_argument("--dtr-zip", type=Path, default=DTR_ZIP)
    ap.add_argument("--policies", default=None, help="comma-separated (default: all registered)")
    ap.add_argument("--ilp-time-limit", type=float, default=10.0, help="seconds per ILP solve")
    ap.add_argument(
        "--ilp-max-ops",
        type=int,
        default=None,
        help="skip the ILP on traces with more ops (default: never)",
    )
    ap.add_argument(
        "--tolerance",
        type=float,
        default=0.01,
        help="smallest-budget bisection step, fraction of the peak (default 0.01)",
    )
    ap.add_argument(
        "--no-search",
        action="store_true",
        help="skip the smallest-feasible-budget search (much faster)",
    )
    ap.add_argument(
        "--csv", type=Path, default=ROOT / "benchmarks" / "results" / "plan_quality.csv"
    )
    ap.add_argument(
        "--from-csv",
        nargs="+",
        type=Path,
        default=None,
        help="plan nothing: read the rows of earlier runs (e.g. one without and one with only "
        "the ILP), merge them (later files win per trace, policy and budget), write --csv and "
        "print the table and the aims",
    )
    args = ap.parse_args(argv)
    if args.from_csv:
        rows = merge_csv(args.from_csv)
        _write_csv(rows, args.csv)
        print(markdown_table(rows))
        print()
        print("\n".join(aims(rows)))
        print(f"\nwrote {args.csv} ({len(rows)} rows) from {len(args.from_csv)} file(s)")
        return 0

    from capuchin.planner.budget import format_bytes
    from capuchin.planner.compare import _default_order, evaluate, smallest_feasible_budget
    from capuchin.planner.problem import Problem
    from capuchin.planner.registry import available
    from capuchin.tracer.reader import load_trace

    policies = args.policies.split(",") if args.policies else _default_order(available())
    rows: list[dict] = []
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="plan_quality.") as tmp:
        for name, path in _traces(args, Path(tmp)):
            problem = Problem.from_trace(load_trace(path))
            peak, floor = problem.peak_bytes, problem.floor_bytes()
            print(
                f"\n== {name}: {problem.n_ops} ops, peak {format_bytes(peak)}, floor "
                f"{format_bytes(floor)} ({floor / peak:.0%}), iteration "
                f"{problem.time_ns / 1e6:.1f} ms",
                flush=True,
            )
            for policy in policies:
                params = {}
                skipped = ""
                if policy == "ilp":
                    params = {"time_limit_s": args.ilp_time_limit}
                    if args.ilp_max_ops is not None and problem.n_ops > args.ilp_max_ops:
                        skipped = f"skipped: {problem.n_ops} ops > --ilp-max-ops {args.ilp_max_ops}"
                t0 = time.perf_counter()
                recs = []
                if not skipped:
                    recs = [evaluate(problem, policy, int(peak * f), params)[0] for f in FRACTIONS]
                    smallest = (
                        None
                        if args.no_search
                        else smallest_feasible_budget(
                            problem, policy, params=params, tolerance=args.tolerance, known=recs
                        )
                    )
                for i, f in enumerate(FRACTIONS):
                    r = recs[i] if recs else None
                    rows.append(
                        {
                            "trace": name,
                            "ops": problem.n_ops,
                            "peak_bytes": peak,
                            "floor_bytes": floor,
                            "policy": policy,
                            "budget_frac": f,
                            "budget_bytes": int(peak * f),
                            "feasible": r.feasible if r else "",
                            "predicted_peak_bytes": r.predicted_peak_bytes if r else "",
                            "predicted_overhead": (
                                round(r.predicted_overhead, 5)
                                if r and not math.isnan(r.predicted_overhead)
                                else ""
                            ),
                            "solve_time_s": r.solve_time_s if r else "",
                            "status": (r.status or "") if r else "",
                            "optimality_gap": (
                                r.optimality_gap if r and r.optimality_gap is not None else ""
                            ),
                            "error": (r.error or "") if r else "",
                            "smallest_feasible_bytes": smallest if recs and smallest else "",
                            "smallest_feasible_frac": (
                                round(smallest / peak, 4) if recs and smallest else ""
                            ),
                            "note": skipped,
                        }
                    )
                cells = []
                for row in rows[-len(FRACTIONS) :]:
                    if row["note"]:
                        cells.append("-")
                    elif row["error"]:
                        cells.append("error")
                    else:
                        ovh = (
                            f"{row['predicted_overhead']:+.1%}"
                            if row["predicted_overhead"] != ""
                            else "?"
                        )
                        cells.append(ovh + ("" if row["feasible"] else " (over)"))
                last = rows[-1]
                small = (
                    f"{last['smallest_feasible_frac']:.0%}"
                    if last["smallest_feasible_frac"] != ""
                    else "-"
                )
                extra = last["note"] or last["status"]
                if not last["note"] and last["optimality_gap"] != "":
                    extra += f" gap {last['optimality_gap']:.0%}"
                print(
                    f"  {policy:<17}"
                    + "".join(f"{c:>16}" for c in cells)
                    + f"{small:>10}  {time.perf_counter() - t0:6.1f}s  {extra}",
                    flush=True,
                )
    _write_csv(rows, args.csv)
    print()
    print(markdown_table(rows))
    print()
    print("\n".join(aims(rows)))
    print(f"\nwrote {args.csv} ({len(rows)} rows) in {time.perf_counter() - t_all:.0f} s")
    return 0


def _write_csv(rows: list[dict], path: Path) -> None:
    with atomic_write(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["trace"])
        w.writeheader()
        w.writerows(rows)


_NUMERIC = {
    "ops": int,
    "peak_bytes": int,
    "floor_bytes": int,
    "budget_bytes": int,
    "budget_frac": float,
    "predicted_peak_bytes": int,
    "predicted_overhead": float,
    "solve_time_s": float,
    "optimality_gap": float,
    "smallest_feasible_bytes": int,
    "smallest_feasible_frac": float,
}


def merge_csv(paths: list[Path]) -> list[dict]:
    """Rows of earlier runs, typed as ``main`` makes them ("" stays "" where a value is
    missing); a later file's row replaces an earlier one for the same trace, policy, budget."""
    merged: dict[tuple, dict] = {}
    for path in paths:
        with open(path, newline="") as f:
            for raw in csv.DictReader(f):
                row = dict(raw)
                for k, typ in _NUMERIC.items():
                    if row.get(k, "") != "":
                        row[k] = typ(row[k])
                if row.get("feasible", "") != "":
                    row["feasible"] = row["feasible"] == "True"
                merged[row["trace"], row["policy"], row["budget_frac"]] = row
    from capuchin.planner.compare import _default_order
    from capuchin.planner.registry import available

    traces = list(dict.fromkeys(k[0] for k in merged))
    order = _default_order(available())
    rank = {p: i for i, p in enumerate(order)}
    return sorted(
        merged.values(),
        key=lambda r: (
            traces.index(r["trace"]),
            rank.get(r["policy"], len(order)),
            -r["budget_frac"],
        ),
    )


def markdown_table(rows: list[dict]) -> str:
    """One line per (trace, policy): overhead at 80/60/40% of peak and the smallest budget."""
    head = "| trace | policy | 80% | 60% | 40% | smallest feasible |\n|---|---|---:|---:|---:|---:|"
    lines = [head]
    by = {}
    for r in rows:
        by.setdefault((r["trace"], r["policy"]), []).append(r)
    for (trace, policy), rs in by.items():
        cells = []
        for r in sorted(rs, key=lambda r: -r["budget_frac"]):
            if r["note"]:
                cells.append("skipped")
            elif r["error"]:
                cells.append("error")
            elif r["predicted_overhead"] == "":
                cells.append("?")
            else:
                c = f"{r['predicted_overhead']:+.1%}"
                cells.append(c if r["feasible"] else f"~~{c}~~ over")
        s = rs[0]["smallest_feasible_frac"]
        smallest = f"{s:.0%}" if s != "" else "-"
        lines.append(f"| {trace} | {policy} | " + " | ".join(cells) + f" | {smallest} |")
    return "\n".join(lines)


def aims(rows: list[dict]) -> list[str]:
    """Where capuchin meets or misses each aim, one line per miss, and a count per aim."""
    out = ["aims (capuchin vs the others; a miss is listed):"]
    by = {(r["trace"], r["policy"], r["budget_frac"]): r for r in rows}
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    checked = {"heuristics": [0, 0], "ilp": [0, 0], "dtr-budget": [0, 0]}
    for t in traces:
        for f in FRACTIONS:
            cap = by.get((t, "capuchin", f))
            if cap is None or cap["note"]:
                continue
            for h in HEURISTICS:
                r = by.get((t, h, f))
                if r is None or r["note"] or r["error"] or not r["feasible"]:
                    continue
                checked["heuristics"][0] += 1
                if (
                    not cap["feasible"]
                    or cap["predicted_overhead"] > r["predicted_overhead"] + 1e-9
                ):
                    checked["heuristics"][1] += 1
                    what = f"{cap['predicted_overhead']:+.1%}" if cap["feasible"] else "infeasible"
                    out.append(
                        f"  MISS {t} @ {f:.0%}: capuchin {what} vs {h} "
                        f"{r['predicted_overhead']:+.1%}"
                    )
            ilp = by.get((t, "ilp", f))
            if ilp and not ilp["note"] and ilp["status"] == "OPTIMAL" and ilp["feasible"]:
                checked["ilp"][0] += 1
                if (
                    not cap["feasible"]
                    or cap["predicted_overhead"] > 1.1 * ilp["predicted_overhead"] + 1e-9
                ):
                    checked["ilp"][1] += 1
                    what = f"{cap['predicted_overhead']:+.1%}" if cap["feasible"] else "infeasible"
                    out.append(
                        f"  MISS {t} @ {f:.0%}: capuchin {what} vs optimal ILP "
                        f"{ilp['predicted_overhead']:+.1%} (> 1.1x)"
                    )
        cap, dtr = by.get((t, "capuchin", FRACTIONS[0])), by.get((t, "dtr", FRACTIONS[0]))
        if (
            cap
            and dtr
            and cap["smallest_feasible_bytes"] != ""
            and dtr["smallest_feasible_bytes"] != ""
        ):
            checked["dtr-budget"][0] += 1
            if cap["smallest_feasible_bytes"] > dtr["smallest_feasible_bytes"]:
                checked["dtr-budget"][1] += 1
                out.append(
                    f"  MISS {t}: capuchin's smallest feasible budget "
                    f"{cap['smallest_feasible_frac']:.0%} of peak > DTR's "
                    f"{dtr['smallest_feasible_frac']:.0%}"
                )
    out.append(
        f"  overhead <= every feasible heuristic: {checked['heuristics'][0] - checked['heuristics'][1]}"
        f"/{checked['heuristics'][0]} comparisons met"
    )
    out.append(
        f"  within 10% of the ILP where proven optimal: {checked['ilp'][0] - checked['ilp'][1]}"
        f"/{checked['ilp'][0]} met"
    )
    out.append(
        f"  smallest feasible budget <= DTR's: {checked['dtr-budget'][0] - checked['dtr-budget'][1]}"
        f"/{checked['dtr-budget'][0]} traces met"
    )
    return out


if __name__ == "__main__":
    sys.exit(main())
