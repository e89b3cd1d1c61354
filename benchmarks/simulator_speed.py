"""The simulator's speed: its pass against the oracle (tests/oracle_simulator.py, the model as
one loop over every op), and cold planning before and after a change, with the plans compared.

    python benchmarks/simulator_speed.py passes --traces unet resnet32 --fraction 60%
    python benchmarks/simulator_speed.py cold --before 1dbea38 --traces unet resnet32 \\
        inceptionv4 --fraction 60% --repeats 2

``passes``: records every plan the capuchin policy's search simulates on a trace (each pass,
with its carry), then times the oracle (``oracle_simulator.oracle_pass``) and the simulator's
pass (``simulator._pass``) on those plans, interleaved, in this process: CPU ms per pass.

``cold``: the capuchin policy, cold, one fresh process per (tree, trace, repeat), interleaved:
the working tree's code and the code of git revision ``--before`` (exported to a temporary
folder). CPU seconds of the policy, and whether the two trees made the same plan (a hash of the
decisions). Traces are DTR trace names (imported from ``--dtr-zip``) or trace files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _trace_path(name: str, tmp: Path, dtr_zip: Path) -> Path:
    if Path(name).is_file():
        return Path(name)
    from capuchin.tracer.dtr_import import import_dtr_log, list_dtr_logs

    members = [m for m in list_dtr_logs(dtr_zip) if Path(m).name.startswith(name + "-")]
    if len(members) != 1:
        raise SystemExit(f"{dtr_zip}: no single DTR log named {name!r}")
    return Path(import_dtr_log(f"{dtr_zip}/{members[0]}", tmp / f"{name}.trace.parquet"))


def one(path: str, budget: str) -> dict:
    """The capuchin policy, cold, in this process: CPU seconds and a hash of the plan."""
    from capuchin.planner.budget import parse_budget
    from capuchin.planner.problem import Problem
    from capuchin.planner.registry import get_policy
    from capuchin.tracer.reader import load_trace

    problem = Problem.from_trace(load_trace(path))
    t = time.process_time()
    ds = get_policy("capuchin")(problem, parse_budget(budget, problem.peak_bytes)).decisions
    cpu = time.process_time() - t
    doc = json.dumps([d.to_dict() for d in ds], sort_keys=True).encode()
    return dict(cpu_s=cpu, decisions=len(ds), plan=hashlib.sha1(doc).hexdigest()[:12])


def cold(args, traces: list[tuple[str, Path]]) -> None:
    with tempfile.TemporaryDirectory(prefix="simulator_speed.") as tmp:
        before = Path(tmp) / "before"
        (before / "capuchin").mkdir(parents=True)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.before], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(before / "capuchin")], input=archive, check=True)
        trees = [(args.before, before), ("working tree", ROOT.parent)]
        rows = {}
        for rep in range(args.repeats):
            for name, path in traces:
                for label, tree in trees if rep % 2 == 0 else trees[::-1]:
                    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree))
                    out = subprocess.run(
                        [sys.executable, __file__, "one", str(path), args.fraction],
                        capture_output=True,
                        text=True,
                        env=env,
                        check=True,
                        cwd=tree,
                    )
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    rows.setdefault((name, label), []).append(r)
                    print(f"  {name} {label}: {r['cpu_s']:.2f} s", flush=True)
        print()
        print(
            f"| trace @ {args.fraction} | {args.before} (CPU s) | working tree (CPU s) | ratio "
            "| same plan |"
        )
        print("|---|---|---|---|---|")
        for name, _ in traces:
            a, b = rows[(name, args.before)], rows[(name, "working tree")]
            ta = sorted(r["cpu_s"] for r in a)
            tb = sorted(r["cpu_s"] for r in b)
            same = {r["plan"] for r in a} == {r["plan"] for r in b} and len(
                {r["plan"] for r in a}
            ) == 1
            print(
                f"| {name} | {' / '.join(f'{x:.1f}' for x in ta)} | "
                f"{' / '.join(f'{x:.1f}' for x in tb)} | {ta[0] / tb[0]:.2f}x | "
                f"{'yes' if same else 'NO'} ({a[0]['decisions']} decisions) |"
            )
        print(
            f"(capuchin policy, cold, one process per cell, CPU seconds, repeats sorted; "
            f"load average {os.getloadavg()[0]:.1f})"
        )


def passes(args, traces: list[tuple[str, Path]]) -> None:
    from capuchin.planner import simulator
    from capuchin.planner.budget import parse_budget
    from capuchin.planner.problem import Problem
    from capuchin.planner.registry import get_policy
    from capuchin.tracer.reader import load_trace

    sys.path.insert(0, str(ROOT / "tests"))
    from oracle_simulator import oracle_pass

    print(
        "| trace @ budget | ops | passes | decisions per pass | oracle (ms/pass) | "
        "simulator (ms/pass) | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, path in traces:
        problem = Problem.from_trace(load_trace(path))
        seen = []
        fast = simulator._pass

        def record(p, ds, bo, bi, carry=None, fast=fast, seen=seen, **kw):
            seen.append((p, tuple(ds), bo, bi, carry))
            return fast(p, ds, bo, bi, carry, **kw)

        simulator._pass = record
        try:
            get_policy("capuchin")(problem, parse_budget(args.fraction, problem.peak_bytes))
        finally:
            simulator._pass = fast
        tr = tf = 0.0
        for rep in range(args.repeats):
            for which in ("ref", "fast") if rep % 2 == 0 else ("fast", "ref"):
                fn = oracle_pass if which == "ref" else simulator._pass
                t = time.process_time()
                for a in seen:
                    fn(*a)
                t = time.process_time() - t
                if which == "ref":
                    tr += t
                else:
                    tf += t
        k = len(seen) * args.repeats
        per = sum(len(a[1]) for a in seen) / max(1, len(seen))
        print(
            f"| {name} @ {args.fraction} | {problem.n_ops} | {len(seen)} | {per:.0f} | "
            f"{1e3 * tr / k:.2f} | {1e3 * tf / k:.2f} | {tr / tf:.2f}x |"
        )
    print(f"(load average {os.getloadavg()[0]:.1f})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["passes", "cold", "one"])
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--traces", nargs="+", default=["unet", "resnet32"])
    ap.add_argument("--fraction", default="60%")
    ap.add_argument("--before", default="HEAD")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtr-zip", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.mode == "one":
        print(json.dumps(one(*args.rest)))
        return 0
    from capuchin.tracer.dtr_import import dtr_logs_path

    dtr_zip = args.dtr_zip or dtr_logs_path()
    with tempfile.TemporaryDirectory(prefix="simulator_speed.") as tmp:
        traces = [(n, _trace_path(n, Path(tmp), dtr_zip)) for n in args.traces]
        (cold if args.mode == "cold" else passes)(args, traces)
    return 0


if __name__ == "__main__":
    sys.exit(main())
