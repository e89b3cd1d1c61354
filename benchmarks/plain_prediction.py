"""Predicted against measured slowdown of a plan, with the plain step the tracer now times
(Note [Plain step] in tracer/record.py, Note [Plain baseline] in planner/problem.py).

    python benchmarks/plain_prediction.py [--examples cnn,transformer,mlp,hf_gpt2] [--budget 50%]
    python benchmarks/plain_prediction.py --examples nanogpt,hf_t5,hf_llama_ckpt --repeats 3 \
        --script-args "--batch 16"
    python benchmarks/plain_prediction.py --examples hf_t5 --repeats 3 --policy recompute \
        --script-args "--batch 16"

An example is a bundled one (traces/), benchmarks/scripts/hf_gpt2.py, or a script of
tests/frameworks/ in the style people write (nanoGPT, a Hugging Face T5 or Llama with gradient
checkpointing, ...: the probe of ../shared/reports/real-scripts.md rebuilt); those train at
module level and are timed as a whole run (their steady optimizer steps).

Per example: trace the script afresh as ``capuchin trace`` does (``--steps 21``: 1 warm-up, 3
recorded, 1 plain warm-up, an untimed plain step, 2 plain steps, a warm-up of the runtime and 3
rounds of a plain step and the runtime on its hot, guarded and slow paths: Note [The runtime in
the script's steps] in runtime/calibrate.py), plan it at ``--budget`` (or the smallest budget the planner reaches), then
time plain and managed training interleaved (``--repeats`` rounds, each the median steady
iteration of one run, best of the rounds; benchmarks/runtime.py's helpers). Printed: the traced
iteration (summed op times under the profiler), the plain step the trace stored, the dispatch
mode's cost per op and the runtime's slow path, swap and replay costs the trace measured
(Note [Calibration of the runtime's slow path] in runtime/calibrate.py), the plan's
``1 + predicted_overhead`` as ``capuchin plan`` states it (of the plain step, host costs at the trace's measured speed), the same
trace's plan with the quiet host's constants (the trace's ``host_costs`` dropped), the measured
managed / plain ratio, and measured / predicted for both; then the managed step against the
prediction in ms (the predicted ratio times the trace's plain step) and the run's plain step
against the trace's: where the plain step drifted between the trace and the runs (load), the
ratio of ratios carries that drift; the trace's untimed first plain step; and the two readings
of a trace's plain step above the runs' (``readings``): managed - plain of the runs against
(a) the plan's predicted extra at the runs' plain step and (b) that extra plus the trace's plain
step less the runs'. The host is shared and noisy: compare rows of one run only.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import sys
import tempfile
from pathlib import Path

import torch
from capuchin.planner.problem import Problem
from capuchin.runmain import run_as_main
from capuchin.runtime.engine import Runtime
from capuchin.tracer.reader import load_trace
from capuchin.tracing import trace_script

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime import SCRIPTS, TRACES, _plan, _Steps, predicted_s, time_once  # noqa: E402

FRAMEWORKS = Path(__file__).resolve().parent.parent / "tests" / "frameworks"


def _time_script(script: Path, argv: list[str], context=None) -> float:
    """Median steady iteration time (s) of one run of a script that trains at module level."""
    with (
        _Steps(profile=False) as s,
        contextlib.redirect_stdout(io.StringIO()),
        context or contextlib.nullcontext(),
    ):
        run_as_main(script, argv)
    return s.steady_time_s()


def measure(
    names, budget="50%", repeats=2, steps=6, script_args="", policy="capuchin"
) -> tuple[list, list]:
    """Per example: trace, plan, time plain and managed interleaved (module docstring). Returns
    the table's rows and the load averages seen."""
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="capuchin-plain-"))
    loads = [os.getloadavg()[0]]
    rows = []
    extra = script_args.split()
    for name in names:
        script = TRACES / f"{name}.py"
        if not script.exists():  # hf_gpt2: benchmarks/scripts/
            script = SCRIPTS / f"{name}.py"
        timer = time_once
        if not script.exists():  # the real-style scripts: tests/frameworks/
            script, timer = FRAMEWORKS / f"{name}.py", _time_script
        out = tmp / f"{name}.trace.parquet"
        trace_script(script, ["--steps", "21", *extra], output=out, log=lambda _: None)
        trace = load_trace(out)
        plan = _plan(trace, budget, policy)
        hot = dict(trace.meta.host_costs or {})
        warm = trace.meta.extra.get("plain_warmup_wall_s")  # the untimed first plain step
        # the same trace with the quiet host's constants (Note [Calibrated host costs])
        trace.meta.host_costs = None
        old = _plan(trace, plan.provenance.budget_bytes, policy)
        trace.meta.plain_iteration_ns = None  # the traced iteration's own sum
        traced_ns = Problem.from_trace(trace).time_ns
        argv = ["--steps", str(steps), *extra]
        best = {"plain": math.inf, "capuchin": math.inf}
        for _ in range(repeats):
            best["plain"] = min(best["plain"], timer(script, argv))
            rt = Runtime(plan, measure_memory=False)
            best["capuchin"] = min(best["capuchin"], timer(script, argv, context=rt))
        loads.append(os.getloadavg()[0])
        measured = best["capuchin"] / best["plain"]
        new = 1 + plan.predictions.predicted_overhead
        before = 1 + old.predictions.predicted_overhead
        rows.append(
            (name, traced_ns, plan.predictions.plain_time_ns, hot, best, measured, new, before)
            + (warm, plan)
        )
        print(f"{name}: done", file=sys.stderr)
    return rows, loads


