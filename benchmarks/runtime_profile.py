"""Where a plan's runtime cost goes: the runtime's functions timed in a real run, wall time and the
main thread's CPU time side by side (their difference is time the main thread was not running:
waiting for the interpreter lock, a copy thread, or a core).

    OMP_NUM_THREADS=1 python benchmarks/runtime_profile.py [transformer] [--budget 50%] [--device cuda]
    OMP_NUM_THREADS=1 python benchmarks/runtime_profile.py nanogpt --script-args "--batch 16"

One run of 6 steps of the example (the bundled ones, hf_gpt2, or a script of tests/frameworks/,
traced afresh) under the capuchin plan at the budget; per steady iteration (iteration 2 on):
the ops and how many took the slow path, then the calls, ms and µs per call of the slow path,
planned evictions and before-steps, the swap engine's swap-out, prefetch, restore and poll,
the residency's steps before and after an op, replays, the records for them and the
exact-replay check before a drop, and the plan cursor's match. ``--policy`` plans with another
policy (``recompute``: drops alone). For a tests/frameworks script also the median steady step
of a plain and a managed run, wall and main-thread CPU time (without the timers).
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
    ap.add_argument("--policy", default="capuchin")
    ap.add_argument(
        "--device", default="cpu", help="where a bundled example trains (cuda: traced there first)"
    )
    ap.add_argument(
        "--script-args", default="", help="more arguments for a tests/frameworks script"
    )
    ap.add_argument(
        "--cprofile",
        type=int,
        default=0,
        metavar="N",
        help="profile the managed run's steady iterations with cProfile instead of the timers: "
        "the N functions with the most own time, and with the most time under them",
    )
    args = ap.parse_args()
    import torch
    from capuchin.runtime import matching, recompute, residency, swap, tracker
    from capuchin.runtime.engine import Runtime

    import runtime as bench

    torch.set_num_threads(1)
    bench._steady_malloc()
    bench.DEVICE = args.device
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

        originals.append((cls, name, f))
        wrapped.append((cls, name, g))
        setattr(cls, name, g)

    originals: list = []
    wrapped: list = []
    for name in ("evict", "prefetch", "restore", "poll"):
        timed(swap.SwapEngine, name, f"SwapEngine.{name}")
    timed(tracker.Executor, "slow_op", "Executor.slow_op")
    for name in ("_evict", "_before", "before_op", "after_op"):
        timed(residency.StorageResidency, name, f"StorageResidency.{name}")
    for name in ("replay", "record", "recorded_outputs", "check_replayable"):
        timed(recompute.RecomputeEngine, name, f"RecomputeEngine.{name}")
    timed(matching.PlanCursor, "match", "PlanCursor.match")
    if args.device != "cpu":  # the CUDA backend's host side: copies, events, the pinned pool
        from capuchin.runtime import backend

        for name in ("copy_out", "copy_in", "host_buffer", "release", "wait_compute"):
            timed(backend.CUDABackend, name, f"CUDABackend.{name}")
        timed(backend._CUDAClock, "mark", "CUDAClock.mark")
        timed(backend._CUDAClock, "wait", "CUDAClock.wait")
    argv = ["--steps", "6", *args.script_args.split()]
    script = FRAMEWORKS / f"{args.example}.py"
    if script.exists():  # a real-style script: traced afresh, timed as plain_prediction.py does
        from capuchin.tracing import trace_script  # as `capuchin trace`: calibrated

        trace = Path(tempfile.mkdtemp()) / "t.parquet"
        trace_script(script, ["--steps", "21", *argv[2:]], output=trace, log=lambda _: None)
        timer = _steps_wall_cpu
    else:
        script, trace, _ = bench._example(args.example, Path(tempfile.mkdtemp()))
        timer = None
        if args.device != "cpu":
            argv += ["--device", args.device]
    plan = bench._plan(trace, args.budget, args.policy)
    if timer is not None:  # without the timers: restore the originals for these two runs
        for cls, name, f in originals:
            setattr(cls, name, f)
        pw, pc = timer(script, argv, None)
        mw, mc = timer(script, argv, Runtime(plan, measure_memory=False))
        print(
            f"{args.example}, median steady step without the timers: plain {pw * 1e3:.1f} ms wall "
            f"({pc * 1e3:.1f} ms main-thread CPU), plan {mw * 1e3:.1f} ms wall ({mc * 1e3:.1f} ms "
            f"CPU); predicted {1 + plan.predictions.predicted_overhead:.3f}x the trace's plain step"
        )
        for cls, name, g in wrapped:
            setattr(cls, name, g)
    plain = bench.time_once(script, argv) if timer is None else _steps_wall_cpu(script, argv)[0]
    for c in (wall, cpu, calls):
        c.clear()
    rt = Runtime(plan, measure_memory=False)
    prof = None
    if args.cprofile:  # cProfile alone: the timers' own cost would be in its figures
        import cProfile

        prof = cProfile.Profile()
        for cls, name, f in originals:
            setattr(cls, name, f)
    # steady iterations only: the counters restart after the second optimizer step, where
    # iteration 2 begins (iteration 0 builds the model and its state under passive mode, every
    # op on the slow path; one optimizer step per iteration, as in these scripts)
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = [0]

    def restart(*_):
        steps[0] += 1
        if steps[0] == 2:
            for c in (wall, cpu, calls):
                c.clear()
            if prof is not None:
                prof.enable()

    hook = register_optimizer_step_post_hook(restart)
    try:
        if timer is None:
            t = bench.time_once(script, argv, context=rt)
        else:
            t = _steps_wall_cpu(script, argv, rt)[0]
    finally:
        hook.remove()
        if prof is not None:
            prof.disable()
    first = 2 if steps[0] >= 2 else 0  # where the counters restarted
    steady = rt.report.iterations[first:]
    n = max(1, len(steady))
    ops = sum(s.ops for s in steady) / n
    print(
        f"{args.example}: plain {plain * 1e3:.1f} ms, plan {t * 1e3:.1f} ms, predicted "
        f"{bench.predicted_s(plan, plain) * 1e3:.1f} ms per step; {len(plan.decisions)} decisions; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"per steady iteration (iterations {first}-{first + n - 1}; the last may be "
        f"partial): {ops:.0f} ops, {calls['Executor.slow_op'] / n:.0f} of them on the slow path"
    )
    _model_parts(trace, plan)
    if prof is not None:
        import pstats

        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(args.cprofile)
        st.sort_stats("cumulative").print_stats(args.cprofile)
        return
    print(
        "| function | calls/iteration | wall ms/iteration | CPU ms/iteration | wall µs/call | CPU µs/call |"
    )
    print("|---|---|---|---|---|---|")
    for k in sorted(wall, key=wall.get, reverse=True):
        print(
            f"| {k} | {calls[k] / n:.0f} | {wall[k] / n * 1e3:.2f} | {cpu[k] / n * 1e3:.2f} | "
            f"{wall[k] / calls[k] * 1e6:.1f} | {cpu[k] / calls[k] * 1e6:.1f} |"
        )


FRAMEWORKS = Path(__file__).resolve().parent.parent / "tests" / "frameworks"


def _model_parts(trace, plan) -> None:
    """What the plan's prediction charges per step for the runtime's host work, by part
    (``runtime_cost_parts``, before the simulator's share is taken off), and the simulated
    iteration's time over the baseline (stalls, replays and the host work it charges)."""
    from capuchin.planner.api import load_problem
    from capuchin.planner.costs import costs_for, runtime_cost_parts

    problem = load_problem(trace)
    costs = costs_for(problem.device, problem.host_costs)
    parts = runtime_cost_parts(problem, plan.decisions, costs)
    p = plan.predictions
    device = p.predicted_time_ns - p.runtime_cost_ns - p.baseline_time_ns
    print(
        "the model's charges per step (ms): "
        + ", ".join(f"{k} {v / 1e6:.2f}" for k, v in parts.items())
        + f"; simulated over the baseline {device / 1e6:.2f}; per op (µs): hot "
        f"{costs.hot_op_ns / 1e3:.1f}, slow {costs.slow_op_ns / 1e3:.1f}, drop "
        f"{costs.drop_action_ns / 1e3:.1f}, replayed op {costs.replay_op_ns / 1e3:.1f}, swap "
        f"action {costs.swap_action_ns / 1e3:.1f}; the trace's host_costs (µs): "
        + ", ".join(f"{k} {v / 1e3:.1f}" for k, v in sorted((problem.host_costs or {}).items()))
    )


def _steps_wall_cpu(script, argv, context=None) -> tuple[float, float]:
    """Median steady step (s) of one run of a script that trains at module level: wall and the
    main thread's CPU time, optimizer step to step (the first step left out)."""
    import contextlib
    import io
    import statistics

    from capuchin.runmain import run_as_main
    from torch.optim.optimizer import register_optimizer_step_post_hook

    marks: list = []
    h = register_optimizer_step_post_hook(
        lambda *a: marks.append((time.perf_counter(), time.thread_time()))
    )
    try:
        with contextlib.redirect_stdout(io.StringIO()), context or contextlib.nullcontext():
            run_as_main(script, argv)
    finally:
        h.remove()
    steps = list(zip(marks, marks[1:], strict=False))[1:]
    return (
        statistics.median(b[0] - a[0] for a, b in steps),
        statistics.median(b[1] - a[1] for a, b in steps),
    )


if __name__ == "__main__":
    main()
