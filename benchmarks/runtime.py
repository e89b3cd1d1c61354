"""Runtime benchmark: per example (the bundled ones and a Hugging Face GPT-2 trained with
``transformers.Trainer``, benchmarks/scripts/hf_gpt2.py), in one interleaved run: plain training,
a plan that evicts nothing (the traced peak as budget), a capuchin plan at 50% of the traced peak
(or, where the planner proves that infeasible, at the smallest budget it reaches), and
``torch.utils.checkpoint`` with about sqrt(n) segments, each at its own measured peak; and the
tracker's per-op cost.

    python benchmarks/runtime.py [--steps 6] [--repeats 3] [--examples cnn,transformer,mlp,hf_gpt2]
    python benchmarks/runtime.py --examples mlp --real nanogpt,hf_t5,hf_llama_ckpt \
        --script-args "--batch 16"

``--real``: scripts of tests/frameworks/ (nanoGPT, a Hugging Face T5, a Llama with gradient
checkpointing, ...), each traced afresh and timed as benchmarks/plain_prediction.py does (its
table: the plan's predicted slowdown of the plain step against the measured one).

Peaks are PyTorch's CPU allocator accounting (profiler "Total Allocated", max over the steady
iterations; Note [Measured peak] in runtime/report.py). Times are the median steady iteration,
best of ``--repeats`` rounds that interleave the variants, measured without the profiler.

The predicted time of a plan is the simulator's device time scaled to this run's clock plus the
runtime's own cost: ``plain x (predicted_time_ns - runtime_cost_ns) / baseline_time_ns +
runtime_cost_ns`` (planner/costs.py). The scaling is there because a trace's op durations are
measured under the tracer's profiler on whatever load the host had then (the bundled traces'
iterations last 2-9x what plain training measures here); the runtime's cost is in absolute time.
The host is shared and noisy: compare rows of one run only.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import statistics
import sys
import time
import types
from pathlib import Path

import capuchin
import torch
from capuchin.planner.build import build_plan
from capuchin.planner.plan import Plan
from capuchin.planner.problem import Problem
from capuchin.runmain import run_as_main, script_environment
from capuchin.runtime.device import run_non_tensor_bytes
from capuchin.runtime.engine import Runtime
from capuchin.runtime.report import MemoryMeter
from capuchin.tracer.reader import load_trace
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

TRACES = Path(__file__).resolve().parent.parent / "traces"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
MIB = 2**20
DEVICE = "cpu"  # --device: where the bundled examples train (cuda: traced there first)


# ---- running a script with a variant --------------------------------------------------------------


def _run(script: Path, argv: list[str], prepare=None, context=None) -> None:
    """Run the script's ``main`` (its module loaded under another name, so ``prepare(globals)`` can
    swap a class before it trains) inside ``context``."""
    g = run_as_main(script, argv, run_name="capuchin_bench")
    if prepare is not None:
        prepare(g)
    with (
        script_environment(script, argv),
        contextlib.redirect_stdout(io.StringIO()),
        context or contextlib.nullcontext(),
    ):
        g["main"]()


class _Steps:
    """Optimizer-step timestamps and, optionally, per-iteration peaks (profiler)."""

    def __init__(self, profile: bool):
        self.meter = MemoryMeter(torch.device(DEVICE)) if profile else None
        self.t: list[float] = []

    def __enter__(self):
        if self.meter is not None and self.meter.device.type == "cuda":
            # tensor bytes, as a run's peaks (Note [Measured peak] in runtime/report.py): the
            # workspaces made first and taken off, by the runtime's own rule
            self.meter.non_tensor_bytes = run_non_tensor_bytes(self.meter.device)
        if self.meter is not None:
            self.meter.start()
            self.meter.iteration_start(0)
        self.h = register_optimizer_step_post_hook(self._hook)
        self.t.append(time.perf_counter())
        return self

    def _hook(self, *a):
        n = len(self.t) - 1
        self.t.append(time.perf_counter())
        if self.meter is not None:
            self.meter.iteration_end(n)
            self.meter.iteration_start(n + 1)

    def __exit__(self, *exc):
        self.h.remove()
        self.peaks = self.meter.finish() if self.meter is not None else {}

    def steady_time_s(self) -> float:
        d = [b - a for a, b in zip(self.t, self.t[1:], strict=False)][1:]
        return statistics.median(d)

    def steady_peak(self) -> int:
        n = len(self.t) - 1
        return max(v for k, v in self.peaks.items() if 1 <= k < n)


def time_once(script, argv, prepare=None, context=None) -> float:
    """Median steady iteration time (s) of one run, without the profiler."""
    with _Steps(profile=False) as s:
        _run(script, argv, prepare, context)
    return s.steady_time_s()


def peak_once(script, argv, prepare=None, context=None) -> int:
    """Max steady-iteration peak (bytes) of one run under the profiler."""
    with _Steps(profile=True) as s:
        _run(script, argv, prepare, context)
    return s.steady_peak()


def runtime_peak(script, argv, plan: Plan):
    rt = Runtime(plan, measure_memory=True)
    _run(script, argv, context=rt)
    steady = [x for x in rt.report.iterations if x.complete and x.iteration >= 1]
    return max(x.peak_bytes for x in steady), steady


# ---- the two PyTorch baselines ---------------------------------------------------------------------


def _checkpointed(g: dict) -> None:
    """sqrt(n) checkpointing without editing the script: ``nn.Sequential`` models run as about
    round(sqrt(len)) checkpointed segments; the transformer's blocks (its only
    repeated units) are each one checkpoint segment."""
    from torch.utils.checkpoint import checkpoint

    nn = g["nn"]

    class Seq(nn.Sequential):
        def forward(self, x):
            mods = list(self)
            if not torch.is_grad_enabled() or len(mods) < 2:
                return super().forward(x)
            # cut before modules that do not work in place (a segment starting with ReLU(inplace)
            # would modify the saved segment input), about sqrt(n) segments
            cuts = [i for i, m in enumerate(mods) if i > 0 and not getattr(m, "inplace", False)]
            n_seg = max(1, round(math.sqrt(len(mods))))
            step = max(1, len(cuts) // n_seg)
            bounds = [0, *cuts[step - 1 :: step][: n_seg - 1], len(mods)]
            for a, b in zip(bounds, bounds[1:], strict=False):
                seg = nn.Sequential(*mods[a:b])
                x = checkpoint(seg, x, use_reentrant=False)
            return x

    g["nn"] = types.SimpleNamespace(
        **{k: getattr(nn, k) for k in dir(nn) if not k.startswith("__")}
    )
    g["nn"].Sequential = Seq
    if "Block" in g:
        block = g["Block"]
        fwd = block.forward

        def forward(self, x):
            return checkpoint(fwd, self, x, use_reentrant=False)

        block.forward = forward
    g["main"].__globals__.update(g)


# ---- the tracker's per-op cost ---------------------------------------------------------------------


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def per_op_us(n: int = 20000) -> dict[str, float]:
    """µs per ``torch.add`` of two 16-float tensors: no mode, a passthrough mode, the runtime's hot
    path (a plan of n adds with no action), its slow path (the same plan with an action at every
    op: a prefetch of a storage that is not evicted, so the op pays the slow path's bookkeeping and
    no copy; planner/costs.py ``slow_op_ns``), and passive mode (no plan, a budget: every op
    inspected and its outputs tracked by the default dynamic guard)."""
    a, b = torch.ones(16), torch.ones(16)
    add = torch.ops.aten.add.Tensor

    def loop():
        t0 = time.perf_counter()
        for _ in range(n):
            add(a, b)
        return (time.perf_counter() - t0) / n * 1e6

    import capuchin.runtime.engine as engine

    plan = _add_plan(n + 1)
    acting = _add_plan(n + 1, acting=True)
    engine_empty = engine._empty
    engine._empty = lambda p: False  # measure the hot path: an empty plan installs nothing
    out = {}
    for name, ctx in (
        ("no mode", contextlib.nullcontext),
        ("passthrough mode", _Passthrough),
        ("runtime hot path", lambda: Runtime(plan, measure_memory=False)),
        ("runtime slow path", lambda: Runtime(acting, measure_memory=False)),
        ("passive mode", lambda: Runtime(budget_bytes=1 << 40, measure_memory=False)),
    ):
        best = math.inf
        for _ in range(3):
            with ctx():
                best = min(best, loop())
        out[name] = best
    engine._empty = engine_empty
    return out


def swap_cycle_ns_per_byte(sizes=(64 << 10, 2 << 20, 8 << 20), reps: int = 20) -> dict[int, float]:
    """Mean ns per byte moved of a swap-out and swap-in through the CPU backend, the runtime's own
    path: copy to a pooled host buffer on the copy thread, free the storage (``resize_(0)``),
    resize it back and copy in (planner/costs.py: ``swap_action_ns``, ``copy_ns_per_byte``)."""
    from capuchin.runtime.backend import backend_for
    from capuchin.runtime.state import resize

    be = backend_for("cpu")
    out = {}
    for n in sizes:
        st = torch.ones(n // 4).untyped_storage()
        buf = be.host_buffer(n)
        t0 = time.perf_counter()
        for _ in range(reps):
            c = be.copy_out(st, buf)
            c.wait()
            be.free_after_copy_out(st, c)
            resize(st, n)
            be.copy_in(buf, st).wait()
        out[n] = (time.perf_counter() - t0) / reps / (2 * n) * 1e9
    be.close()
    return out


def _add_plan(n: int, acting: bool = False) -> Plan:
    from capuchin.planner.plan import Action, Predictions, Provenance, Step

    prov = Provenance("none", {}, 1 << 30, "", "", 0, "cpu", 12e9, 12e9, "", 0.0)
    actions = [Action(k, Step.PREFETCH, "0:0") for k in range(n)] if acting else []
    return Plan(
        prov, Predictions(0, 0, 0, 0), [], [["aten.add.Tensor", "16;16"]] * n, actions=actions
    )


def _steady_malloc() -> None:
    """Fix glibc's mmap and trim thresholds. By default glibc maps large blocks with mmap and its
    threshold moves with the free pattern, so one variant's tensors are mapped, unmapped and
    page-faulted again every iteration while another's come from the heap: on this host that alone
    changed the same CNN iteration from ~25 ms to ~100 ms. Fixed thresholds give every variant the
    same allocator behaviour."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-3, 32 * MIB)  # M_MMAP_THRESHOLD (the largest allowed)
        libc.mallopt(-1, 1 << 31)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


