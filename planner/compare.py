"""Every policy on the same trace, through the one simulator: ``capuchin compare``. No torch.

``compare_policies(trace, budgets)`` plans each (policy, budget) pair with the registered policy
and the shared builder (so every number comes from the simulator), and searches each policy's
smallest feasible budget. ``format_comparison`` prints the table, ``records_to_json`` the JSON.

# Note: [Smallest feasible budget]
# Found by bisection between the problem's floor (``Problem.floor_bytes``: no plan of any policy
# goes below it) and the baseline peak (always feasible: nothing to evict), starting from the
# budgets already evaluated, to a tolerance of ``search_tolerance`` x peak (default 0.5%). A policy
# is not guaranteed to be monotone in the budget (a heuristic may fit 50% and miss 55%), so the
# result is "the smallest budget the bisection found feasible": an upper bound on the true one.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import CapuchinError
from .budget import format_bytes, parse_budget
from .build import run_policy
from .improve import bisect_monotone
from .plan import Method, Plan
from .problem import Problem
from .registry import available, get_policy
from .search import SEARCH_MAX_OPS

DEFAULT_SEARCH_TOLERANCE = 0.005  # of the baseline peak


@dataclass(frozen=True)
class CompareRecord:
    """One policy at one budget, as the simulator predicts it.

    ``bytes_swapped``: bytes copied to the host per iteration (each swap decision once).
    ``ops_recomputed``: ops replayed per iteration (replays the simulator actually ran).
    ``optimality_gap``/``status``: what the policy reports about its own optimality (the ILP);
    None for heuristics. ``error``: the policy or its plan failed (then ``feasible`` is false).
    ``smallest_feasible_bytes``: the policy's smallest feasible budget (Note [Smallest feasible
    budget]); None when not searched. ``time_limit_s``: the time limit of each solve, for
    policies that report one (the ILP): its results, the smallest budget included, are what it
    found within that limit.
    """

    policy: str
    budget_bytes: int
    feasible: bool
    predicted_peak_bytes: int
    predicted_overhead: float
    solve_time_s: float
    bytes_swapped: int = 0
    ops_recomputed: int = 0
    decisions: int = 0
    optimality_gap: float | None = None
    status: str | None = None
    error: str | None = None
    smallest_feasible_bytes: int | None = None
    time_limit_s: float | None = None
    # ``predicted_overhead`` plus the runtime's per-op cost (planner/costs.py): the figure
    # ``capuchin plan`` prints for the same plan; None where no plan was made
    overhead_with_runtime: float | None = None


@dataclass(frozen=True)
class Comparison:
    """``records``: one per (policy, budget), policies in the order asked, budgets descending."""

    trace: str
    baseline_peak_bytes: int
    baseline_time_ns: int
    floor_bytes: int
    records: tuple[CompareRecord, ...]
    # (policy, budget_bytes) -> the plan evaluated there (None when the policy failed)
    plans: dict[tuple[str, int], Plan | None] = field(
        default_factory=dict, repr=False, compare=False
    )
    # what ``baseline_time_ns`` and the overheads are (Note [Plain baseline] in problem.py)
    time_basis: str = "traced"
    plain_time_ns: int | None = None
    duration_scale: float = 1.0

    @property
    def frame(self):
        """The records as a pandas DataFrame (one row per policy and budget), with the budget
        and the predicted peak also as fractions of the baseline peak."""
        import pandas as pd

        df = pd.DataFrame([asdict(r) for r in self.records])
        if not df.empty:
            df["budget_fraction"] = df["budget_bytes"] / self.baseline_peak_bytes
            df["peak_fraction"] = df["predicted_peak_bytes"] / self.baseline_peak_bytes
        return df


def evaluate(
    problem: Problem, policy: str, budget_bytes: int, params: dict[str, Any] | None = None
) -> tuple[CompareRecord, Plan | None]:
    """Plan ``problem`` at ``budget_bytes`` with ``policy`` and predict it (simulator).

    ``params`` are given to the policy (only those its signature accepts). A budget at or above
    the baseline peak gets the empty plan, as ``make_plan`` does. Never raises for a policy
    failure: the record says ``error``.
    """
    kwargs = _accepted(get_policy(policy), params or {})
    t0 = time.perf_counter()
    try:
        plan, sim, result = run_policy(problem, policy, budget_bytes, kwargs)
    except CapuchinError as exc:
        rec = CompareRecord(
            policy,
            int(budget_bytes),
            False,
            -1,
            math.nan,
            round(time.perf_counter() - t0, 4),
            error=str(exc),
        )
        return rec, None
    swapped = sum(d.size_bytes for d in plan.decisions if d.method == Method.SWAP)
    replayed = sum(
        len(d.replay_ops)
        for d, o in zip(plan.decisions, sim.outcomes, strict=True)
        if d.method == Method.RECOMPUTE and o.recompute_ns > 0
    )
    gap = result.figures.get("optimality_gap")
    rec = CompareRecord(
        policy=policy,
        budget_bytes=int(budget_bytes),
        feasible=bool(plan.predictions.feasible),
        predicted_peak_bytes=int(sim.peak_bytes),
        # of the plain step when the trace timed it (Note [Plain baseline] in problem.py);
        # simulated, without the runtime's per-op cost that ``capuchin plan`` adds
        predicted_overhead=float(
            (sim.time_ns - sim.baseline_time_ns) / problem.overhead_base_ns
            if problem.overhead_base_ns > 0
            else sim.overhead
        ),
        overhead_with_runtime=float(plan.predictions.predicted_overhead),
        solve_time_s=plan.provenance.solve_time_s,
        bytes_swapped=int(swapped),
        ops_recomputed=int(replayed),
        decisions=len(plan.decisions),
        optimality_gap=None if gap is None else float(gap),
        status=result.status,
        time_limit_s=result.figures.get("time_limit_s"),
    )
    return rec, plan


def smallest_feasible_budget(
    problem: Problem,
    policy: str,
    *,
    params: dict[str, Any] | None = None,
    tolerance: float = DEFAULT_SEARCH_TOLERANCE,
    known: Sequence[CompareRecord] = (),
) -> int:
    """The smallest budget (bytes) at which ``policy``'s plan is feasible, by bisection; see
    Note [Smallest feasible budget]. ``known``: records already evaluated for this policy."""
    peak = problem.peak_bytes
    floor = min(problem.floor_bytes(dead=True), peak)
    ok = [r.budget_bytes for r in known if r.feasible]
    bad = [r.budget_bytes for r in known if not r.feasible and r.error is None]
    hi = min([peak, *ok])
    lo = max([floor - 1, *(b for b in bad if b < hi)])
    if lo < floor and hi > floor:  # the floor itself may be reachable
        if evaluate(problem, policy, floor, params)[0].feasible:
            return floor
        lo = floor
    return bisect_monotone(
        lambda b: evaluate(problem, policy, b, params)[0].feasible,
        lo,
        hi,
        tol=max(1, int(tolerance * peak)),
    )


def compare_policies(
    trace: str | os.PathLike | Any,
    budgets: str | Sequence[str | int],
    *,
    policies: Sequence[str] | None = None,
    time_limit_s: float | None = None,
    search_smallest: bool = True,
    params: dict[str, dict[str, Any]] | None = None,
    search_tolerance: float = DEFAULT_SEARCH_TOLERANCE,
) -> Comparison:
    """Run ``policies`` (default: every registered one) on ``trace`` at each budget.

    ``trace``: a path, a ``Trace`` or a ``Problem``. ``budgets``: ``"8G,6G,60%"`` or a list
    (bytes, sizes or percentages of the baseline peak; planner/budget.py). ``time_limit_s``: given
    to policies that take one (the ILP). ``params``: per-policy keyword options. Unknown policy
    names raise ``UnknownPolicyError`` (listing the valid ones) before anything runs.
    """
    from .api import load_problem

    problem = load_problem(trace)
    names = list(policies) if policies else _default_order(available())
    for name in names:
        get_policy(name)
    items = budgets.split(",") if isinstance(budgets, str) else list(budgets)
    amounts = sorted(
        {parse_budget(str(b).strip(), problem.peak_bytes) for b in items if str(b).strip()},
        reverse=True,
    )
    if not amounts:
        raise CapuchinError("no budget given (e.g. --budget 8G,6G or --budget 60%)")
    records: list[CompareRecord] = []
    plans: dict[tuple[str, int], Plan | None] = {}
    for name in names:
        p = dict((params or {}).get(name, {}))
        if time_limit_s is not None:
            p.setdefault("time_limit_s", time_limit_s)
        mine = []
        for b in amounts:
            rec, plans[name, b] = evaluate(problem, name, b, p)
            mine.append(rec)
        if search_smallest:
            best = smallest_feasible_budget(
                problem, name, params=p, known=mine, tolerance=search_tolerance
            )
            mine = [_with(r, smallest_feasible_bytes=best) for r in mine]
        records.extend(mine)
    return Comparison(
        trace=problem.trace_path or str(trace),
        baseline_peak_bytes=problem.peak_bytes,
        baseline_time_ns=problem.time_ns,
        floor_bytes=problem.floor_bytes(dead=True),
        records=tuple(records),
        plans=plans,
        time_basis=problem.time_basis,
        plain_time_ns=problem.plain_time_ns,
        duration_scale=problem.duration_scale,
    )


# ---- output -------------------------------------------------------------------------------------
def records_to_json(result: Comparison) -> str:
    """The records as a JSON list (keys of ``CompareRecord``; ``optimality_gap`` and ``status``
    only for policies that report them, i.e. the ILP, where the gap is null when no plan was
    found; ``error`` only when the policy failed)."""
    out = []
    for r in result.records:
        d = asdict(r)
        if d["status"] is None and d["optimality_gap"] is None:  # a heuristic: nothing to say
            del d["status"], d["optimality_gap"]
        if d["error"] is None:
            del d["error"]
        if d["time_limit_s"] is None:
            del d["time_limit_s"]
        if isinstance(d["predicted_overhead"], float) and math.isnan(d["predicted_overhead"]):
            d["predicted_overhead"] = None
        out.append(d)
    return json.dumps(out, indent=1)


def format_comparison(result: Comparison) -> str:
    """The policy x budget table and each policy's smallest feasible budget, as text."""
    peak = result.baseline_peak_bytes
    if result.time_basis == "traced" or result.plain_time_ns is None:
        base = "traced iteration (op times under the profiler; no plain step in the trace)"
        it = "traced iteration"
    else:
        base = f"plain step {result.plain_time_ns / 1e6:.2f} ms (timed without tracer or profiler)"
        it = (
            f"iteration (op times scaled by {result.duration_scale:.3f} to the plain step)"
            if result.time_basis == "plain-scaled"
            else "traced iteration (op times as traced)"
        )
    lines = [
        f"trace {result.trace}: baseline peak {format_bytes(peak)}, {it} "
        f"{result.baseline_time_ns / 1e6:.2f} ms, floor {format_bytes(result.floor_bytes)} "
        f"({_pct(result.floor_bytes, peak)} of peak: no plan goes below)",
        f"overhead: simulated, of the {base}, without the runtime's per-op cost "
        "(capuchin plan's predicted overhead includes it): 'sim overhead' is the simulated "
        "plan alone, 'with runtime' adds the runtime's per-op cost (what `capuchin plan` "
        "prints)",
    ]
    header = [
        "policy",
        "budget",
        "feasible",
        "peak",
        "sim overhead",
        "with runtime",
        "swapped",
        "recomputed",
        "solve",
        "note",
    ]
    rows = []
    for r in result.records:
        if r.error:
            rows.append(
                [
                    r.policy,
                    _budget(r.budget_bytes, peak),
                    "error",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    f"{r.solve_time_s:.2f}s",
                    r.error[:60],
                ]
            )
            continue
        note = ""
        if r.status is not None:
            note = r.status + (f" gap {r.optimality_gap:.1%}" if r.optimality_gap else "")
        rows.append(
            [
                r.policy,
                _budget(r.budget_bytes, peak),
                "yes" if r.feasible else "NO",
                format_bytes(r.predicted_peak_bytes),
                f"{r.predicted_overhead:+.1%}",
                "-" if r.overhead_with_runtime is None else f"{r.overhead_with_runtime:+.1%}",
                format_bytes(r.bytes_swapped) if r.bytes_swapped else "0",
                f"{r.ops_recomputed} ops",
                f"{r.solve_time_s:.2f}s",
                note,
            ]
        )
    lines += _table(header, rows)
    lines.append(
        "(overhead: the simulated plan's extra time alone; `capuchin plan` adds the runtime's "
        "per-op cost to its predicted overhead, planner/costs.py)"
    )
    if (
        any(r.policy in ("capuchin", "swap", "recompute") for r in result.records)
        and len({r.budget_bytes for r in result.records}) > 1
    ):
        lines.append(
            "(capuchin, swap and recompute plan a fixed grid of targets once per trace of up "
            f"to {SEARCH_MAX_OPS:,} ops "
            "(planner/search.py Note [Targets]): their first budget's solve time "
            "includes it, later budgets reuse it)"
        )
    smallest: dict[str, int] = {}
    limits: dict[str, float] = {}
    for r in result.records:
        if r.smallest_feasible_bytes is not None:
            smallest[r.policy] = r.smallest_feasible_bytes
        if r.time_limit_s is not None:
            limits[r.policy] = r.time_limit_s
    if smallest:
        lines.append("")
        lines.append(
            "smallest feasible budget (bisection between the floor and the peak, to 0.5% "
            "of the peak; an upper bound if a policy is not monotone in the budget):"
        )
        lines += _table(
            ["policy", "smallest budget", "of peak", "note"],
            [
                [p, format_bytes(b), _pct(b, peak), _limit_note(limits.get(p), b, peak)]
                for p, b in smallest.items()
            ],
        )
    return "\n".join(lines)


