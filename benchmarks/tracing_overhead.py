"""Tracing overhead: iteration time of each bundled example untraced vs traced, in one process.

    python benchmarks/tracing_overhead.py [--rounds 3] [--csv out.csv]

For each example script (traces/*.py) and each round, two runs in the same process, one after the
other so that both see the same machine load:
  * untraced: the script alone (iterations 2..7 timed);
  * traced: the script under ``capuchin.Tracer(warmup=3, iterations=4)``. Its warm-up iterations
    1-2 run the dispatch mode and the op indexer only ("indexed": what a runtime pays per op);
    recorded iterations 4-6 add the profiler with memory events, the record_function markers and
    the per-access rows ("traced"; iteration 3, where the profiler starts, is not counted).
An iteration's time is the interval between two optimizer step post-hooks. The table shows the
best (minimum) iteration time of each kind over all rounds: on a shared, loaded host the minimum
estimates the intrinsic cost far better than a mean or median (other jobs only ever add time).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import capuchin
from capuchin.tracer.script import run_script

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ["cnn", "transformer", "mlp"]


class _StepClock:
    def __init__(self):
        self.times: list[float] = []
        self.handle = register_optimizer_step_post_hook(lambda *a: self.times.append(time.perf_counter()))

    def intervals(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]  # [i-1] = iteration i

    def close(self):
        self.handle.remove()


def _quiet():
    return contextlib.redirect_stdout(io.StringIO())


def untraced(script: Path) -> list[float]:
    clock = _StepClock()
    try:
        with _quiet():
            run_script(script, ["--steps", "8"])
    finally:
        clock.close()
    return clock.intervals()[1:7]  # iterations 2..7


def traced(script: Path, out: Path) -> tuple[list[float], list[float], int]:
    clock = _StepClock()
    try:
        with _quiet(), capuchin.Tracer(out, iterations=4, warmup=3, device="cpu", force=True,
                                       log=None):
            run_script(script, ["--steps", "20"])
    finally:
        clock.close()
    iv = clock.intervals()
    ops = capuchin.load_trace(out).ops
    n_ops = int((ops["iteration"] == ops["iteration"].max()).sum())
    return iv[0:2], iv[3:6], n_ops  # iterations 1-2 (indexed), 4-6 (traced)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--csv", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in EXAMPLES:
            script = ROOT / "traces" / f"{name}.py"
            base, idx, rec = [], [], []
            n_ops = 0
            for _ in range(args.rounds):
                base += untraced(script)
                i, r, n_ops = traced(script, Path(tmp) / f"{name}.parquet")
                idx += i
                rec += r
            b, i, r = (min(x) * 1e3 for x in (base, idx, rec))
            rows.append((name, n_ops, b, i, r))
            print(f"  {name}: done", file=sys.stderr)
    header = ("| example | ops / iteration | untraced ms | indexed ms (ratio) | traced ms (ratio) |\n"
              "|---|---|---|---|---|")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds, "
          "median iteration time")
    print(header)
    for name, n_ops, b, i, r in rows:
        print(f"| {name} | {n_ops} | {b:.1f} | {i:.1f} ({i / b:.2f}x) | {r:.1f} ({r / b:.2f}x) |")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("example,ops_per_iteration,untraced_ms,indexed_ms,traced_ms\n")
            for row in rows:
                f.write(",".join(str(round(x, 3)) if isinstance(x, float) else str(x)
                                 for x in row) + "\n")


if __name__ == "__main__":
    main()
