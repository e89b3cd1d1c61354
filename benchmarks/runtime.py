"""Runtime benchmark: per bundled example at 50% of the traced peak, the baseline, capuchin
(``make_plan`` policy ``capuchin``), ``torch.utils.checkpoint`` (sqrt(n) segments) and
``torch.autograd.graph.save_on_cpu``, each at its own measured peak; the overhead of a plan that
evicts nothing; and the tracker's per-op cost.

    python benchmarks/runtime.py [--steps 5] [--repeats 2] [--examples cnn,transformer,mlp]

Peaks are PyTorch's CPU allocator accounting (profiler "Total Allocated", max over the steady
iterations; Note [Measured peak] in runtime/report.py). Times are the median steady iteration,
best of ``--repeats`` runs, measured without the profiler. The host is shared and noisy: compare
rows of one run only.
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
from capuchin.runtime.engine import Runtime
from capuchin.runtime.report import MemoryMeter
from capuchin.tracer.reader import load_trace
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

TRACES = Path(__file__).resolve().parent.parent / "traces"
MIB = 2**20


# ---- running a script with a variant --------------------------------------------------------------


def _run(script: Path, argv: list[str], prepare=None, context=None) -> None:
    """Run the script's ``main`` (its module loaded under another name, so ``prepare(globals)`` can
    swap a class before it trains) inside ``context``."""
    g = run_as_main(script, argv, run_name="capuchin_bench")
    if prepare is not None:
        prepare(g)
    with script_environment(script, argv), contextlib.redirect_stdout(io.StringIO()), \
            (context or contextlib.nullcontext()):
        g["main"]()


class _Steps:
    """Optimizer-step timestamps and, optionally, per-iteration peaks (profiler)."""

    def __init__(self, profile: bool):
        self.meter = MemoryMeter(torch.device("cpu")) if profile else None
        self.t: list[float] = []

    def __enter__(self):
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
            bounds = [0, *cuts[step - 1::step][: n_seg - 1], len(mods)]
            for a, b in zip(bounds, bounds[1:], strict=False):
                seg = nn.Sequential(*mods[a:b])
                x = checkpoint(seg, x, use_reentrant=False)
            return x

    g["nn"] = types.SimpleNamespace(**{k: getattr(nn, k) for k in dir(nn) if not k.startswith("__")})
    g["nn"].Sequential = Seq
    if "Block" in g:
        block = g["Block"]
        fwd = block.forward

        def forward(self, x):
            return checkpoint(fwd, self, x, use_reentrant=False)

        block.forward = forward
    g["main"].__globals__.update(g)


def _save_on_cpu():
    return torch.autograd.graph.save_on_cpu(pin_memory=False)


# ---- the tracker's per-op cost ---------------------------------------------------------------------


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def per_op_us(n: int = 20000) -> dict[str, float]:
    """µs per ``torch.add`` of two 16-float tensors: no mode, a passthrough mode, the runtime's hot
    path (a plan of n adds with no action), its slow path (passive mode: every op inspected)."""
    a, b = torch.ones(16), torch.ones(16)
    add = torch.ops.aten.add.Tensor

    def loop():
        t0 = time.perf_counter()
        for _ in range(n):
            add(a, b)
        return (time.perf_counter() - t0) / n * 1e6

    plan = _add_plan(n + 1)
    out = {}
    for name, ctx in (("no mode", contextlib.nullcontext), ("passthrough mode", _Passthrough),
                      ("runtime hot path", lambda: Runtime(plan, measure_memory=False)),
                      ("runtime slow path", lambda: Runtime(budget_bytes=1 << 40,
                                                            measure_memory=False))):
        best = math.inf
        for _ in range(3):
            with ctx():
                best = min(best, loop())
        out[name] = best
    return out


def _add_plan(n: int) -> Plan:
    from capuchin.planner.plan import Predictions, Provenance

    prov = Provenance("none", {}, 1 << 30, "", "", 0, "cpu", 12e9, 12e9, "", 0.0)
    return Plan(prov, Predictions(0, 0, 0, 0), [], [["aten.add.Tensor", "16;16"]] * n)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--examples", default="cnn,transformer,mlp")
    ap.add_argument("--budget", default="50%")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (default 1: on an oversubscribed host, 2 OpenMP threads "
                         "made the same iteration 1x-10x slower from one run to the next)")
    ap.add_argument("--default-malloc", action="store_true",
                    help="keep glibc's dynamic mmap threshold (see _steady_malloc)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not args.default_malloc:
        _steady_malloc()
    argv = ["--steps", str(args.steps)]
    rows = []
    for name in args.examples.split(","):
        script = TRACES / f"{name}.py"
        trace = TRACES / f"{name}.trace.parquet"
        prob = Problem.from_trace(load_trace(trace))
        plan = capuchin.make_plan(trace, budget=args.budget, policy="capuchin",
                                  allow_infeasible=True)
        noop, _ = build_plan(prob, [], policy="none", budget_bytes=prob.peak_bytes)
        variants = {  # name -> (prepare, context factory)
            "baseline": (None, lambda: None),
            "capuchin": (None, lambda plan=plan: Runtime(plan, measure_memory=False)),
            "noop": (None, lambda noop=noop: Runtime(noop, measure_memory=False)),
            "checkpoint": (_checkpointed, lambda: None),
            "save_on_cpu": (None, _save_on_cpu),
        }
        # The host is shared: interleave the variants round by round and keep each one's best.
        best = dict.fromkeys(variants, math.inf)
        for _ in range(args.repeats):
            for v, (prep, ctx) in variants.items():
                best[v] = min(best[v], time_once(script, argv, prep, ctx()))
        base_t, cap_t, noop_t, ck_t, soc_t = (best[v] for v in variants)
        base_p = peak_once(script, argv)
        cap_p, steady = runtime_peak(script, argv, plan)
        noop_p, _ = runtime_peak(script, argv, noop)
        ck_p = peak_once(script, argv, _checkpointed)
        soc_p = peak_once(script, argv, context=_save_on_cpu())
        pred = plan.predictions.predicted_peak_bytes
        rows.append((name, plan.budget_bytes, plan.predictions.feasible, pred, base_t, base_p,
                     cap_t, cap_p, ck_t, ck_p, soc_t, soc_p, noop_t, noop_p,
                     sum(s.stall_s for s in steady) / len(steady),
                     sum(s.late_prefetches for s in steady), any(s.diverged for s in steady)))
        print(f"{name}: done", file=sys.stderr)
    print(f"\nbudget {args.budget} of each trace's peak; times ms/iteration (median steady "
          f"iteration, best of {args.repeats} interleaved rounds); peaks MiB (allocator, max over "
          f"steady iterations); {args.threads} intra-op thread(s); "
          f"{'default' if args.default_malloc else 'fixed'} malloc thresholds; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n")
    hdr = ("| example | budget | plan predicts | baseline | capuchin | capuchin / budget | "
           "measured / predicted | stalls, late prefetches | checkpoint sqrt(n) | save_on_cpu | "
           "no-op plan overhead |")
    print(hdr)
    print("|---" * (hdr.count("|") - 1) + "|")
    for (name, bud, feas, pred, bt, bp, ct, cp, kt, kp, st, sp, nt, npk, stall, late, div) in rows:
        print(f"| {name} | {bud / MIB:.1f}{'' if feas else ' (infeasible)'} | {pred / MIB:.1f} | "
              f"{bp / MIB:.1f} MiB, {bt * 1e3:.0f} ms | {cp / MIB:.1f} MiB, {ct * 1e3:.0f} ms | "
              f"{cp / bud:.2f} | {cp / pred:.3f}{' (diverged!)' if div else ''} | "
              f"{stall * 1e3:.1f} ms, {late} | {kp / MIB:.1f} MiB, {kt * 1e3:.0f} ms | "
              f"{sp / MIB:.1f} MiB, {st * 1e3:.0f} ms | {nt / bt - 1:+.1%} (peak {npk / MIB:.1f}) |")
    print()
    for k, v in per_op_us().items():
        print(f"per-op cost, {k}: {v:.2f} µs")


if __name__ == "__main__":
    main()
