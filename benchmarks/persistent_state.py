"""Parameters, gradients and optimizer state as swap candidates across the iteration boundary:
the smallest budget the ``capuchin`` policy reaches with and without them, and a run at that
budget on a Hugging Face BERT masked LM (benchmarks/bert_mlm.py: 4 layers, hidden 256, batch 8,
sequence 128, AdamW), measured and compared bitwise with training without capuchin.

    python benchmarks/persistent_state.py                  # bundled traces + BERT (traced here)
    python benchmarks/persistent_state.py --no-run         # the table only
    python benchmarks/persistent_state.py --traces a.trace.parquet --no-bert
    python benchmarks/persistent_state.py --bert-budget 500084744   # the BERT run only
    python benchmarks/persistent_state.py --optimizers     # mlp: AdamW loop / foreach / fused

"Before" is the same planner with ``Problem.persistent_candidates`` off (``restricted()``:
activations and inputs only, as planning was before); "after" with them. The smallest feasible
budget is ``planner.api.smallest_feasible_budget`` (the floor first, then bisection towards the
peak, 10 steps), verified by the simulator. The BERT run uses the plan at the "after" budget and
reports the steady iterations' measured peak (PyTorch's allocator accounting, runtime/report.py)
against the budget, and whether every parameter, gradient, optimizer state and module buffer
(``state_dict()``) is ``torch.equal`` to training without capuchin.

``--optimizers`` traces traces/mlp.py with AdamW in its three forms (``foreach=False``, the
per-tensor loop; ``foreach=True``; ``fused=True``; ``--clip`` adds ``clip_grad_norm_``), finds
each one's smallest feasible budget and floor, and trains ``--steps`` steps under the plan at
that budget, compared bitwise with plain training, with every iteration's measured peak against
the budget (iteration 0 follows no plan: guards/lru.py Note [Persistent state under the guard]).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BERT = ROOT / "benchmarks" / "bert_mlm.py"
MLP = ROOT / "traces" / "mlp.py"


def _state(path: Path, args: list[str], context=None) -> dict:
    """Every module that ran a forward through its ``state_dict()`` plus its parameters'
    gradients, and every stepped optimizer's ``state_dict()`` state."""
    import torch
    from capuchin.runmain import run_as_main
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook

    mods: dict = {}
    opts: list = []
    h1 = register_module_forward_pre_hook(lambda m, a: mods.setdefault(id(m), m) and None)
    h2 = register_optimizer_step_post_hook(
        lambda o, a, k: opts.append(o) if o not in opts else None
    )
    try:
        with contextlib.redirect_stdout(io.StringIO()), context or contextlib.nullcontext():
            run_as_main(path, args)
    finally:
        h1.remove()
        h2.remove()
    out = {}
    for i, m in enumerate(mods.values()):
        for k, t in m.state_dict().items():
            out[f"m{i}.{k}"] = t.detach().clone()
        for k, p in m.named_parameters():
            if p.grad is not None:
                out[f"m{i}.{k}.grad"] = p.grad.detach().clone()
    for i, o in enumerate(opts):
        for k, st in o.state_dict()["state"].items():
            for n, t in st.items():
                if isinstance(t, torch.Tensor):
                    out[f"opt{i}.{k}.{n}"] = t.detach().clone()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", nargs="*", type=Path, help="default: traces/*.trace.parquet")
    ap.add_argument("--no-bert", action="store_true")
    ap.add_argument("--no-run", action="store_true", help="plan only, no BERT run")
    ap.add_argument("--out", type=Path, default=Path("out/persistent"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--bert-budget",
        type=int,
        default=None,
        help="run BERT at this budget (bytes) and skip the table",
    )
    ap.add_argument("--optimizers", action="store_true", help="the mlp's AdamW forms only")
    ap.add_argument("--batch", type=int, default=512, help="--optimizers: the mlp's batch")
    ap.add_argument("--clip", action="store_true", help="--optimizers: with clip_grad_norm_")
    ap.add_argument(
        "--bert-optimizers",
        action="store_true",
        help="benchmarks/bert_mlm.py with AdamW's loop, foreach, fused forms and HF Trainer's default",
    )
    ap.add_argument(
        "--bert-args",
        default="",
        help="--bert-optimizers: more options for bert_mlm.py, e.g. '--seq 32'",
    )
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.optimizers:
        return optimizers(args.out, args.steps, args.batch, args.clip)
    if args.bert_optimizers:
        return optimizers(args.out, args.steps, None, False, bert=args.bert_args.split() or True)

    import capuchin
    from capuchin.planner.api import smallest_feasible_budget
    from capuchin.planner.budget import format_bytes
    from capuchin.planner.problem import Problem
    from capuchin.planner.registry import get_policy
    from capuchin.tracer.reader import load_trace

    args.out.mkdir(parents=True, exist_ok=True)
    traces = [
        (p.name.replace(".trace.parquet", ""), p)
        for p in (args.traces or sorted((ROOT / "traces").glob("*.trace.parquet")))
    ]
    bert_trace = args.out / "bert_mlm.trace.parquet"
    if not args.no_bert:
        if not bert_trace.exists():
            print(f"tracing {BERT} -> {bert_trace}", flush=True)
            with (
                contextlib.redirect_stdout(io.StringIO()),
                capuchin.Tracer(bert_trace, iterations=2, warmup=1, device="cpu", log=None),
            ):
                from capuchin.runmain import run_as_main

                run_as_main(BERT, ["--steps", "4"])
        traces.append(("bert-mlm", bert_trace))
    fn = get_policy("capuchin")
    print(f"load: {os.getloadavg()[0]:.1f}\n")
    print(
        "| trace | ops | peak | floor before | smallest before | floor after | smallest after "
        "| floor breakdown after (working set + fixed) | planning after |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    bert_budget = args.bert_budget
    for name, path in [] if bert_budget else traces:
        p = Problem.from_trace(load_trace(path))
        row = []
        for prob in (p.restricted(), p):
            t0 = time.perf_counter()
            floor = prob.floor_bytes()
            best = smallest_feasible_budget(prob, fn, {}, start_bytes=floor, steps=10)
            row.append((floor, best, time.perf_counter() - t0))
        b = p.floor_breakdown()
        pk = p.peak_bytes

        def pct(x, pk=pk):
            return f"{format_bytes(x)} ({x / pk:.1%})"

        print(
            f"| {name} | {p.n_ops} | {format_bytes(pk)} | {pct(row[0][0])} | {pct(row[0][1])} "
            f"| {pct(row[1][0])} | {pct(row[1][1])} | op {b['floor_op']} "
            f"({p.ops[b['floor_op']].name}): {format_bytes(b['working_set_bytes'])} + "
            f"{format_bytes(b['fixed_bytes'])} | {row[1][2]:.0f} s |",
            flush=True,
        )
        if name == "bert-mlm":
            bert_budget = row[1][1]
    if args.no_bert or args.no_run or bert_budget is None:
        return 0

    from capuchin.planner.api import make_plan
    from capuchin.runtime.engine import Runtime

    plan = make_plan(bert_trace, budget=str(bert_budget), policy="capuchin")
    plan.save(args.out / "bert_mlm.plan.json")
    wraps = [d for d in plan.decisions if d.wraps]
    print(
        f"\nBERT-MLM plan at {format_bytes(bert_budget)}: {len(plan.decisions)} decisions, "
        f"{len(wraps)} wrap-around ({format_bytes(sum(d.size_bytes for d in wraps))}), "
        f"predicted peak {format_bytes(plan.predictions.predicted_peak_bytes)}, predicted "
        f"overhead {plan.predictions.predicted_overhead:+.1%}",
        flush=True,
    )
    steps = ["--steps", str(args.steps)]
    t0 = time.perf_counter()
    ref = _state(BERT, steps)
    t_ref = time.perf_counter() - t0
    rt = Runtime(plan, measure_memory=True)
    t0 = time.perf_counter()
    got = _state(BERT, steps, rt)
    t_run = time.perf_counter() - t0
    import torch

    bad = [k for k in ref if k not in got or not torch.equal(ref[k], got[k])]
    bad += [k for k in got if k not in ref]
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
    print(
        f"run: {len(ref)} tensors compared, {len(bad)} differ{(': ' + str(bad[:5])) if bad else ''}"
    )
    for s in its:
        print(
            f"  iteration {s.iteration}: measured peak {format_bytes(s.peak_bytes or 0)} = "
            f"{(s.peak_bytes or 0) / bert_budget:.3f} x budget, diverged {s.diverged}, "
            f"swapped out {format_bytes(s.swapped_out_bytes)}, in "
            f"{format_bytes(s.swapped_in_bytes)}, {s.time_s:.2f} s"
        )
    print(
        f"  wall: plain {t_ref:.1f} s, under the plan {t_run:.1f} s (load {os.getloadavg()[0]:.1f})"
    )
    return 1 if bad else 0


def optimizers(
    out: Path, steps: int, batch: int | None, clip: bool, bert: bool | list[str] = False
) -> int:
    """The mlp with AdamW as a per-tensor loop, foreach and fused (module docstring); with
    ``bert``, benchmarks/bert_mlm.py with those and Hugging Face ``Trainer``'s default optimizer
    (its ``--optim``); ``bert`` a list: more options for it."""
    import capuchin
    import torch
    from capuchin.planner.api import make_plan, smallest_feasible_budget
    from capuchin.planner.budget import format_bytes
    from capuchin.planner.problem import Problem
    from capuchin.planner.registry import get_policy
    from capuchin.runmain import run_as_main
    from capuchin.runtime.engine import Runtime
    from capuchin.tracer.reader import load_trace

    out.mkdir(parents=True, exist_ok=True)
    fn = get_policy("capuchin")
    extra = bert if isinstance(bert, list) else []
    what = f"bert_mlm.py {' '.join(extra) or '(defaults)'}" if bert else f"mlp batch {batch}"
    print(f"load: {os.getloadavg()[0]:.1f}; {what}{', clip_grad_norm_' if clip else ''}")
    print(
        "| optimizer | ops | peak | floor (op: working set) | smallest feasible | plan "
        "| tensors differ | measured peak / budget, iterations 0.. |"
    )
    print("|---|---|---|---|---|---|---|---|")
    bad_any = 0
    script = BERT if bert else MLP
    forms = ("adamw-loop", "adamw-foreach", "adamw-fused", "hf-trainer") if bert else None
    for optim in forms or ("adamw", "adamw-foreach", "adamw-fused"):
        sargs = ["--optim", optim, *extra] if bert else ["--batch", str(batch), "--optim", optim]
        sargs += ["--clip", "1.0"] if clip else []
        trace = out / f"{script.stem}-{optim}.trace.parquet"
        with (
            contextlib.redirect_stdout(io.StringIO()),
            capuchin.Tracer(trace, iterations=1, warmup=1, device="cpu", log=None),
        ):
            run_as_main(script, [*sargs, "--steps", "3"])
        p = Problem.from_trace(load_trace(trace))
        floor = p.floor_bytes(dead=True)
        best = smallest_feasible_budget(p, fn, {}, start_bytes=floor, steps=10)
        b = p.floor_breakdown()
        plan = make_plan(trace, budget=str(best), policy="capuchin")
        run = [*sargs, "--steps", str(steps)]
        ref = _state(script, run)
        rt = Runtime(plan, measure_memory=True)
        got = _state(script, run, rt)
        bad = [k for k in ref if k not in got or not torch.equal(ref[k], got[k])]
        bad += [k for k in got if k not in ref]
        bad_any += len(bad)
        peaks = ", ".join(
            f"{(s.peak_bytes or 0) / best:.3f}" for s in rt.report.iterations if s.complete
        )
        pk = p.peak_bytes
        wraps = sum(d.wraps for d in plan.decisions)
        print(
            f"| {optim} | {p.n_ops} | {format_bytes(pk)} | {format_bytes(floor)} "
            f"({floor / pk:.1%}; op {b['floor_op']} {p.ops[b['floor_op']].name}: "
            f"{format_bytes(b['working_set_bytes'])}) | {format_bytes(best)} ({best / pk:.1%}) "
            f"| {len(plan.decisions)} decisions, {wraps} wrap-around | {len(bad)} of {len(ref)} "
            f"| {peaks} |",
            flush=True,
        )
    return 1 if bad_any else 0


if __name__ == "__main__":
    sys.exit(main())
