"""Several plans side by side, for notebooks: one DataFrame row per plan, their memory curves in
one long DataFrame, and one plot of those curves over the iteration. No torch; matplotlib is
imported only inside ``plot_plans``.

    plans = {p: capuchin.make_plan(trace, "50%", policy=p) for p in ("capuchin", "dtr")}
    plans_frame(plans)            # policy, budget, predicted peak, overhead, swaps, ...
    memory_curves(plans)          # plan, time_ns, live_bytes (baseline included)
    plot_plans(plans, "m.png")    # the curves, the budget lines, each peak marked

Every number is the simulator's (``Plan.simulate`` on the plan's own trace, or on a ``Problem``
given once for all plans). Plans may come from different traces; the baseline curve is drawn
once per distinct trace.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd

from ..errors import CapuchinError
from .budget import format_bytes
from .plan import Plan
from .problem import Problem
from .simulator import SimResult, simulate_plan

Plans = Mapping[str, Plan] | Sequence[Plan]


def _named(plans: Plans) -> dict[str, Plan]:
    """``{name: plan}``; a sequence is named by policy and budget (made unique)."""
    if isinstance(plans, Mapping):
        return {str(k): v for k, v in plans.items()}
    out: dict[str, Plan] = {}
    for p in plans:
        name = f"{p.provenance.policy} @ {format_bytes(p.budget_bytes)}"
        k, i = name, 2
        while k in out:
            k, i = f"{name} #{i}", i + 1
        out[k] = p
    return out


def plans_frame(plans: Plans) -> pd.DataFrame:
    """One row per plan (index: its name): ``Plan.summary()``'s numbers, the overhead in percent
    and the stall / replay time the simulator predicts, without re-simulating."""
    rows = []
    for name, p in _named(plans).items():
        s = p.summary()
        rows.append(
            {
                "plan": name,
                "policy": s["policy"],
                "budget_bytes": s["budget_bytes"],
                "baseline_peak_bytes": s["baseline_peak_bytes"],
                "predicted_peak_bytes": s["predicted_peak_bytes"],
                "feasible": s["feasible"],
                "overhead_pct": 100.0 * s["predicted_overhead"],
                "swap_count": s["swap_count"],
                "recompute_count": s["recompute_count"],
                "swapped_bytes": s["swapped_bytes"],
                "replayed_ops": s["replayed_ops"],
                "stall_ns": sum(d.predicted_stall_ns for d in p.decisions),
                "recompute_ns": sum(d.predicted_recompute_ns for d in p.decisions),
                "solve_time_s": s["solve_time_s"],
            }
        )
    return pd.DataFrame(rows).set_index("plan") if rows else pd.DataFrame()


def simulate_all(plans: Plans, problem: Problem | None = None) -> dict[str, SimResult]:
    """Each plan's simulation: on ``problem`` when given, else on the plan's own trace."""
    return {name: simulate_plan(p, problem) for name, p in _named(plans).items()}


def memory_curves(plans: Plans, problem: Problem | None = None) -> pd.DataFrame:
    """Long format, one row per memory event of each plan's simulation: ``plan``, ``time_ns``,
    ``live_bytes``, ``op_index``; the baseline (nothing evicted) of each distinct trace is added
    as plan ``"baseline"`` (``"baseline: <trace>"`` when the plans come from several traces)."""
    named = _named(plans)
    firsts: dict[str, Plan] = {}  # one plan per distinct trace, for its baseline
    for p in named.values():
        firsts.setdefault(p.provenance.trace_fingerprint, p)
    frames = []
    for p in firsts.values():
        label = "baseline" if len(firsts) == 1 else f"baseline: {p.provenance.trace_path}"
        frames.append(_curve(label, _baseline(p, problem)))
    frames += [_curve(name, sim) for name, sim in simulate_all(named, problem).items()]
    return pd.concat(frames, ignore_index=True)


def _baseline(plan: Plan, problem: Problem | None) -> SimResult:
    """The simulation of ``plan``'s trace with nothing evicted."""
    from dataclasses import replace

    return simulate_plan(replace(plan, decisions=[], actions=[]), problem)


def _curve(name: str, sim: SimResult) -> pd.DataFrame:
    m = sim.memory
    return pd.DataFrame(
        {
            "plan": name,
            "time_ns": m["time_ns"],
            "live_bytes": m["live_bytes"],
            "op_index": m["op_index"],
        }
    )


def plot_plans(
    plans: Plans,
    out: str | os.PathLike,
    problem: Problem | None = None,
    title: str | None = None,
    *,
    force: bool = True,
) -> Path:
    """The memory curves of ``memory_curves`` in one figure (MiB over ms), each plan's budget as
    a dashed line in its colour and each peak marked; the legend gives overhead and peak."""
    from .report import pyplot, save_figure

    plt = pyplot()
    named = _named(plans)
    if not named:
        raise CapuchinError("plot_plans: no plans to plot")
    curves = memory_curves(named, problem)
    mib = 2**20
    fig, ax = plt.subplots(figsize=(11, 5))
    for name, c in curves.groupby("plan", sort=False):
        if name.startswith("baseline"):
            ax.step(
                c["time_ns"] / 1e6,
                c["live_bytes"] / mib,
                where="post",
                color="0.6",
                lw=1,
                label=name,
            )
    budgets_drawn: set[int] = set()
    for i, (name, p) in enumerate(named.items()):
        c = curves[curves["plan"] == name]
        color = f"C{i % 10}"
        peak = int(c["live_bytes"].max())
        ax.step(
            c["time_ns"] / 1e6,
            c["live_bytes"] / mib,
            where="post",
            color=color,
            lw=1.2,
            label=f"{name}: peak {format_bytes(peak)}, "
            f"+{100 * p.predictions.predicted_overhead:.2f}%"
            + ("" if p.predictions.feasible else " (over budget)"),
        )
        at = c.loc[c["live_bytes"].idxmax(), "time_ns"]
        ax.plot([at / 1e6], [peak / mib], "v", color=color)
        if p.budget_bytes not in budgets_drawn:
            budgets_drawn.add(p.budget_bytes)
            ax.axhline(p.budget_bytes / mib, color=color, ls="--", lw=0.8)
    ax.set_xlabel("time in the iteration (ms)")
    ax.set_ylabel("device memory (MiB)")
    ax.set_title(title or "memory over the iteration (dashed: budgets)")
    ax.legend(loc="upper left", fontsize=8)
    return save_figure(fig, out, force=force)
