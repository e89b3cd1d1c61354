"""Where a plan's runtime cost goes: the runtime's functions timed in a real run, wall time and the
main thread's CPU time side by side (their difference is time the main thread was not running:
waiting for the interpreter lock, a copy thread, or a core).

    OMP_NUM_THREADS=1 python benchmarks/runtime_profile.py [transformer] [--budget 50%]

One run of 6 steps of the example (the bundled ones, or hf_gpt2) under the capuchin plan at the
budget; per steady iteration: the calls, ms and µs per call of the slow path, planned evictions
and before-steps, and the swap engine's swap-out, prefetch, restore and poll.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("example", nargs="?", default="transformer")
    ap.add_argument("--budget", default="50%")
    args = ap.parse_args()
    import torch
    from capuchin.runtime import residency, swap, tracker
    from capuchin.runtime.engine import Runtime

    import runtime as bench

    torch.set_num_threads(1)
    bench._steady_malloc()
    wall: collections.Counter = collections.Counter()
    cpu: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()

    def timed(cls, name, label):
        f = getattr(cls, name)

        def g(*a, **k):
            w, c = time.perf_counter(), time.thread_time()
            try:
                return f(*a, **k)
            finally:
                wall[label] += time.perf_counter() - w
                cpu[label] += time.thread_time() - c
                calls[label] += 1

        setattr(cls, name, g)

    for name in ("evict", "prefetch", "restore", "poll"):
        timed(swap.SwapEngine, name, f"SwapEngine.{name}")
    timed(tracker.Executor, "slow_op", "Executor.slow_op")
    for name in ("_evict", "_before"):
        timed(residency.StorageResidency, name, f"StorageResidency.{name}")
    script, trace, _ = bench._example(args.example, Path(tempfile.mkdtemp()))
    plan = bench._plan(trace, args.budget)
    plain = bench.time_once(script, ["--steps", "6"])
    for c in (wall, cpu, calls):
        c.clear()
    rt = Runtime(plan, measure_memory=False)
    t = bench.time_once(script, ["--steps", "6"], context=rt)
    n = len(rt.report.iterations)
    print(
        f"{args.example}: plain {plain * 1e3:.1f} ms, plan {t * 1e3:.1f} ms, predicted "
        f"{bench.predicted_s(plan, plain) * 1e3:.1f} ms per step; {len(plan.decisions)} decisions; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        "| function | calls/iteration | wall ms/iteration | CPU ms/iteration | wall µs/call | CPU µs/call |"
    )
    print("|---|---|---|---|---|---|")
    for k in sorted(wall, key=wall.get, reverse=True):
        print(
            f"| {k} | {calls[k] / n:.0f} | {wall[k] / n * 1e3:.2f} | {cpu[k] / n * 1e3:.2f} | "
            f"{wall[k] / calls[k] * 1e6:.1f} | {cpu[k] / calls[k] * 1e6:.1f} |"
        )


if __name__ == "__main__":
    main()
