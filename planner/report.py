"""Reporting for plans: the human summary, ``capuchin show PLAN``, the memory plot, and the Chrome
trace of the simulated schedule. Analyses live elsewhere and return data; this module draws.
matplotlib is imported only when plotting (``pyplot``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import CapuchinError
from ..outputs import IMAGE_SUFFIXES, atomic_write, check_output, write_text
from .budget import format_bytes
from .plan import Method, Plan, load_plan
from .problem import Problem
from .simulator import SimResult, simulate_plan


def _runtime_part(plan: Plan) -> str:
    """What of the predicted time is the runtime's own per-op cost (planner/costs.py), which
    ``capuchin compare`` leaves out: its overhead is the simulated plan's alone."""
    p = plan.predictions
    if not p.runtime_cost_ns or not p.baseline_time_ns:
        return ""
    sim_ns = p.predicted_time_ns - p.runtime_cost_ns
    return (
        f"  = the simulated plan {100 * (sim_ns / p.baseline_time_ns - 1):+.2f}% (what `capuchin "
        f"compare` shows) + the runtime's per-op cost {p.runtime_cost_ns / 1e6:.3f} ms "
        f"({100 * p.runtime_cost_ns / p.baseline_time_ns:+.2f}%)"
    )


def format_summary(plan: Plan, output: str | os.PathLike | None = None) -> str:
    """A few lines: baseline peak -> predicted peak vs budget, overhead, swaps, recomputations,
    bytes swapped, solve time (and where the plan was written)."""
    s = plan.summary()
    fits = "fits" if s["feasible"] else "DOES NOT FIT"
    lines = [
        f"policy {s['policy']} on iteration {s['iteration']} of "
        f"{plan.provenance.trace_path or 'an in-memory trace'}",
        f"peak {format_bytes(s['baseline_peak_bytes'])} -> {format_bytes(s['predicted_peak_bytes'])}"
        f" (budget {format_bytes(s['budget_bytes'])}: {fits})",
        f"predicted overhead {100 * s['predicted_overhead']:.2f}% of {overhead_base(s)}, "
        f"with the runtime's per-op cost ({s['baseline_time_ns'] / 1e6:.3f} ms -> "
        f"{s['predicted_time_ns'] / 1e6:.3f} ms per iteration, of which runtime "
        f"{s.get('runtime_cost_ns', 0) / 1e6:.3f} ms)",
        f"{s['swap_count']} swaps ({format_bytes(s['swapped_bytes'])}), "
        f"{s['recompute_count']} recomputations ({format_bytes(s['recomputed_bytes'])}, "
        f"{s['replayed_ops']} replayed ops); solved in {s['solve_time_s']:.2f} s",
    ]
    if _runtime_part(plan):
        lines.insert(3, _runtime_part(plan))
    wraps = [d for d in plan.decisions if d.wraps]
    if wraps:
        lines.append(
            f"{len(wraps)} of the swaps wrap around the iteration boundary "
            f"({format_bytes(sum(d.size_bytes for d in wraps))}: out across the "
            f"optimizer step until their first use in the next iteration)"
        )
    lines += [f"note: {n}" for n in s["notes"]]
    if plan.kinds:  # Note [Iteration kinds] in planner/api.py
        lines.append(
            f"kinds of iteration: {plan.kind} (above, iteration {s['iteration']}) and "
            f"{len(plan.kinds)} more:"
        )
        for k in plan.kinds:
            ks = k.summary()
            lines.append(
                f"  {k.kind}: iteration {ks['iteration']}, {len(k.ops)} ops, peak "
                f"{format_bytes(ks['baseline_peak_bytes'])} -> "
                f"{format_bytes(ks['predicted_peak_bytes'])} "
                f"({'fits' if ks['feasible'] else 'DOES NOT FIT'}), overhead "
                f"{100 * ks['predicted_overhead']:.2f}%, {ks['swap_count']} swaps, "
                f"{ks['recompute_count']} recomputations"
            )
    if output is not None:
        lines.append(f"wrote {output}")
    return "\n".join(lines)


