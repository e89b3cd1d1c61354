"""A compiled training script managed by capuchin: predicted against measured step time, and
the steady peak against the budget (Note [torch.compile] in tracer/compiled.py).

    python benchmarks/compile_managed.py [--script tests/frameworks/nanogpt_compiled.py]
        [--budgets 60%,smallest] [--policy capuchin] [--repeats 2] [--steps 8] [--activation-budgets 1.0,0.5,0.0]
        [--equal-time 1.0,0.8,0.6,0.4,0.2,0.0 [--sweep-budgets 100%,90%,...,smallest]]
        [-- SCRIPT_ARGS...]

Traces the script afresh (compiled: each compiled region one op), plans it at each budget
(``smallest``: the smallest budget the planner reaches), then per plan times plain and managed
training interleaved (``--repeats`` rounds, each the median steady iteration of one run without
the profiler, best of the rounds; benchmarks/runtime.py's helpers) and measures the managed
run's steady peak under the profiler. Every run is the compiled script (Inductor, CPU). Printed:
the plan's ``1 + predicted_overhead`` (of the plain step the trace stored), the measured
managed / plain ratio, and the steady peak / budget. The host is shared and noisy: compare rows
of one run only. ``--activation-budgets``: compile's own knob at each value against capuchin's
plan at the peak the knob reached (equal peak: compare step times). ``--equal-time``: the knob's
values and capuchin's budgets all timed interleaved, and for each value the smallest capuchin
budget whose step is no slower (equal step time: compare peaks).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import capuchin
import torch
from capuchin.errors import InfeasibleBudgetError
from capuchin.planner.plan import Method
from capuchin.runmain import run_as_main
from capuchin.runtime.engine import Runtime
from capuchin.tracing import trace_script  # as `capuchin trace`: calibrated

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime import _Steps  # noqa: E402  (benchmarks/runtime.py)

ROOT = Path(__file__).resolve().parent.parent


class _CpuSteps(_Steps):
    """``_Steps`` that also takes the process's CPU time at each optimizer step: with one
    intra-op thread, the CPU work of a step, which other jobs on a loaded host disturb less than
    its wall time (the runtime's own threads count too, whether they overlap the step or not)."""

    def __enter__(self):
        self.cpu = [time.process_time()]
        return super().__enter__()

    def _hook(self, *a):
        self.cpu.append(time.process_time())
        super()._hook(*a)

    def steady_cpu_s(self) -> float:
        return statistics.median([b - a for a, b in zip(self.cpu, self.cpu[1:], strict=False)][1:])


def _once(script, argv, context=None, profile=False) -> _CpuSteps:
    """One run of a top-level script (no ``main()``), its steps timed (and peaks measured)."""
    with _CpuSteps(profile=profile) as s:
        with contextlib.redirect_stdout(io.StringIO()), context or contextlib.nullcontext():
            run_as_main(script, argv)
    return s


def _plan(trace, budget: str, policy: str = "capuchin"):
    """(budget, plan) at ``budget`` (``smallest``: the smallest the policy reaches, in bytes)."""
    if budget == "smallest":
        try:
            capuchin.make_plan(trace, budget="1%", policy=policy)
            raise SystemExit("1% of the peak is feasible: no smallest budget to find")
        except InfeasibleBudgetError as exc:
            budget = exc.smallest_feasible_bytes
    return budget, capuchin.make_plan(trace, budget=budget, policy=policy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--script", default=str(ROOT / "tests" / "frameworks" / "nanogpt_compiled.py"))
    ap.add_argument("--budgets", default="60%,smallest")
    ap.add_argument("--policy", default="capuchin", help="the planner's policy for --budgets")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="steps of each timed run")
    ap.add_argument(
        "--activation-budgets",
        default="",
        help="also compare with torch._functorch.config.activation_memory_budget at these "
        "values (e.g. 0.5,0.0): its peak and step time, and capuchin's at that peak",
    )
    ap.add_argument(
        "--equal-time",
        default="",
        help="memory at equal step time: activation_memory_budget at these values (e.g. "
        "1.0,0.8,0.6,0.4,0.2,0.0) and capuchin's plans at --sweep-budgets, timed interleaved; "
        "for each value, the smallest capuchin budget whose step is no slower",
    )
    ap.add_argument("--sweep-budgets", default="100%,90%,80%,70%,60%,smallest")
    ap.add_argument(
        "--tolerance",
        type=float,
        default=0.0,
        help="--equal-time: a capuchin step counts as no slower up to this fraction above",
    )
    ap.add_argument("script_args", nargs="*")
    args = ap.parse_args()
    torch.set_num_threads(1)
    script = Path(args.script)
    tmp = Path(tempfile.mkdtemp(prefix="capuchin-compile-"))
    loads = [os.getloadavg()[0]]
    out = tmp / "trace.parquet"
    trace_script(script, ["--steps", "18", *args.script_args], output=out, log=lambda _: None)
    argv = ["--steps", str(args.steps), *args.script_args]
    rows = []
    for budget in args.budgets.split(",") if args.budgets else []:
        budget, plan = _plan(out, budget, args.policy)
        best = {"plain": math.inf, "capuchin": math.inf}
        for _ in range(args.repeats):
            best["plain"] = min(best["plain"], _once(script, argv).steady_time_s())
            rt = Runtime(plan, measure_memory=False)
            best["capuchin"] = min(best["capuchin"], _once(script, argv, rt).steady_time_s())
        rt = Runtime(plan, measure_memory=True)
        _once(script, argv, rt)
        steady = [x for x in rt.report.iterations if x.complete and x.iteration >= 1]
        peak = max(x.peak_bytes for x in steady)
        loads.append(os.getloadavg()[0])
        rows.append((budget, plan, best, peak, any(s.diverged for s in steady)))
        print(f"budget {budget}: done", file=sys.stderr)
    print(
        f"\n{script.name} {' '.join(args.script_args)}; torch {torch.__version__}; load average "
        f"{min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs"
    )
    if rows:
        _budget_table(script, args, loads, rows)
    if args.activation_budgets:
        compare_activation_budget(script, argv, out, args)
    if args.equal_time:
        equal_step_time(script, argv, out, args)


def _budget_table(script, args, loads, rows) -> None:
    print(
        f"\n{script.name} {' '.join(args.script_args)}; one intra-op thread; best of "
        f"{args.repeats} interleaved rounds of --steps {args.steps}; load average "
        f"{min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs; torch {torch.__version__}\n"
    )
    print(
        f"policy {args.policy}\n\n"
        "| budget | budget bytes | decisions | recomputed | plain ms | managed ms | measured x plain | "
        "predicted x plain | measured / predicted | steady peak / budget | diverged |"
    )
    print("|---" * 11 + "|")
    for budget, plan, best, peak, diverged in rows:
        measured = best["capuchin"] / best["plain"]
        predicted = 1 + plan.predictions.predicted_overhead
        recomputed = sum(d.method is Method.RECOMPUTE for d in plan.decisions)
        print(
            f"| {budget} | {plan.budget_bytes} | {len(plan.decisions)} | {recomputed} | "
            f"{best['plain'] * 1e3:.1f} | {best['capuchin'] * 1e3:.1f} | {measured:.3f} | "
            f"{predicted:.3f} | {measured / predicted:.3f} | {peak / plan.budget_bytes:.3f} | "
            f"{diverged} |"
        )


def compare_activation_budget(script, argv, trace, args) -> None:
    """PyTorch's own knob (a knapsack over each compiled region's saved activations, recompute
    inside the region) at each value, against capuchin's plan at the peak the knob reached."""
    import torch._functorch.config as fc

    loads = [os.getloadavg()[0]]
    rows = []
    for value in (float(v) for v in args.activation_budgets.split(",")):
        with fc.patch(activation_memory_budget=value):
            t = min(_once(script, argv).steady_time_s() for _ in range(args.repeats))
            peak = _once(script, argv, profile=True).steady_peak()
        try:
            plan = capuchin.make_plan(trace, budget=peak)
        except InfeasibleBudgetError as exc:
            rows.append(
                (
                    value,
                    t,
                    peak,
                    None,
                    None,
                    f"infeasible (smallest {exc.smallest_feasible_bytes} B)",
                )
            )
            continue
        ct = min(
            _once(script, argv, Runtime(plan, measure_memory=False)).steady_time_s()
            for _ in range(args.repeats)
        )
        rt = Runtime(plan, measure_memory=True)
        _once(script, argv, rt)
        cpeak = max(x.peak_bytes for x in rt.report.iterations if x.complete and x.iteration >= 1)
        rows.append((value, t, peak, ct, cpeak, ""))
        loads.append(os.getloadavg()[0])
        print(f"activation_memory_budget {value}: done", file=sys.stderr)
    base = min(_once(script, argv).steady_time_s() for _ in range(args.repeats))
    print(
        f"\nactivation_memory_budget (plain compiled step {base * 1e3:.1f} ms at 1.0 default); "
        f"load average {min(loads):.1f}-{max(loads):.1f}\n"
    )
    print(
        "| activation_memory_budget | its steady peak B | its step ms | capuchin at that peak: "
        "step ms | capuchin's steady peak B | note |"
    )
    print("|---" * 6 + "|")
    for value, t, peak, ct, cpeak, note in rows:
        cts = f"{ct * 1e3:.1f}" if ct is not None else "-"
        print(f"| {value} | {peak} | {t * 1e3:.1f} | {cts} | {cpeak or '-'} | {note} |")


def equal_step_time(script, argv, trace, args) -> None:
    """Memory at equal step time: each ``activation_memory_budget`` value and each capuchin plan
    (on the default compile) timed once per round, all interleaved, best of ``--repeats``
    rounds; peaks measured once each (the profiler for compile's knob, the runtime's meter for
    capuchin). For each value: the smallest capuchin budget whose best step is no slower than
    the value's, and the steady peak capuchin measured there."""
    import torch._functorch.config as fc

    values = [float(v) for v in args.equal_time.split(",")]
    plans = [_plan(trace, b) for b in args.sweep_budgets.split(",")]
    loads = [os.getloadavg()[0]]
    amb_t = {v: math.inf for v in values}
    cap_t = [math.inf] * len(plans)
    amb_c = dict(amb_t)
    cap_c = list(cap_t)
    for r in range(args.repeats):
        for v in values:
            with fc.patch(activation_memory_budget=v):
                s = _once(script, argv)
            amb_t[v] = min(amb_t[v], s.steady_time_s())
            amb_c[v] = min(amb_c[v], s.steady_cpu_s())
        for i, (_, plan) in enumerate(plans):
            s = _once(script, argv, Runtime(plan, measure_memory=False))
            cap_t[i] = min(cap_t[i], s.steady_time_s())
            cap_c[i] = min(cap_c[i], s.steady_cpu_s())
        loads.append(os.getloadavg()[0])
        print(f"equal step time: round {r + 1} done", file=sys.stderr)
    amb_p = {}
    for v in values:
        with fc.patch(activation_memory_budget=v):
            amb_p[v] = _once(script, argv, profile=True).steady_peak()
    cap_p = []
    for _, plan in plans:
        rt = Runtime(plan, measure_memory=True)
        _once(script, argv, rt)
        cap_p.append(
            max(x.peak_bytes for x in rt.report.iterations if x.complete and x.iteration >= 1)
        )
    loads.append(os.getloadavg()[0])
    print(
        f"\nmemory at equal step time; one intra-op thread; best of {args.repeats} interleaved "
        f"rounds of --steps {args.steps}; load average {min(loads):.1f}-{max(loads):.1f} on "
        f"{os.cpu_count()} CPUs; a capuchin step counts as no slower up to {args.tolerance:.0%} "
        "above the knob's\n"
    )
    print("| capuchin budget | budget bytes | decisions | step ms | step CPU ms | steady peak B |")
    print("|---" * 6 + "|")
    for (b, plan), t, c, p in zip(plans, cap_t, cap_c, cap_p, strict=True):
        print(
            f"| {b} | {plan.budget_bytes} | {len(plan.decisions)} | {t * 1e3:.1f} | "
            f"{c * 1e3:.1f} | {p} |"
        )
    same = [i for i, (_, plan) in enumerate(plans) if not plan.decisions]
    if same and 1.0 in amb_t:  # the same program twice: how far apart this host times it
        print(
            f"\nnoise: capuchin's empty plan ({plans[same[0]][0]}) and activation_memory_budget "
            f"1.0 run the same compiled program: {cap_t[same[0]] * 1e3:.1f} vs "
            f"{amb_t[1.0] * 1e3:.1f} ms ({cap_t[same[0]] / amb_t[1.0]:.2f}x); CPU "
            f"{cap_c[same[0]] * 1e3:.1f} vs {amb_c[1.0] * 1e3:.1f} ms "
            f"({cap_c[same[0]] / amb_c[1.0]:.2f}x)"
        )
    for what, at, ct in (("step", amb_t, cap_t), ("step CPU", amb_c, cap_c)):
        print(
            f"\nequal {what} time:\n\n| activation_memory_budget | its {what} ms | its steady "
            f"peak B | its peak / plain peak | capuchin's smallest budget no slower | its {what} "
            "ms | its steady peak B | capuchin peak / knob peak |"
        )
        print("|---" * 8 + "|")
        plain = amb_p.get(1.0, 0)
        for v in values:
            rel = f"{amb_p[v] / plain:.3f}" if plain else "-"
            head = f"| {v} | {at[v] * 1e3:.1f} | {amb_p[v]} | {rel} |"
            ok = [i for i in range(len(plans)) if ct[i] <= at[v] * (1 + args.tolerance)]
            if not ok:
                print(f"{head} none | - | - | - |")
                continue
            i = min(ok, key=lambda i: plans[i][1].budget_bytes)
            print(
                f"{head} {plans[i][0]} | {ct[i] * 1e3:.1f} | {cap_p[i]} | "
                f"{cap_p[i] / amb_p[v]:.3f} |"
            )


if __name__ == "__main__":
    main()
