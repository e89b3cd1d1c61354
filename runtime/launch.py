"""``capuchin run``: the unmodified script under a ``Runtime`` (``runmain.run_as_main``, as
``capuchin trace`` does)."""

from __future__ import annotations

import os

from ..distributed import per_rank
from ..errors import InfeasibleBudgetError, ScriptError
from ..outputs import WriteError, check_output
from ..planner.plan import Plan, load_plan
from ..runmain import check_script, run_as_main
from ..units import format_bytes
from .engine import Runtime, rank_plan_path
from .report import RunReport


def run_script(
    script: str | os.PathLike,
    script_args: list[str] | tuple[str, ...] = (),
    *,
    plan: str | os.PathLike | None = None,
    budget_bytes: int | None = None,
    report_path: str | os.PathLike | None = None,
    force: bool = False,
    measure_memory: bool = True,
    eviction: str = "dtr",
    device: str | None = None,
) -> RunReport:
    """Run ``script`` to its end under the plan; returns the run's report (and writes it to
    ``report_path`` if given, checked before the script starts).

    Raises ``ScriptError`` if the script fails (its traceback printed first, as ``capuchin
    trace`` does), ``PlanFormatError`` for a bad plan, and ``InfeasibleBudgetError`` when
    ``budget_bytes`` is below the plan's predicted peak (the plan cannot keep the run within it;
    see docs/errors.md). ``device``: the device managed (``Runtime``; None or ``auto``: the
    plan's, or cpu without a plan on a host without CUDA).
    """
    script = check_script(script)
    if report_path is not None:  # Note [Per-rank files] in distributed.py
        report_path = per_rank(report_path)
        check_output(report_path, force=force, inputs=[script, plan])
    if plan is not None:
        plan = rank_plan_path(plan)
    if plan is not None and budget_bytes is not None:
        check_budget_against_plan(load_plan(plan), budget_bytes, plan)
    rt = Runtime(
        plan,
        budget_bytes=budget_bytes,
        measure_memory=measure_memory,
        eviction=eviction,
        device=device,
    )
    with rt:
        run_as_main(
            script,
            script_args,
            consequence="; no report written" if report_path is not None else "",
        )
    if rt.report is None:
        raise ScriptError(f"{script}: ended without a report")
    if report_path is not None:
        try:
            rt.report.save(report_path, force=force)
        except WriteError:  # the run is done: its summary first, then where the report went
            print(rt.report.summary(), flush=True)
            raise
    return rt.report


def check_budget_against_plan(plan: Plan, budget_bytes: int, source: str | os.PathLike) -> None:
    """Refuse a ``--budget`` below what ``plan`` is predicted to need (its peak, over all its
    kinds of iteration): such a run would exceed the budget every planned iteration."""
    peak = max(
        [plan.predictions.predicted_peak_bytes]
        + [k.predictions.predicted_peak_bytes for k in plan.kinds]
    )
    if budget_bytes < peak:
        raise InfeasibleBudgetError(
            f"{source}: --budget {format_bytes(budget_bytes)} ({budget_bytes} B) is below the "
            f"plan's predicted peak {format_bytes(peak)} ({peak} B); the plan cannot keep the "
            f"run within it: make a plan for this budget (capuchin plan TRACE --budget "
            f"{budget_bytes}) or leave --budget out (the plan's: "
            f"{format_bytes(plan.budget_bytes)})",
            smallest_feasible_bytes=peak,
        )
