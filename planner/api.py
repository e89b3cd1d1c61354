"""The planning API shared by the CLI and notebooks: ``make_plan`` and ``load_problem``.

>>> plan = capuchin.make_plan("traces/mlp.trace.parquet", budget="50%")
>>> plan.decisions_frame()    # DataFrame, one row per evicted storage
>>> simulate_plan(plan).memory    # DataFrame, the simulated memory curve
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

from ..errors import InfeasibleBudgetError
from ..outputs import check_output
from ..tracer.reader import Trace, load_trace
from ..tracer.schema import FILE_SUFFIX
from ..tracer.summary import iteration_kinds
from .budget import format_bytes, parse_budget, parse_rate
from .build import build_plan, plans_dead, run_policy, with_dead
from .improve import bisect_monotone
from .plan import Plan
from .problem import Problem
from .region_tags import with_region_tags
from .registry import get_policy


def load_problem(
    trace: str | os.PathLike | Trace | Problem,
    *,
    iteration: int | None = None,
    bandwidth: str | float | None = None,
) -> Problem:
    """A ``Problem`` from a trace path, a loaded ``Trace``, or a ``Problem`` (returned as is).

    ``bandwidth`` (bytes/s, or text like ``"12GB/s"``) overrides both copy directions.
    """
    if isinstance(trace, Problem):
        problem = trace
    else:
        if not isinstance(trace, Trace):
            trace = load_trace(trace)
        problem = Problem.from_trace(trace, iteration=iteration)
    if bandwidth is not None:
        r = parse_rate(bandwidth)
        problem = problem.with_bandwidth(r, r)
    return problem


def make_plan(
    trace: str | os.PathLike | Trace | Problem,
    budget: str | int = "50%",
    policy: str = "capuchin",
    *,
    iteration: int | None = None,
    bandwidth: str | float | None = None,
    allow_infeasible: bool = False,
    time_limit_s: float | None = None,
    region_tags: bool = False,
    **params: Any,
) -> Plan:
    """``_make_plan`` (below), and the plan's recompute tags inside compiled regions: those the
    trace was recorded with, or with ``region_tags`` those it proposes (Note [Planning region
    tags] in planner/region_tags.py; then a budget the untagged trace cannot meet is no error:
    the plan is for a retrace)."""
    if not isinstance(trace, (Trace, Problem)):
        trace = load_trace(trace)  # once: its metadata and its ops
    meta = _trace_meta(trace)
    propose = region_tags and meta is not None and not getattr(meta, "region_tags", None)
    plan = _make_plan(
        trace,
        budget,
        policy,
        iteration=iteration,
        bandwidth=bandwidth,
        allow_infeasible=allow_infeasible or propose,
        time_limit_s=time_limit_s,
        **params,
    )
    return with_region_tags(plan, meta, region_tags) if meta is not None else plan


def _trace_meta(trace) -> Any:
    """The metadata of the trace behind ``trace`` (None: a Problem without a trace file)."""
    if isinstance(trace, Trace):
        return trace.meta
    path = trace.trace_path if isinstance(trace, Problem) else trace
    if not path or not Path(path).is_file():
        return None
    import pyarrow.parquet as pq

    from ..tracer.schema import META_KEY, TraceMeta

    raw = (pq.read_schema(path).metadata or {}).get(META_KEY)
    return TraceMeta.from_bytes(raw) if raw is not None else None


def _make_plan(
    trace: str | os.PathLike | Trace | Problem,
    budget: str | int = "50%",
    policy: str = "capuchin",
    *,
    iteration: int | None = None,
    bandwidth: str | float | None = None,
    allow_infeasible: bool = False,
    time_limit_s: float | None = None,
    **params: Any,
) -> Plan:
    """Plan ``trace`` for ``budget`` with the registered ``policy`` (default ``"capuchin"``).

    ``budget``: bytes or text (``"8G"``, ``"8GB"``, ``"60%"`` of the trace's baseline peak; see
    planner/budget.py). ``iteration``: which recorded iteration to plan (default: the steady
    one). ``bandwidth``: overrides the trace's host<->device bandwidths (bytes/s). ``params`` go
    to the policy. ``time_limit_s``: the solve's wall-clock limit (s), given to policies that
    take a ``time_limit_s`` option (the ``ilp``); for the others it is ignored and the plan's
    notes say so.

    Returns a complete ``Plan`` whose predictions come from the simulator. Its
    ``provenance.parameters`` holds ``params`` and, over them, the figures the policy reports
    about its own run (``PolicyResult.figures``: the ILP's ``status``, ``optimality_gap``,
    ``ilp_objective_ns``, ``solve_time_s``, ``stages`` ...). A budget at or above the baseline
    peak gives an empty plan (its notes say so). Raises ``InfeasibleBudgetError`` (exit status 2
    in the CLI) when the policy's simulated peak stays above the budget, naming the smallest
    budget it was found to meet, unless ``allow_infeasible`` (then the plan is returned with
    ``predictions.feasible`` false).
    """
    if iteration is None and not isinstance(trace, Problem):
        tr = trace if isinstance(trace, Trace) else load_trace(trace)
        kinds = shape_kinds(tr, iteration_kinds(tr))
        if len(kinds) > 1 and len(kinds[0][1]) > 1:  # Note [Iteration kinds]
            return _plan_kinds(
                tr,
                kinds,
                budget,
                policy,
                bandwidth=bandwidth,
                allow_infeasible=allow_infeasible,
                time_limit_s=time_limit_s,
                **params,
            )
        trace = tr
    problem = load_problem(trace, iteration=iteration, bandwidth=bandwidth)
    budget_bytes = parse_budget(budget, problem.peak_bytes)
    fn = get_policy(policy)
    notes: list[str] = []
    if time_limit_s is not None:
        if takes_time_limit(fn):
            params["time_limit_s"] = float(time_limit_s)
        else:
            notes.append(
                f"time limit {time_limit_s:g} s ignored: policy {policy!r} takes none "
                f"(it is not a time-limited search)"
            )
    plan, sim, _ = run_policy(problem, policy, budget_bytes, params, notes)
    if plan.predictions.feasible:
        return plan
    floor = problem.floor_bytes(dead=True)  # the lowest bound of every policy
    # the best effort's own peak is a good first guess, unless the policy gave up (an exact
    # policy such as the ilp returns no decisions when nothing fits): then search up from the floor
    gave_up = sim.peak_bytes >= problem.peak_bytes
    best = smallest_feasible_budget(
        problem,
        fn,
        params,
        start_bytes=max(floor if gave_up else sim.peak_bytes, floor, budget_bytes + 1),
        steps=10 if problem.n_ops <= 20_000 else 4,
    )
    msg = (
        f"{problem.trace_path or 'trace'}: budget {format_bytes(budget_bytes)} "
        f"({budget_bytes} B) cannot be met by policy {policy!r}: its plan peaks at "
        f"{format_bytes(sim.peak_bytes)}; the smallest budget it reaches is "
        f"{format_bytes(best)} ({best} B); no plan of any policy can go below "
        f"{format_bytes(floor)} (what must stay resident: {floor_text(problem)})"
    )
    reported = plan.provenance.parameters or {}
    limit, status = reported.get("time_limit_s"), reported.get("status")
    if limit is not None and status not in ("OPTIMAL", "INFEASIBLE"):
        msg += (
            f"; policy {policy!r} stopped at its time limit of {limit:g} s (solver status "
            f"{status}): these are what it found within it, a longer --time-limit may reach "
            "lower"
        )
    if allow_infeasible:
        plan.predictions.notes.append(msg)
        return plan
    raise InfeasibleBudgetError(msg, smallest_feasible_bytes=int(best))


# Note: [Iteration kinds]
# A script whose iterations are not all alike (a training loop that also evaluates every N
# steps: that iteration holds the evaluation pass too; the first step of an epoch) records
# several kinds of iteration. ``iteration_kinds`` groups the recorded iterations by their op
# names; when the most frequent kind was recorded at least twice, ``make_plan`` plans each kind
# on its last recorded iteration, under one absolute budget (a ``%`` budget is a share of the
# highest peak of all kinds), and returns the most frequent kind's plan ("train") with the others
# in ``Plan.kinds`` ("kind1", "kind2", ... in order of frequency). The runtime picks the kind as
# each iteration runs (Note [Iteration kinds] in runtime/tracker.py). A trace whose iterations
# all differ is still refused (``--iteration N`` plans one of them).


# Note: [Shape kinds]
# Iterations with the same op names may still differ in shapes: dynamic padding pads each batch
# to its longest sequence, and bucketing makes a few lengths recur. In a trace that is not
# regular, ``shape_kinds`` splits each kind of ``iteration_kinds`` by the input shapes of the ops
# that allocate (``OpInfo.signature`` where ``OpInfo.allocs``): an op that allocates nothing
# (a view, a ``copy_`` of one sample into a slice of the padded batch) may have other shapes
# within one bucket, and the runtime does not take those for a divergence either (Note [Watched
# iterations] in runtime/tracker.py). Each recurring shape then gets a plan of its own, within
# the existing ``kinds`` of the plan format (no new field); the runtime picks the kind at the
# first op whose shapes tell the kinds apart (Note [Shape kinds at run time] in
# runtime/tracker.py). As for kinds by op names, they are planned when the most frequent one was
# recorded at least twice; a shape recorded once is then a kind of its own too.


def shape_kinds(trace: Trace, kinds: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    """``kinds`` (``iteration_kinds``), each split by the shapes of its allocating ops (Note
    [Shape kinds]); unchanged for a regular trace. Ordered and named as ``iteration_kinds``."""
    if trace.meta.regular:
        return kinds
    groups: list[list[int]] = []
    for _, its in kinds:
        if len(its) == 1:
            groups.append(its)
            continue
        by_shape: dict[tuple, list[int]] = {}
        for it in its:
            ops = Problem.from_trace(trace, iteration=it).ops
            key = tuple(o.signature if o.allocs else "" for o in ops)
            by_shape.setdefault(key, []).append(it)
        groups += by_shape.values()
    order = sorted(groups, key=lambda its: (-len(its), -its[-1]))
    return [("train" if i == 0 else f"kind{i}", its) for i, its in enumerate(order)]


def _plan_kinds(
    trace: Trace, kinds: list[tuple[str, list[int]]], budget: str | int, policy: str, **kw: Any
) -> Plan:
    problems = [
        load_problem(trace, iteration=its[-1], bandwidth=kw.get("bandwidth")) for _, its in kinds
    ]
    budget_bytes = parse_budget(budget, max(p.peak_bytes for p in problems))
    kw.pop("bandwidth", None)
    plans = []
    for (kind, its), problem in zip(kinds, problems, strict=True):
        try:
            plan = _make_plan(problem, budget_bytes, policy, **kw)
        except InfeasibleBudgetError as exc:  # say which kind cannot meet it
            raise InfeasibleBudgetError(
                f"iteration kind {kind!r} (iteration {its[-1]}): {exc}",
                smallest_feasible_bytes=exc.smallest_feasible_bytes,
            ) from exc
        plan.kind = kind
        plans.append(plan)
    main, *others = plans
    main.kinds = others
    return main


def floor_text(problem: Problem) -> str:
    """The floor's breakdown in words (``Problem.floor_breakdown``)."""
    b = problem.floor_breakdown()
    if b["floor_op"] < 0:
        return "nothing runs"
    op = problem.ops[b["floor_op"]]
    return (
        f"at op {b['floor_op']} ({op.name}), its own inputs, outputs and scratch "
        f"{format_bytes(b['working_set_bytes'])} plus {format_bytes(b['fixed_bytes'])} "
        f"that no access gap frees there; parameters, gradients and optimizer state are "
        f"swap candidates, across iterations too"
    )