# ---- main ------------------------------------------------------------------------------------------


def _example(name: str, tmp: Path):
    """(script, trace, sqrt(n) checkpointing as (prepare, extra argv)) of an example; the Hugging
    Face one is traced on first use (into ``tmp``)."""
    if name == "hf_gpt2":
        from capuchin.tracing import trace_script

        script = SCRIPTS / "hf_gpt2.py"
        trace = tmp / "hf_gpt2.trace.parquet"
        if not trace.exists():
            trace_script(script, ["--steps", "6"], output=trace, log=lambda _: None)
        return script, trace, (None, ["--gradient-checkpointing"])
    script = TRACES / f"{name}.py"
    if DEVICE == "cpu":
        return script, TRACES / f"{name}.trace.parquet", (_checkpointed, [])
    from capuchin.tracing import trace_script

    trace = tmp / f"{name}.{DEVICE}.trace.parquet"
    if not trace.exists():  # the bundled traces are CPU ones; 21 steps: the plain step and
        # the probe's rounds, whose differences a CUDA plan charges (Note [Host work on CUDA])
        trace_script(
            script, ["--steps", "21", "--device", DEVICE], output=trace, device="cuda", log=None
        )
    return script, trace, (_checkpointed, [])


def _plan(trace: Path, budget: str, policy: str = "capuchin") -> Plan:
    from capuchin.errors import InfeasibleBudgetError

    try:
        return capuchin.make_plan(trace, budget=budget, policy=policy)
    except InfeasibleBudgetError as exc:
        return capuchin.make_plan(trace, budget=exc.smallest_feasible_bytes, policy=policy)


