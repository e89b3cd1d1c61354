"""The region-tag loop on a compiled script, end to end (Note [Region tags] in
tracer/region_tags.py): trace untagged, propose the tags (``plan --region-tags``), retrace with
them (verified bitwise first), and report each trace's peak, floor and smallest feasible budget;
then run the tagged trace's plan at its smallest budget in this process against the compiled
script without capuchin (every state tensor, ``torch.equal``) and report its steady peaks.

    python benchmarks/compile_region_tags.py [--script tests/frameworks/nanogpt_compiled.py]
        [--steps 6] [--out /tmp/region_tags] [-- SCRIPT_ARGS...]

One intra-op thread (Inductor's CPU kernels repeat bitwise only there). Numbers are memory and
structure, not times.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--script", default=str(ROOT / "tests/frameworks/nanogpt_compiled.py"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default="/tmp/region_tags")
    ap.add_argument("script_args", nargs="*")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)

    from capuchin.errors import InfeasibleBudgetError
    from capuchin.planner.api import make_plan
    from capuchin.planner.problem import Problem
    from capuchin.runtime.engine import Runtime
    from capuchin.testing.training import state_mismatches
    from capuchin.tracer.reader import load_trace
    from capuchin.tracing import state_after_steps, trace_script

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    args = ["--steps", str(a.steps), *a.script_args]

    def smallest(trace) -> int:
        try:
            make_plan(trace, "1%")
        except InfeasibleBudgetError as e:
            return e.smallest_feasible_bytes
        return 0

    def row(name: str, trace) -> None:
        p = Problem.from_trace(load_trace(trace))
        print(
            f"| {name} | {p.peak_bytes} | {p.floor_bytes(dead=True)} | {smallest(trace)} |",
            flush=True,
        )

    quiet = lambda line: None  # noqa: E731
    t0 = trace_script(a.script, args, output=out / "t0.trace.parquet", log=quiet, force=True)
    first = make_plan(t0, "60%", region_tags=True)
    if first.region_tags is None:
        print("no candidate recorded: nothing to tag")
        return
    tags = first.region_tags
    print(
        f"proposed: {sum(len(v) for v in tags.tags.values())} nodes in {sorted(tags.tags)}, "
        f"{tags.candidate_bytes} B of saved activations per call"
    )
    first.save(out / "first.json")
    lines: list[str] = []
    t1 = trace_script(
        a.script,
        args,
        output=out / "t1.trace.parquet",
        log=lines.append,
        force=True,
        plan=out / "first.json",
    )
    print(*[x for x in lines if "region tags" in x], sep="\n")
    print("\n| trace | peak B | floor B | smallest feasible B |\n|---|---|---|---|")
    row("untagged", t0)
    row("tagged" if load_trace(t1).meta.region_tags else "tags dropped", t1)
    plan = make_plan(t1, smallest(t1))
    run_args = ["--steps", str(a.steps - 1), *a.script_args]
    ref = state_after_steps(a.script, run_args, 10**6, contextlib.nullcontext())
    rt = Runtime(plan)
    got = state_after_steps(a.script, run_args, 10**6, rt)
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
    print(
        f"\nplan of the tagged trace at {plan.budget_bytes} B: {len(ref)} state tensors, "
        f"mismatches {state_mismatches(ref, got)}; steady peaks {[s.peak_bytes for s in its]}; "
        f"diverged {[s.iteration for s in its if s.diverged]}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