def overhead_base(s: dict) -> str:
    """What a plan's predicted overhead is a fraction of, in words (Note [Plain baseline] in
    planner/problem.py); ``s``: ``Plan.summary()``."""
    basis = s.get("time_basis", "traced")
    plain = s.get("plain_time_ns")
    if basis == "plain-scaled" and plain:
        return (
            f"the plain step {plain / 1e6:.3f} ms (timed without tracer or profiler; op times "
            f"scaled by {s.get('duration_scale', 1.0):.3f} to it)"
        )
    if basis == "plain" and plain:
        return (
            f"the plain step {plain / 1e6:.3f} ms (timed without tracer or profiler; op times "
            "as traced)"
        )
    return "the traced iteration (op times under the profiler; the trace has no plain step)"


def show_plan(
    path: str | os.PathLike,
    as_json: bool = False,
    plot: str | None = None,
    chrome: str | None = None,
    *,
    force: bool = False,
) -> str:
    """What ``capuchin show PLAN`` prints; writes the plot / Chrome trace when asked (they
    re-simulate the plan, so the trace it was made from must still be at
    ``provenance.trace_path``). Both outputs are checked before anything is read
    (``outputs.check_output``: never the plan itself, an existing file only with ``force``)."""
    if plot:
        check_output(plot, force=force, inputs=[path, chrome], suffixes=IMAGE_SUFFIXES)
    if chrome:
        check_output(chrome, force=force, inputs=[path, plot])
    plan = load_plan(path)
    written = []
    if plot or chrome:
        problem, sim = _resimulate(plan, path)
        if plot:
            written.append(plot_memory(plan, sim, problem, plot, force=force))
        if chrome:
            written.append(write_chrome_trace(plan, sim, chrome, force=force))
    if as_json:
        return json.dumps(
            {
                "path": str(path),
                **plan.summary(),
                "kind": plan.kind,
                "kinds": [{"kind": k.kind, **k.summary()} for k in plan.kinds],
                "written": [str(w) for w in written],
            },
            indent=1,
        )
    text = format_summary(plan)
    return "\n".join([f"{path}:", text, *(f"wrote {w}" for w in written)])


def _resimulate(plan: Plan, path) -> tuple[Problem, SimResult]:
    from ..tracer.reader import load_trace

    found = plan.trace_file(path)
    if found is None:
        raise CapuchinError(
            f"{path}: the plan's trace {plan.provenance.trace_path or '(none)'} "
            f"is not there; --plot and --chrome re-simulate the plan on its trace"
        )
    problem = Problem.from_trace(load_trace(found), iteration=plan.provenance.iteration)
    return problem, simulate_plan(plan, problem)


# -- memory plot ------------------------------------------------------------------------------
def plot_memory(
    plan: Plan,
    sim: SimResult,
    problem: Problem,
    out: str | os.PathLike,
    max_bars: int = 150,
    *,
    force: bool = True,
) -> Path:
    """Baseline vs planned memory over the iteration (ms), the budget line, both peaks marked,
    and below it one bar per evicted storage (largest first, at most ``max_bars``) from the
    moment its memory is freed until it is back: blue = swapped, orange = recomputed."""
    plt = pyplot()
    mib = 2**20
    base = problem.memory()
    fig, (ax, ax2) = plt.subplots(
        2, 1, figsize=(11, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]}
    )
    bt = list(base["start_ns"] / 1e6) + [problem.time_ns / 1e6]
    bl = list(base["live_bytes"] / mib)
    ax.step(bt, bl + bl[-1:], where="post", color="0.55", label="baseline")
    mem = sim.memory
    ax.step(
        mem["time_ns"] / 1e6,
        mem["live_bytes"] / mib,
        where="post",
        color="C0",
        label=f"planned ({plan.provenance.policy})",
    )
    ax.axhline(plan.budget_bytes / mib, color="C3", ls="--", lw=1, label="budget")
    ax.plot(
        [problem.start_ns[problem.peak_op] / 1e6],
        [problem.peak_bytes / mib],
        "v",
        color="0.3",
        label=f"baseline peak {format_bytes(problem.peak_bytes)}",
    )
    ax.plot(
        [sim.peak_time_ns / 1e6],
        [sim.peak_bytes / mib],
        "v",
        color="C0",
        label=f"planned peak {format_bytes(sim.peak_bytes)}",
    )
    ax.set_ylabel("device memory (MiB)")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(
        f"{Path(plan.provenance.trace_path).name or 'trace'}: "
        f"{plan.swap_count} swaps, {plan.recompute_count} recomputations, "
        f"overhead {100 * plan.predictions.predicted_overhead:.1f}%"
    )
    rows = sorted(zip(plan.decisions, sim.outcomes, strict=True), key=lambda r: -r[0].size_bytes)
    for y, (d, o) in enumerate(rows[:max_bars]):
        start = o.freed_ns if o.freed_ns >= 0 else sim.op_end_ns[d.evict_op]
        end = o.back_ns if o.back_ns >= 0 else sim.op_start_ns[d.back_op]
        color = "C0" if d.method == Method.SWAP else "C1"
        ax2.barh(y, (end - start) / 1e6, left=start / 1e6, height=0.8, color=color)
    ax2.set_ylabel("evicted storages")
    ax2.set_xlabel("time in the iteration (ms)")
    ax2.set_yticks([])
    ax2.plot([], [], color="C0", lw=6, label="swapped out")
    ax2.plot([], [], color="C1", lw=6, label="dropped (recomputed)")
    ax2.legend(loc="upper right", fontsize=8)
    return save_figure(fig, out, force=force)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, imported on first use."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CapuchinError("plotting needs matplotlib: pip install 'capuchin[plot]'") from None
    return plt


