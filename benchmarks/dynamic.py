"""Dynamic mode benchmark: at 80/60/50% of each workload's traced peak, the measured step time and
peak of dynamic mode (DTR in the runtime, no plan), of the capuchin plan (``make_plan`` policy
``capuchin`` on the workload's trace), and of the LRU passive mode (synchronous swap of the least
recently used storage, ``eviction="lru"``); plus the simulated ``dtr`` policy's predicted
overhead on the same trace, next to the real one.

    python benchmarks/dynamic.py [--steps 5] [--percents 80,60,50] [--workloads cnn,bert,...]
                                 [--repeats 2] [--modes dynamic,lru,plan]

Workloads: the bundled examples (traces/*.py with their traces) and two third-party models built
from tiny configs with random weights (Hugging Face BERT masked LM and GPT-2 causal LM, dropout
active), traced here first. Step time: the median interval between optimizer steps after the
first two steps, measured without the profiler, best of ``--repeats`` rounds; each round runs
plain training (no capuchin) and every mode back to back, so "x plain" compares runs made under
the same load. Peak: PyTorch's CPU allocator accounting (Note [Measured peak] in
runtime/report.py), the maximum over the steady iterations, in one more run with the profiler
on, which also gives the bytes swapped out and the ops replayed per iteration (counts that the
host's load does not change). The host is shared and noisy: compare rows of one run only; the
load average is printed with the table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import capuchin
import torch
from capuchin.errors import InfeasibleBudgetError
from capuchin.planner.problem import Problem
from capuchin.runtime.engine import Runtime
from capuchin.testing.training import TRACES, run_example
from capuchin.tracer.reader import load_trace
from torch.optim.optimizer import register_optimizer_step_post_hook

MIB = 2**20
DEVICE = "cpu"  # --device: where the workloads train and what the runtime manages


# ---- workloads ------------------------------------------------------------------------------------


def _bundled(name: str):
    def train(steps: int, context=None) -> None:
        dev = ["--device", DEVICE] if DEVICE != "cpu" else []
        run_example(TRACES / f"{name}.py", ["--steps", str(steps), *dev], context)

    return train


def _hf(kind: str):
    def train(steps: int, context=None) -> None:
        import transformers

        transformers.logging.set_verbosity_error()
        on = torch.device(DEVICE) if DEVICE != "cpu" else contextlib.nullcontext()
        with on, context or contextlib.nullcontext():
            torch.manual_seed(0)
            if kind == "bert":
                cfg = transformers.BertConfig(
                    vocab_size=1000,
                    hidden_size=128,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    intermediate_size=512,
                    max_position_embeddings=128,
                    hidden_dropout_prob=0.1,
                    attention_probs_dropout_prob=0.1,
                )
                model = transformers.BertForMaskedLM(cfg)
            else:
                cfg = transformers.GPT2Config(
                    vocab_size=1000, n_positions=128, n_embd=128, n_layer=2, n_head=4
                )
                model = transformers.GPT2LMHeadModel(cfg)
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for _ in range(steps):
                ids = torch.randint(0, 1000, (8, 128))
                out = model(input_ids=ids, labels=ids)
                opt.zero_grad()
                out.loss.backward()
                opt.step()

    return train


WORKLOADS = {
    "cnn": _bundled("cnn"),
    "transformer": _bundled("transformer"),
    "mlp": _bundled("mlp"),
    "bert": _hf("bert"),
    "gpt2": _hf("gpt2"),
}


def trace_of(name: str, tmp: Path) -> Path:
    bundled = TRACES / f"{name}.trace.parquet"
    if bundled.exists() and DEVICE == "cpu":
        return bundled
    out = tmp / f"{name}.trace.parquet"
    with (
        contextlib.redirect_stdout(io.StringIO()),
        capuchin.Tracer(out, iterations=2, warmup=1, device=DEVICE.split(":")[0], log=None),
    ):
        WORKLOADS[name](4)
    return out


# ---- measuring ------------------------------------------------------------------------------------


def step_time_s(train, steps: int, make_runtime=None) -> tuple[float, float]:
    """Median optimizer-step interval after the first two steps (no profiler): wall-clock and
    this process's CPU time (all its threads: compute, copies, bookkeeping; what other processes
    on a shared host take is not in it, what waiting costs is not either)."""
    stamps: list[tuple[float, float]] = []
    h = register_optimizer_step_post_hook(
        lambda *a: stamps.append((time.perf_counter(), time.process_time()))
    )
    try:
        train(steps, make_runtime(False) if make_runtime else None)
    finally:
        h.remove()
    pairs = list(zip(stamps[1:], stamps[2:], strict=False))
    if not pairs:
        return float("nan"), float("nan")
    return (
        statistics.median(b[0] - a[0] for a, b in pairs),
        statistics.median(b[1] - a[1] for a, b in pairs),
    )


def measured(make_runtime, train, steps: int) -> dict:
    rt = make_runtime(True)
    train(steps, rt)
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
    return {
        "peak": max(s.peak_bytes for s in its),
        "short": max(s.passive_short_bytes for s in its),
        "evictions": sum(s.passive_evictions + s.evictions for s in its) / len(its),
        "swapped": sum(s.swapped_out_bytes for s in its) / len(its),
        "drops": sum(s.dynamic_drops for s in its) / len(its),
        "replayed": sum(s.recomputed_ops for s in its) / len(its),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--percents", default="80,60,50")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--modes", default="dynamic,lru,plan", help="which of dynamic,lru,plan to run (and plain)"
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    wanted = set(args.modes.split(","))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads.split(","):
            train = WORKLOADS[name]
            trace = trace_of(name, Path(tmp))
            problem = Problem.from_trace(load_trace(trace))
            peak = problem.peak_bytes
            for pct in (int(p) for p in args.percents.split(",")):
                budget = peak * pct // 100
                modes = {
                    "dynamic": lambda m, b=budget: Runtime(
                        budget_bytes=b, measure_memory=m, device=DEVICE
                    ),
                    "lru": lambda m, b=budget: Runtime(
                        budget_bytes=b, measure_memory=m, eviction="lru", device=DEVICE
                    ),
                }
                note = ""
                try:
                    if "plan" in wanted:
                        plan = capuchin.make_plan(problem, budget=budget, policy="capuchin")
                        modes["plan"] = lambda m, p=plan: Runtime(p, measure_memory=m)
                except InfeasibleBudgetError as exc:
                    note = f"plan infeasible (smallest {exc.smallest_feasible_bytes / MIB:.1f} MiB)"
                modes = {k: v for k, v in modes.items() if k in wanted}
                try:
                    sim = capuchin.make_plan(
                        problem, budget=budget, policy="dtr", allow_infeasible=True
                    ).predictions
                    sim_x = 1 + sim.predicted_overhead
                except Exception as exc:  # the simulated policy may fail at low budgets
                    sim_x = float("nan")
                    note += f" dtr sim: {type(exc).__name__}"
                wall = {mode: float("inf") for mode in ("plain", *modes)}
                cpu = dict(wall)
                for _ in range(args.repeats):  # interleaved rounds, best of each
                    for mode in wall:
                        w, c = step_time_s(train, args.steps, modes.get(mode))
                        wall[mode], cpu[mode] = min(wall[mode], w), min(cpu[mode], c)
                for mode, make in modes.items():
                    m = measured(make, train, args.steps)
                    m["cpu"] = cpu[mode]
                    m["cpu_x"] = cpu[mode] / cpu["plain"]
                    t = wall[mode]
                    rows.append((name, pct, budget, mode, t, t / wall["plain"], m, sim_x, note))
                    print(_fmt(rows[-1]), file=sys.stderr, flush=True)
    load = os.getloadavg()
    print(
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; torch {torch.__version__}; "
        f"threads {torch.get_num_threads()}; steps {args.steps}"
    )
    print(_HEADER)
    for r in rows:
        print(_fmt(r))


_HEADER = (
    "| workload | budget | mode | step ms | x plain | CPU ms | CPU x plain | peak MiB | "
    "peak/budget | "
    "short MiB | evictions/it | drops/it | swapped MiB/it | replayed ops/it | "
    "dtr sim x | note |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _fmt(r) -> str:
    name, pct, budget, mode, t, x, m, sim_x, note = r
    return (
        f"| {name} | {pct}% ({budget / MIB:.1f} MiB) | {mode} | {t * 1e3:.1f} | {x:.2f} | "
        f"{m['cpu'] * 1e3:.1f} | {m['cpu_x']:.2f} | "
        f"{m['peak'] / MIB:.1f} | {m['peak'] / budget:.2f} | {m['short'] / MIB:.1f} | "
        f"{m['evictions']:.0f} | {m['drops']:.0f} | {m['swapped'] / MIB:.1f} | "
        f"{m['replayed']:.0f} | {sim_x:.2f} | "
        f"{note} |"
    )


if __name__ == "__main__":
    main()