def takes_time_limit(policy_fn) -> bool:
    """Whether a policy function has a ``time_limit_s`` option of its own (a catch-all
    ``**kwargs`` does not count: such a policy would silently ignore it)."""
    try:
        return "time_limit_s" in inspect.signature(policy_fn).parameters
    except (TypeError, ValueError):
        return False


def solver_report(plan: Plan) -> dict[str, Any]:
    """The policy's own account of its optimality, from ``provenance.parameters``: ``status``
    and ``optimality_gap`` ((found - bound) / found, 0.0 = proven optimal) when the policy
    reported them (the ``ilp``); empty for heuristics."""
    p = plan.provenance.parameters or {}
    return {k: p[k] for k in ("status", "optimality_gap") if k in p}


def plan_summary(plan: Plan) -> dict[str, Any]:
    """``plan.summary()`` plus ``solver_report(plan)``: what ``capuchin plan --json`` prints."""
    return {**plan.summary(), **solver_report(plan)}


def format_solver_report(plan: Plan) -> str | None:
    """One line for the human summary (``"solver status OPTIMAL, optimality gap 0.00%"``), or
    None when the policy reported nothing."""
    r = solver_report(plan)
    if not r:
        return None
    parts = []
    if r.get("status") is not None:
        parts.append(f"solver status {r['status']}")
    if "optimality_gap" in r:
        g = r["optimality_gap"]
        parts.append("optimality gap unknown" if g is None else f"optimality gap {100 * g:.2f}%")
    tl = plan.provenance.parameters.get("time_limit_s")
    if tl is not None:
        parts.append(f"time limit {tl:g} s")
    return ", ".join(parts)