def print_table(rows, loads, budget, repeats, steps, script_args, policy="capuchin") -> None:
    print(
        f"\n{policy} plans, budget {budget} (or the smallest feasible); one intra-op thread; best of "
        f"{repeats} interleaved rounds of --steps {steps} {script_args}; load average "
        f"{min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs\n"
    )
    print(
        "| example | traced ms | plain (trace) ms | host µs: op/loop op/guarded/slow/slow in script/swap/replay/drop (trace) | plain ms | managed ms | "
        "measured x plain | predicted (calibrated) | measured / predicted | predicted "
        "(constants) | measured / predicted (constants) | managed ms / predicted ms | plain ms "
        "/ plain (trace) ms | first plain (trace, untimed) ms | managed - plain ms | (a) predicted "
        "extra ms | (b) predicted extra at plain (trace) + plain (trace) - plain ms |"
    )
    print("|---" * 17 + "|")
    for name, traced_ns, plain_ns, hot, best, measured, new, before, warm, plan in rows:
        plain = f"{plain_ns / 1e6:.1f}" if plain_ns else "not timed"
        # the prediction in ms (its ratio times the plain step the trace stored) against the
        # managed run, and how far the run's plain step is from the trace's: a ratio of ratios
        # (measured / predicted) counts the second in the first
        absolute = f"{best['capuchin'] / (new * plain_ns / 1e9):.3f}" if plain_ns else "-"
        drift = f"{best['plain'] / (plain_ns / 1e9):.3f}" if plain_ns else "-"
        mode = "/".join(
            f"{hot[k] / 1e3:.1f}" if hot.get(k) else "-"
            for k in (
                "hot_op_ns",
                "loop_hot_op_ns",
                "guarded_op_ns",
                "slow_op_ns",
                "slow_op_script_ns",
                "swap_action_ns",
                "replay_op_ns",
                "drop_action_ns",
            )
        )
        print(
            f"| {name} | {traced_ns / 1e6:.1f} | {plain} | {mode} | {best['plain'] * 1e3:.1f} | "
            f"{best['capuchin'] * 1e3:.1f} | {measured:.3f} | {new:.3f} | {measured / new:.3f} | "
            f"{before:.3f} | {measured / before:.3f} | {absolute} | {drift} | "
            f"{readings(best, plain_ns, warm, plan)} |"
        )


def readings(best, plain_ns, warm, plan) -> str:
    """The two readings of a trace's plain step above the runs': (a) the trace's
    figure is inflated and the cost model right, so managed - plain (both the runs') is the
    plan's predicted extra at the runs' plain step; (b) the model misses what the trace's
    figure exceeds the runs' by, so it is that extra plus the gap. Columns: the trace's untimed
    first plain step (Note [Plain step] in tracer/record.py), managed - plain, (a), (b)."""
    first = f"{warm * 1e3:.1f}" if warm else "-"
    if not plain_ns:
        return f"{first} | - | - | -"
    p_b, p_t = best["plain"], plain_ns / 1e9
    a = predicted_s(plan, p_b) - p_b
    b = predicted_s(plan, p_t) - p_t + (p_t - p_b)
    return f"{first} | {(best['capuchin'] - p_b) * 1e3:.1f} | {a * 1e3:.1f} | {b * 1e3:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", default="cnn,transformer,mlp")
    ap.add_argument("--budget", default="50%")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="steps of each timed run")
    ap.add_argument(
        "--script-args", default="", help="more arguments for every script (e.g. '--batch 16')"
    )
    ap.add_argument(
        "--policy",
        default="capuchin",
        help="the planner's policy (swap or recompute: one mechanism's costs alone)",
    )
    a = ap.parse_args()
    rows, loads = measure(
        a.examples.split(","), a.budget, a.repeats, a.steps, a.script_args, a.policy
    )
    print_table(rows, loads, a.budget, a.repeats, a.steps, a.script_args, a.policy)


if __name__ == "__main__":
    main()