def _limit_note(limit_s: float | None, smallest: int, peak: int) -> str:
    """Name the time limit a smallest budget was found within (it may be what limits it)."""
    if limit_s is None:
        return ""
    more = ": nothing below the peak found, try a longer --time-limit" if smallest >= peak else ""
    return f"within the time limit of {limit_s:g} s per solve{more}"


def _budget(b: int, peak: int) -> str:
    return f"{format_bytes(b)} ({_pct(b, peak)})"


def _pct(b: int, peak: int) -> str:
    return f"{100 * b / peak:.0f}%" if peak else "-"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip(), *(fmt.format(*map(str, r)).rstrip() for r in rows)]


_ORDER = [
    "capuchin",
    "swap",
    "recompute",
    "ilp",
    "dtr",
    "checkpoint-sqrt",
    "checkpoint-speed",
    "vdnn",
]


def _default_order(names: list[str]) -> list[str]:
    """capuchin and its variants, the optimum, then the peers; any other policy last."""
    return [n for n in _ORDER if n in names] + sorted(n for n in names if n not in _ORDER)


def _accepted(fn, params: dict[str, Any]) -> dict[str, Any]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return dict(params)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return dict(params)
    return {k: v for k, v in params.items() if k in sig.parameters}


def _with(r: CompareRecord, **changes) -> CompareRecord:
    from dataclasses import replace

    return replace(r, **changes)