def save_figure(fig, out: str | os.PathLike, *, force: bool = True) -> Path:
    """Lay out, write atomically (110 dpi; the format of ``out``'s suffix, PNG when it has
    none of ``IMAGE_SUFFIXES``) and close ``fig``."""
    fig.tight_layout()
    out = Path(out)
    fmt = out.suffix.lower().lstrip(".") if out.suffix.lower() in IMAGE_SUFFIXES else "png"
    try:
        with atomic_write(out, force=force) as tmp:
            fig.savefig(tmp, dpi=110, format=fmt)
    finally:
        pyplot().close(fig)
    return out


# -- Chrome trace -----------------------------------------------------------------------------
_TIDS = {"compute": 1, "d2h": 2, "h2d": 3}
_NAMES = {
    "compute": "compute stream",
    "d2h": "copy device->host (swap-out)",
    "h2d": "copy host->device (swap-in)",
}


def chrome_trace(plan: Plan, sim: SimResult, max_counter_events: int = 200_000) -> dict:
    """The simulated schedule in Chrome trace format (opens in Perfetto / chrome://tracing):
    compute, swap-out and swap-in streams as threads, plus a memory counter and the budget."""
    ev: list[dict] = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": 1,
            "args": {"name": f"capuchin plan ({plan.provenance.policy})"},
        }
    ]
    for stream, tid in _TIDS.items():
        ev.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": 1,
                "tid": tid,
                "args": {"name": _NAMES[stream]},
            }
        )
    sp = sim.spans
    for stream, name, s, e, k, sid in zip(
        sp["stream"],
        sp["name"],
        sp["start_ns"],
        sp["end_ns"],
        sp["op_index"],
        sp["storage_id"],
        strict=True,
    ):
        args = {"op_index": int(k)} if k >= 0 else {}
        if sid:
            args["storage_id"] = sid
        ev.append(
            {
                "ph": "X",
                "name": name,
                "pid": 1,
                "tid": _TIDS[stream],
                "ts": s / 1e3,
                "dur": max(e - s, 0) / 1e3,
                "args": args,
            }
        )
    mem = sim.memory
    step = max(1, len(mem) // max_counter_events)
    for t, v in zip(
        mem["time_ns"].to_numpy()[::step], mem["live_bytes"].to_numpy()[::step], strict=True
    ):
        ev.append(
            {
                "ph": "C",
                "name": "device memory",
                "pid": 1,
                "ts": float(t) / 1e3,
                "args": {"live_bytes": int(v), "budget_bytes": int(plan.budget_bytes)},
            }
        )
    return {
        "traceEvents": ev,
        "displayTimeUnit": "ns",
        "otherData": {
            "policy": plan.provenance.policy,
            "trace_fingerprint": plan.provenance.trace_fingerprint,
        },
    }


def write_chrome_trace(
    plan: Plan, sim: SimResult, out: str | os.PathLike, *, force: bool = True
) -> Path:
    """Write ``chrome_trace`` atomically to ``out`` (``force``: as ``outputs.atomic_write``)."""
    return write_text(out, json.dumps(chrome_trace(plan, sim)), force=force)
