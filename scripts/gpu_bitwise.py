"""Bitwise check of one bundled example on a device: plain vs plain (the determinism precondition),
plain vs a plan, plain vs dynamic mode; every parameter, gradient, optimizer state and buffer
compared with ``torch.equal`` (capuchin.testing.training). Run by scripts/gpu-check.sh:

    python3 scripts/gpu_bitwise.py --device cuda --example transformer --trace T.parquet

``--trace``: a trace of the example on that device (the plan is made from it). On CUDA,
deterministic kernels are asked for first (Note [Determinism precondition] in runtime/device.py;
``CUBLAS_WORKSPACE_CONFIG`` must be set in the environment before the process starts). Prints
one line per comparison; exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--example", default="transformer")
    ap.add_argument("--trace", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--plan-budget", default="80%")
    ap.add_argument("--dynamic-percent", type=int, default=60)
    args = ap.parse_args()
    if args.device.startswith("cuda"):
        torch.use_deterministic_algorithms(True, warn_only=True)  # plain vs plain shows the rest
        torch.backends.cudnn.benchmark = False
    import capuchin
    from capuchin.planner.problem import Problem
    from capuchin.runtime.engine import Runtime
    from capuchin.testing.training import TRACES, run_example, state_mismatches
    from capuchin.tracer.reader import load_trace

    script = TRACES / f"{args.example}.py"
    argv = ["--steps", str(args.steps), "--device", args.device]
    problem = Problem.from_trace(load_trace(Path(args.trace)))
    plan = capuchin.make_plan(problem, budget=args.plan_budget, allow_infeasible=True)
    budget = problem.peak_bytes * args.dynamic_percent // 100
    ref = run_example(script, argv)
    runs = {
        "plain vs plain": lambda: None,
        f"plan {args.plan_budget} ({len(plan.decisions)} decisions)": lambda: Runtime(
            plan, measure_memory=False
        ),
        f"dynamic mode {args.dynamic_percent}%": lambda: Runtime(
            budget_bytes=budget, device=args.device, measure_memory=False
        ),
    }
    bad = 0
    for name, make in runs.items():
        rt = make()
        try:
            got = run_example(script, argv, rt)
        except Exception as exc:  # reported, and counted as a failure
            print(f"{args.example} {args.device}: {name}: FAILED {type(exc).__name__}: {exc}")
            bad += 1
            continue
        diff = state_mismatches(ref, got)
        extra = ""
        if rt is not None and rt.report is not None:
            its = [s for s in rt.report.iterations if s.complete]
            extra = (
                f"; evictions {sum(s.evictions + s.passive_evictions for s in its)}, "
                f"replayed ops {sum(s.recomputed_ops for s in its)}"
            )
        verdict = "bitwise equal" if not diff else f"{len(diff)} DIFFER: {', '.join(diff[:4])}"
        print(f"{args.example} {args.device}: {name}: {len(ref)} tensors, {verdict}{extra}")
        bad += bool(diff)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
