"""The unmodified script under a ``Runtime``: ``run_under``, the one way every caller runs one
(``capuchin run`` through ``run_script``, max-batch's verifying runs, the tests' and benchmarks'
``run_example``), through ``runmain.run_as_main`` as ``capuchin trace`` does."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

from ..distributed import per_rank
from ..errors import InfeasibleBudgetError, ScriptError
from ..outputs import WriteError, check_output
from ..planner.plan import Plan, load_plan
from ..runmain import check_script, run_as_main
from ..units import format_bytes
from .engine import Runtime, rank_plan_path
from .report import RunReport
from .snapshot import Watch


class StopAfterSteps(BaseException):
    """Raised from the optimizer step hook after the last step a run asked for (``run_under``)."""


@dataclass
class ScriptRun:
    """What ``run_under`` saw: the script's globals (None when it was stopped after ``steps``),
    the optimizer steps counted and when each ended (``time.perf_counter``; counted only when
    ``steps`` was given), and the final state (``keep_state``; runtime/snapshot.py)."""

    globals: dict[str, Any] | None
    steps: int = 0
    stamps: list[float] = field(default_factory=list)
    state: dict | None = None


def run_under(
    context,
    script: str | os.PathLike,
    args: list[str] | tuple[str, ...] = (),
    *,
    steps: int | None = None,
    keep_state: bool = False,
    consequence: str = "",
) -> ScriptRun:
    """Run ``script`` with ``args`` as its own ``__main__`` inside ``context`` (a ``Runtime``,
    any other context manager, or None: plain).

    ``steps``: stop the script after that many optimizer steps, each step's end time-stamped (the
    hook is registered inside ``context``, so after a runtime's own step hook: the runtime has
    ended the iteration before the script is stopped). ``keep_state``: take the final state
    (``Watch``: parameters, gradients, optimizer state, models' ``state_dict``) after
    ``context`` has exited (a runtime has then restored everything it evicted).
    ``consequence``: appended to a script failure's message (``run_as_main``). The script's
    errors pass unchanged."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    ran = ScriptRun(None)
    watch = Watch() if keep_state else contextlib.nullcontext()

    def stepped(opt, a, k):
        ran.stamps.append(time.perf_counter())
        ran.steps += 1
        if ran.steps >= steps:
            raise StopAfterSteps()

    handle = None
    try:
        with context if context is not None else contextlib.nullcontext(), watch:
            if steps is not None:
                handle = register_optimizer_step_post_hook(stepped)
            ran.globals = run_as_main(script, args, consequence=consequence)
    except StopAfterSteps:
        pass
    finally:
        if handle is not None:
            handle.remove()
    if keep_state:
        ran.state = watch.state(ran.globals)
    return ran


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
    run_under(
        rt,
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