def predicted_s(plan: Plan, plain_s: float) -> float:
    """The plan's predicted step time on this run's clock (see the module docstring)."""
    p = plan.predictions
    device = (p.predicted_time_ns - p.runtime_cost_ns) / p.baseline_time_ns
    return plain_s * device + p.runtime_cost_ns / 1e9


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--examples", default="cnn,transformer,mlp,hf_gpt2")
    ap.add_argument("--budget", default="50%")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (bundled examples only)")
    ap.add_argument(
        "--also",
        default=None,
        metavar="POLICY",
        help="one more variant: POLICY's plan at the same budget (e.g. capuchin-ls)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads (default 1: on an oversubscribed host, 2 OpenMP threads "
        "made the same iteration 1x-10x slower from one run to the next)",
    )
    ap.add_argument(
        "--default-malloc",
        action="store_true",
        help="keep glibc's dynamic mmap threshold (see _steady_malloc)",
    )
    ap.add_argument(
        "--real",
        default="",
        metavar="NAMES",
        help="scripts of tests/frameworks/ in the styles people write (e.g. "
        "nanogpt,hf_t5,hf_llama_ckpt), each traced afresh and planned at --budget, timed plain "
        "and managed as benchmarks/plain_prediction.py does; their table follows",
    )
    ap.add_argument(
        "--script-args", default="", help="more arguments for every --real script (--batch 16)"
    )
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    torch.set_num_threads(args.threads)
    if not args.default_malloc:
        _steady_malloc()
    argv = ["--steps", str(args.steps)] + (["--device", DEVICE] if DEVICE != "cpu" else [])
    tmp = Path(tempfile.mkdtemp(prefix="capuchin-bench-"))
    loads = [os.getloadavg()[0]]
    rows = []
    plans = {}
    for name in args.examples.split(","):
        script, trace, (ck_prep, ck_argv) = _example(name, tmp)
        prob = Problem.from_trace(load_trace(trace))
        plan = plans[name] = _plan(trace, args.budget)
        noop, _ = build_plan(prob, [], policy="none", budget_bytes=prob.peak_bytes)
        variants = {  # name -> (prepare, extra argv, context factory, plan)
            "plain": (None, [], lambda: None, None),
            "no-op plan": (None, [], lambda noop=noop: Runtime(noop, measure_memory=False), noop),
            "capuchin": (None, [], lambda plan=plan: Runtime(plan, measure_memory=False), plan),
            "checkpoint": (ck_prep, ck_argv, lambda: None, None),
        }
        if args.also:
            other = _plan(trace, args.budget, args.also)
            variants[args.also] = (
                None,
                [],
                lambda other=other: Runtime(other, measure_memory=False),
                other,
            )
        # The host is shared: interleave the variants round by round and keep each one's best.
        best = dict.fromkeys(variants, math.inf)
        for _ in range(args.repeats):
            for v, (prep, extra, ctx, _p) in variants.items():
                best[v] = min(best[v], time_once(script, argv + extra, prep, ctx()))
        loads.append(os.getloadavg()[0])
        plain_s = best["plain"]
        for v, (prep, extra, _ctx, p) in variants.items():
            if p is None:
                peak, stats = peak_once(script, argv + extra, prep), []
            else:
                peak, stats = runtime_peak(script, argv, p)
            pred = predicted_s(p, plain_s) if p is not None else None
            rows.append(
                (
                    name,
                    v,
                    p.budget_bytes if p is not None and p.decisions else None,
                    peak,
                    best[v],
                    best[v] / plain_s,
                    pred,
                    stats,
                )
            )
        print(f"{name}: done", file=sys.stderr)
    import datetime
    import subprocess

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
    ).stdout.strip()
    print(
        f"\n{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}; "
        f"plan budget {args.budget} of each trace's peak (or the smallest feasible); times "
        f"ms/iteration (median steady iteration, best of {args.repeats} interleaved rounds); "
        "peaks MiB (tensor bytes: on CUDA the allocator's less the cuBLAS workspaces; max over "
        f"steady iterations); {args.threads} intra-op "
        f"thread(s); load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs\n"
    )
    hdr = (
        "| example | variant | budget MiB | peak MiB | step ms | x plain | predicted ms | "
        "measured / predicted | stalls ms, late prefetches |"
    )
    print(hdr)
    print("|---" * (hdr.count("|") - 1) + "|")
    for name, v, bud, peak, t, ratio, pred, stats in rows:
        stall = (
            (
                f"{sum(s.stall_s for s in stats) / len(stats) * 1e3:.1f}, "
                f"{sum(s.late_prefetches for s in stats)}"
                f"{' (diverged)' if any(s.diverged for s in stats) else ''}"
            )
            if stats
            else ""
        )
        print(
            f"| {name} | {v} | {'' if bud is None else f'{bud / MIB:.1f}'} | {peak / MIB:.1f} | "
            f"{t * 1e3:.1f} | {ratio:.3f} | {'' if pred is None else f'{pred * 1e3:.1f}'} | "
            f"{'' if pred is None else f'{t / pred:.3f}'} | {stall} |"
        )
    print()
    # The swap cost a run implies (planner/costs.py swap_action_ns): what the model leaves
    # unexplained in each capuchin row, per swap and direction, plus the constant it used. It
    # absorbs every unmodelled cost of the row (so read it on a quiet host, across examples):
    # above the swap-cycle line below, it is the copy thread's wake-up and interpreter-lock
    # handoff while compute runs, which that line (an idle main thread) does not see.
    from capuchin.planner.costs import costs_for

    implied = []
    for name, v, _bud, _peak, t, _ratio, pred, _stats in rows:
        p = plans.get(name)
        swaps = sum(1 for d in p.decisions if d.method.value == "swap") if p else 0
        if v == "capuchin" and swaps:
            c = costs_for(p.provenance.device).swap_action_ns
            implied.append(f"{name} {((t - pred) * 1e9 / (2 * swaps) + c) / 1e3:.0f} µs")
    print(f"implied swap cost per direction: {', '.join(implied)}")
    if args.real:  # measured/predicted on real-style scripts (benchmarks/plain_prediction.py)
        import plain_prediction

        real = (args.real.split(","), args.budget, args.repeats, args.steps, args.script_args)
        rows, real_loads = plain_prediction.measure(*real)
        plain_prediction.print_table(rows, real_loads, *real[1:])
        print()
    if DEVICE != "cpu":
        return  # the per-op and swap-cycle costs below are the CPU backend's
    for k, v in per_op_us().items():
        print(f"per-op cost, {k}: {v:.2f} µs")
    for n, v in swap_cycle_ns_per_byte().items():
        print(
            f"swap cycle, {n >> 10} KiB: {v:.2f} ns per byte moved ({v * n / 1e3:.0f} µs per "
            "direction)"
        )


if __name__ == "__main__":
    main()
