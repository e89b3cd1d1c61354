"""Before/after comparison of the runtime's cost: two checkouts measured alternately in one run.

    git archive OLD | tar -x -C /tmp/old/capuchin   # a folder holding a ``capuchin`` package
    git archive HEAD | tar -x -C /tmp/new/capuchin
    OMP_NUM_THREADS=1 python benchmarks/runtime_compare.py /tmp/old /tmp/new [--rounds 3]

Each round runs, for each measurement and each checkout in turn, one fresh process (the checkout
first on ``PYTHONPATH``): the per-op and swap-cycle lines of benchmarks/runtime.py, and per example
plain training and the capuchin plan at 50% of the traced peak (median steady iteration of 6
steps, no profiler). The measuring code is this checkout's benchmarks/runtime.py in both, so only
the runtime differs. Printed: the best of the rounds per checkout, and the per-round ratios of
plan to plain with the load average, since the host is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def one(what: str, traces: Path) -> dict:
    sys.path.insert(0, str(HERE))
    import torch

    import runtime as bench

    torch.set_num_threads(1)
    bench._steady_malloc()
    out = {"load": os.getloadavg()[0]}
    if what == "perop":
        out.update(bench.per_op_us())
        cyc = bench.swap_cycle_ns_per_byte()
        out.update(
            {f"swap cycle {n >> 10} KiB, µs per direction": v * n / 1e3 for n, v in cyc.items()}
        )
        return out
    from capuchin.runtime.engine import Runtime

    script, trace, _ = bench._example(what, traces)
    plan = bench._plan(trace, "50%")
    argv = ["--steps", "6"]
    out["plain"] = bench.time_once(script, argv)
    rt = Runtime(plan, measure_memory=False)
    out["plan"] = bench.time_once(script, argv, context=rt)
    out["diverged"] = [s.iteration for s in rt.report.iterations if s.diverged]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="*", help="folders holding a capuchin package (2 or more)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--examples", default="cnn,transformer,mlp,hf_gpt2")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--traces", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one, Path(args.traces))))
        return
    import tempfile

    traces = Path(tempfile.mkdtemp(prefix="capuchin-compare-"))  # the Hugging Face trace, once
    results: dict = {}
    for _ in range(args.rounds):
        for what in ["perop", *args.examples.split(",")]:
            for tree in args.trees:
                env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()), OMP_NUM_THREADS="1")
                r = subprocess.run(
                    [sys.executable, __file__, "--one", what, "--traces", str(traces)],
                    env=env,
                    capture_output=True,
                    text=True,
                )
                line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
                if not line:
                    sys.exit(f"{tree} {what}: no result\n{r.stderr[-2000:]}")
                results.setdefault((what, tree), []).append(json.loads(line[0][7:]))
    for (what, tree), rs in results.items():
        if what == "perop":
            keys = [k for k in rs[0] if k != "load"]
            best = ", ".join(f"{k} {min(r[k] for r in rs):.2f}" for k in keys)
            print(f"{tree} per-op µs (best of {len(rs)}): {best}")
        else:
            ratios = ", ".join(f"{r['plan'] / r['plain']:.3f} (load {r['load']:.1f})" for r in rs)
            print(
                f"{tree} {what}: best plain {min(r['plain'] for r in rs) * 1e3:.1f} ms, best plan "
                f"{min(r['plan'] for r in rs) * 1e3:.1f} ms; plan / plain per round: {ratios}; "
                f"diverged iterations {rs[-1]['diverged']}"
            )


if __name__ == "__main__":
    main()