def smallest_feasible_budget(
    problem: Problem, policy_fn, params: dict[str, Any], *, start_bytes: int, steps: int = 10
) -> int:
    """The smallest budget >= ``start_bytes`` found for which ``policy_fn`` makes a feasible
    plan (verified by simulation). Greedy policies are not monotone in the budget, so this
    tries ``start_bytes``, then bisects towards the baseline peak (always feasible)."""

    def peak_at(b: int) -> int | None:
        try:
            if plans_dead(policy_fn):  # dead.py Note [Dead storages]
                ds = with_dead(problem, b, lambda p: policy_fn(p, b, **params)).decisions
            else:
                ds = policy_fn(problem, b, **params).decisions
            _, sim = build_plan(problem, ds, policy="", budget_bytes=b)
        except Exception:  # noqa: BLE001 - a broken plan counts as not feasible
            return None
        return sim.peak_bytes if sim.peak_bytes <= b else None

    hi = problem.peak_bytes
    if start_bytes < hi and peak_at(start_bytes) is not None:
        return start_bytes
    return bisect_monotone(
        lambda b: peak_at(b) is not None,
        start_bytes,
        hi,
        tol=lambda h: max(1, h // 1000),
        max_steps=steps,
    )


def default_plan_path(trace_path: str | os.PathLike) -> Path:
    """``<trace stem>.plan.json`` in the current directory (``x.trace.parquet`` -> ``x.plan.json``)."""
    name = Path(trace_path).name
    stem = name[: -len(FILE_SUFFIX)] if name.endswith(FILE_SUFFIX) else Path(name).stem
    return Path(stem + ".plan.json")


def plan_file(
    trace_path: str | os.PathLike,
    budget: str | int,
    output=None,
    *,
    policy: str = "capuchin",
    bandwidth: str | float | None = None,
    iteration: int | None = None,
    force: bool = False,
    time_limit_s: float | None = None,
    **params: Any,
) -> tuple[Plan, Path]:
    """What ``capuchin plan`` does: ``make_plan`` on a trace file, saved (atomically) to
    ``output`` (default ``default_plan_path``). Refuses to overwrite without ``force`` (checked
    before planning, with the other checks of ``outputs.check_output``; the budget's syntax is
    checked before the output, so a typo is named first)."""
    parse_budget(budget, peak_bytes=1 << 62)  # syntax only: a percentage's bytes need the trace
    out = check_output(
        output if output is not None else default_plan_path(trace_path),
        force=force,
        inputs=[trace_path],
    )
    plan = make_plan(
        trace_path,
        budget,
        policy,
        iteration=iteration,
        bandwidth=bandwidth,
        time_limit_s=time_limit_s,
        **params,
    )
    return plan, plan.save(out, force=force)


def plan_files(
    trace_path: str | os.PathLike, budget: str | int, output=None, *, force: bool = False, **kw: Any
) -> list[tuple[Plan, Path]]:
    """``plan_file`` for a trace, or for every rank's trace of a distributed job (Note [Per-rank
    files] in distributed.py): when ``trace_path`` does not exist but ``t.rank{R}.parquet`` do,
    each is planned (a ``%`` budget is a share of that rank's own peak) and written to the
    output's per-rank name (``p.json`` -> ``p.rank{R}.json``). Every output is checked before any
    planning, so a refused one leaves nothing half-written."""
    from ..distributed import rank_path, ranked_files

    parse_budget(budget, peak_bytes=1 << 62)  # syntax first (plan_file)
    ranks = ranked_files(trace_path) if not Path(trace_path).exists() else {}
    if not ranks:
        return [plan_file(trace_path, budget, output, force=force, **kw)]
    base = output if output is not None else default_plan_path(trace_path)
    outs = {r: check_output(rank_path(base, r), force=force, inputs=[t]) for r, t in ranks.items()}
    return [plan_file(t, budget, outs[r], force=force, **kw) for r, t in ranks.items()]
