"""Planner speed: cold ``capuchin plan`` CPU time per trace and budget, one process each.

    python benchmarks/planner_speed.py                         # bundled + DTR traces, 80/60/40%
    python benchmarks/planner_speed.py --traces a.parquet b.parquet --fractions 0.6
    python benchmarks/planner_speed.py --synthetic             # also the generated ~100k-op trace
    python benchmarks/planner_speed.py --no-dtr --llama 32,22 --fractions 80%,60%,45%

Every (trace, budget) cell runs in a fresh process (nothing cached: what a user waits for):
load the trace, build the problem, the policy's decisions, the plan (lineage, simulation,
action table) and its JSON. ``cpu_s`` is that process's CPU time for those stages (the machine
may be shared; CPU time is what the planner costs). The eight DTR traces are imported from
``--dtr-zip`` (tracer/dtr_import.py, as ``capuchin import-dtr``). ``--synthetic`` adds
tracer/synthetic.py's 24-layer transformer (~100k ops) at 50%. ``--llama`` adds
tests/frameworks/hf_llama_ckpt.py with that many decoder layers (default 32: thin layers, AdamW,
gradient checkpointing), traced once with one intra-op thread into ``benchmarks/.cache/``
(git-ignored; delete it to trace afresh) and reused; ``--llama ''`` leaves it out.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from capuchin.tracer.dtr_import import dtr_logs_path

ROOT = Path(__file__).resolve().parent.parent
DTR_ZIP = dtr_logs_path()  # ../shared/data/dtr-logs.zip, or $CAPUCHIN_DTR_LOGS
COLS = [
    "trace",
    "ops",
    "budget",
    "cpu_s",
    "policy_s",
    "build_s",
    "decisions",
    "fits",
    "overhead_pct",
]


def one(path: str, budget: str, policy: str) -> dict:
    """The stages for one trace and budget, in this process (cold)."""
    from capuchin.planner.budget import parse_budget
    from capuchin.planner.build import build_plan
    from capuchin.planner.problem import Problem
    from capuchin.planner.registry import get_policy
    from capuchin.tracer.reader import load_trace

    cpu = time.process_time()
    problem = Problem.from_trace(load_trace(path))
    budget_bytes = parse_budget(budget, problem.peak_bytes)
    t = time.process_time()
    decisions = get_policy(policy)(problem, budget_bytes).decisions
    policy_s = time.process_time() - t
    t = time.process_time()
    plan, _sim = build_plan(problem, decisions, policy=policy, budget_bytes=budget_bytes)
    plan.to_json()
    build_s = time.process_time() - t
    return dict(
        ops=problem.n_ops,
        budget=budget,
        cpu_s=time.process_time() - cpu,
        policy_s=policy_s,
        build_s=build_s,
        decisions=len(plan.decisions),
        fits=plan.predictions.feasible,
        overhead_pct=100 * plan.predictions.predicted_overhead,
    )


def llama_trace(layers: int) -> Path:
    """tests/frameworks/hf_llama_ckpt.py with ``layers`` decoder layers, traced once (one
    intra-op thread) into benchmarks/.cache/ and reused."""
    out = ROOT / "benchmarks" / ".cache" / f"hf_llama_ckpt-{layers}.trace.parquet"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        script = ROOT / "tests" / "frameworks" / "hf_llama_ckpt.py"
        cmd = [sys.executable, "-m", "capuchin", "trace", "-o", str(out), str(script)]
        cmd += ["--", "--layers", str(layers)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(cmd, check=True, env=env, capture_output=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--traces",
        nargs="*",
        type=Path,
        default=None,
        help="trace files (default: traces/*.trace.parquet and the DTR traces)",
    )
    ap.add_argument("--no-dtr", action="store_true")
    ap.add_argument("--dtr-zip", type=Path, default=DTR_ZIP)
    ap.add_argument("--fractions", default="80%,60%,40%")
    ap.add_argument("--policy", default="capuchin")
    ap.add_argument(
        "--synthetic",
        action="store_true",
        help="also the generated 24-layer transformer (~100k ops) at 50%%",
    )
    ap.add_argument(
        "--llama",
        default="32",
        help="decoder layers of the HF Llama traces to add, comma-separated ('' for none)",
    )
    ap.add_argument("--csv", type=Path, default=None)
    ap.add_argument("--one", nargs=2, metavar=("TRACE", "BUDGET"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1], args.policy)))
        return 0

    rows = []
    with tempfile.TemporaryDirectory(prefix="planner_speed.") as tmp:
        paths = [
            (p.name.replace(".trace.parquet", ""), p)
            for p in (
                args.traces
                if args.traces is not None
                else sorted((ROOT / "traces").glob("*.trace.parquet"))
            )
        ]
        if args.traces is None and not args.no_dtr and zipfile.is_zipfile(args.dtr_zip):
            from capuchin.tracer.dtr_import import import_dtr_log, list_dtr_logs

            for member in list_dtr_logs(args.dtr_zip):
                name = "dtr-" + "-".join(Path(member).name.split("-")[:2])
                paths.append(
                    (
                        name,
                        import_dtr_log(
                            f"{args.dtr_zip}/{member}", Path(tmp) / f"{name}.trace.parquet"
                        ),
                    )
                )
        if args.traces is None:
            paths += [(f"hf-llama-{n}", llama_trace(int(n))) for n in args.llama.split(",") if n]
        cells = [(n, p, b) for n, p in paths for b in args.fractions.split(",")]
        if args.synthetic:
            from capuchin.tracer.reader import write_trace
            from capuchin.tracer.synthetic import trace_from_ops, transformer_ops

            ops, sizes, persistent = transformer_ops(24, 2000, hidden_bytes=1 << 16)
            tr = trace_from_ops(ops, sizes, persistent=persistent, bandwidth_bytes_per_s=12e9)
            p = write_trace(tr.events, tr.meta, Path(tmp) / "synthetic.trace.parquet")
            cells.append(("synthetic transformer 24x2000", p, "50%"))
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for name, path, budget in cells:
            out = subprocess.run(
                [sys.executable, __file__, "--one", str(path), budget, "--policy", args.policy],
                capture_output=True,
                text=True,
                env=env,
                check=False,
            )
            if out.returncode != 0:
                row = dict(trace=name, budget=budget, fits=f"error: {out.stderr.strip()[-200:]}")
            else:
                row = dict(trace=name, **json.loads(out.stdout.strip().splitlines()[-1]))
            rows.append(row)
            print("  ".join(f"{k}={_fmt(row.get(k))}" for k in COLS), flush=True)
    w = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in COLS]
    print()
    print("  ".join(c.ljust(n) for c, n in zip(COLS, w, strict=True)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(n) for c, n in zip(COLS, w, strict=True)))
    print(
        f"(policy {args.policy}; cold, one process per cell; CPU seconds; load average "
        f"{os.getloadavg()[0]:.1f}; python {sys.version.split()[0]})"
    )
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=COLS, extrasaction="ignore")
            wr.writeheader()
            wr.writerows(rows)
    return 0


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    return "" if v is None else str(v)


if __name__ == "__main__":
    sys.exit(main())
