"""Tracing overhead: iteration time of each bundled example untraced vs traced, in one process.

    python benchmarks/tracing_overhead.py [--rounds 3] [--threads 1] [--csv out.csv]

For each example script (traces/*.py) and each round, two runs in the same process, one after the
other so that both see the same machine load:
  * untraced: the script alone (iterations 2..7 timed);
  * traced: the script under ``capuchin.Tracer(warmup=3, iterations=4)``. Its warm-up iterations
    1-2 run the dispatch mode and the op indexer only ("indexed": what a runtime pays per op);
    recorded iterations 4-6 add the profiler with memory events, the record_function markers and
    the per-access rows ("traced"; iteration 3, where the profiler starts, is not counted).
An iteration's time is the interval between two optimizer step post-hooks, as wall time and as
this process's CPU time (all its threads). The table shows the best (minimum) of each over all
rounds: on a shared, loaded host the minimum estimates the intrinsic cost far better than a mean or
median (other jobs only ever add time), and CPU time is less disturbed by them than wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path

import capuchin
import torch
from capuchin.runmain import run_as_main
from torch.optim.optimizer import register_optimizer_step_post_hook

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ["cnn", "transformer", "mlp"]


class _StepClock:
    """Wall and process-CPU time at every optimizer step end."""

    def __init__(self):
        self.times: list[tuple[float, float]] = []
        self.handle = register_optimizer_step_post_hook(
            lambda *a: self.times.append((time.perf_counter(), time.process_time()))
        )

    def intervals(self) -> list[tuple[float, float]]:
        """[i-1] = (wall s, CPU s) of iteration i."""
        return [
            (b[0] - a[0], b[1] - a[1]) for a, b in zip(self.times, self.times[1:], strict=False)
        ]

    def close(self):
        self.handle.remove()


def _quiet():
    return contextlib.redirect_stdout(io.StringIO())


def untraced(script: Path) -> list[tuple[float, float]]:
    clock = _StepClock()
    try:
        with _quiet():
            run_as_main(script, ["--steps", "8"])
    finally:
        clock.close()
    return clock.intervals()[1:7]  # iterations 2..7


def traced(script: Path, out: Path) -> tuple[list, list, int]:
    clock = _StepClock()
    try:
        with (
            _quiet(),
            capuchin.Tracer(out, iterations=4, warmup=3, device="cpu", force=True, log=None),
        ):
            run_as_main(script, ["--steps", "20"])
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
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: steadier on a shared host; "
        "OpenMP spin-waits inflate CPU time under contention)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
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
            wall = [min(x[0] for x in v) * 1e3 for v in (base, idx, rec)]
            cpu = [min(x[1] for x in v) * 1e3 for v in (base, idx, rec)]
            rows.append((name, n_ops, *wall, *cpu))
            print(f"  {name}: done", file=sys.stderr)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds, "
        "best iteration time in ms (ratio to untraced)"
    )
    print(
        "| example | ops / iteration | untraced wall | indexed wall | traced wall "
        "| untraced CPU | indexed CPU | traced CPU |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, n_ops, bw, iw, rw, bc, ic, rc in rows:
        print(
            f"| {name} | {n_ops} | {bw:.0f} | {iw:.0f} ({iw / bw:.2f}x) | {rw:.0f} ({rw / bw:.2f}x) "
            f"| {bc:.0f} | {ic:.0f} ({ic / bc:.2f}x) | {rc:.0f} ({rc / bc:.2f}x) |"
        )
    if args.csv:
        with open(args.csv, "w") as f:
            f.write(
                "example,ops_per_iteration,untraced_wall_ms,indexed_wall_ms,traced_wall_ms,"
                "untraced_cpu_ms,indexed_cpu_ms,traced_cpu_ms\n"
            )
            for row in rows:
                f.write(
                    ",".join(f"{x:.3f}" if isinstance(x, float) else str(x) for x in row) + "\n"
                )


if __name__ == "__main__":
    main()
