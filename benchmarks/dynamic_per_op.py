"""The budget guard's own cost per op, with nothing evicted: LRU passive mode, dynamic mode in an
iteration that does not record (``remat="swap"``: it never records) and dynamic mode recording
(the first two iterations, probes, and iterations after drops that paid: Note [Recording only
while replay pays] in runtime/guards/dtr.py).

    python benchmarks/dynamic_per_op.py [--rounds 7] [--ops 600] [--workloads cnn,transformer]
                                        [--percents 80,50] [--steps 7]

Then, on each bundled workload at each budget (shares of its traced peak), the guard's CPU time
per steady step (iterations 2 and later; nothing records there unless drops paid): the thread CPU
time inside the guard's ``before_op`` and ``after_op`` and the executor's on-demand restores (LRU
mode restores outside the guard; dynamic mode inside ``before_op``), best of ``--rounds`` rounds
with the modes interleaved; with the evictions per step.

The ops: ``c = a @ w`` (a new storage), ``c.relu_()`` (in place: extends c's chain), ``d = c + b``,
on 4x8 floats, the outputs kept alive to the end of the loop (as a forward pass keeps its
activations); the budget is 1 TiB so nothing is evicted; the garbage collector is off inside the
timed loop (its collections depend on the whole process's history). µs of this process's CPU time
per op, best and median of ``--rounds`` rounds, the modes interleaved in each round.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import statistics
import time

import torch
from capuchin.planner.problem import Problem
from capuchin.runtime import tracker
from capuchin.runtime.engine import Runtime
from capuchin.runtime.guards import dtr as dynamic
from capuchin.runtime.guards import lru as passive
from capuchin.testing.training import TRACES, run_example
from capuchin.tracer.reader import load_trace
from torch.optim.optimizer import register_optimizer_step_post_hook

MODES = {
    "lru": {"eviction": "lru"},
    "dtr, not recording": {"remat": "swap"},
    "dtr, recording": {},
}


def loop(n: int) -> float:
    a, w, b = torch.ones(4, 8), torch.ones(8, 8), torch.ones(4, 8)
    mm, relu_, add = (
        torch.ops.aten.mm.default,
        torch.ops.aten.relu_.default,
        torch.ops.aten.add.Tensor,
    )
    keep = []
    gc.disable()
    try:
        t0 = time.process_time()
        for _ in range(n // 3):
            c = mm(a, w)
            relu_(c)
            keep.append(add(c, b))
            keep.append(c)
        return (time.process_time() - t0) / (3 * (n // 3)) * 1e6
    finally:
        gc.enable()


class _GuardClock:
    """Thread CPU time inside the guard's hooks and the executor's restores (outermost call only),
    from the second optimizer step on."""

    def __init__(self):
        self.on = False
        self.total = 0.0
        self._depth = 0
        self._saved = []
        for cls in (passive.BudgetGuard, dynamic.DynamicGuard):
            for name in ("before_op", "after_op"):
                self._wrap(cls, name)
        self._wrap(tracker.Executor, "restore")

    def _wrap(self, cls, name):
        f = cls.__dict__[name]
        self._saved.append((cls, name, f))

        def timed(*a, **k):
            if not self.on or self._depth:
                return f(*a, **k)
            self._depth += 1
            t0 = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                self.total += time.thread_time() - t0
                self._depth -= 1

        setattr(cls, name, timed)

    def close(self):
        for cls, name, f in self._saved:
            setattr(cls, name, f)


def guard_ms_per_step(name: str, budget: int, eviction: str, steps: int) -> tuple[float, float]:
    clock = _GuardClock()
    seen = [0]

    def hook(*_):
        seen[0] += 1
        if seen[0] == 2:
            clock.on = True

    h = register_optimizer_step_post_hook(hook)
    rt = Runtime(budget_bytes=budget, measure_memory=False, eviction=eviction)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            run_example(TRACES / f"{name}.py", ["--steps", str(steps)], rt)
    finally:
        h.remove()
        clock.close()
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 2]
    evictions = sum(s.passive_evictions for s in its) / max(1, len(its))
    return clock.total / (steps - 2) * 1e3, evictions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ops", type=int, default=600)
    ap.add_argument("--workloads", default="cnn,transformer")
    ap.add_argument("--percents", default="80,50")
    ap.add_argument("--steps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    got: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode, kw in MODES.items():
            with Runtime(budget_bytes=1 << 40, measure_memory=False, **kw):
                got[mode].append(loop(args.ops))
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; torch {torch.__version__}")
    for mode, v in got.items():
        print(f"{mode}: {min(v):.2f} µs/op best, {statistics.median(v):.2f} median")
    for name in args.workloads.split(",") if args.workloads else ():
        peak = Problem.from_trace(load_trace(TRACES / f"{name}.trace.parquet")).peak_bytes
        for pct in (int(p) for p in args.percents.split(",")):
            best = {"dtr": (float("inf"), 0.0), "lru": (float("inf"), 0.0)}
            for _ in range(args.rounds):
                for mode in best:
                    ms, ev = guard_ms_per_step(name, peak * pct // 100, mode, args.steps)
                    best[mode] = min(best[mode], (ms, ev))
            print(
                f"{name} {pct}%: guard CPU ms per steady step (evictions/step): "
                + ", ".join(f"{m} {ms:.2f} ({ev:.0f})" for m, (ms, ev) in best.items())
            )


if __name__ == "__main__":
    main()
