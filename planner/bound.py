"""A proven lower bound on the extra time of every plan for a budget: how far from optimal a
plan can be. No torch; needs OR-Tools (GLOP and CP-SAT).

``lower_bound(problem, budget)`` builds the ``ilp`` policy's model (policies/_ilp_model.py) at op
granularity over *every* candidate (each access gap of an evictable storage that covers an op
over the budget), with each swap's in-copy free to start any time after its out-copy, and
returns the larger of two proven bounds on its optimum:

- ``lp_ns``: the optimum of its linear relaxation (GLOP; all variables continuous);
- ``cpsat_ns``: CP-SAT's best objective bound after ``time_limit_s`` of search.

# Note: [Why the bound holds for every plan]
# At op granularity the model is a relaxation of the simulator (policies/_ilp_model.py Note
# [Where the ILP and the simulator differ]): for any choice of keep, swap or recompute per
# candidate, its memory is never above the simulator's and its cost never above the simulated
# extra time. The ``ilp`` policy fixes each swap's in-trigger by a rule, which would leave out
# plans that prefetch earlier; here every candidate's trigger is its first possible op, so the
# in-copy may start anywhere after the out-copy and every swap a plan can express is admitted.
# A decision on a gap that covers no op over the budget lowers no memory row of the model; a
# plan's choices on the candidates alone already satisfy every row. So no plan whose simulated
# peak fits the budget has a simulated extra time below the model's optimum, and each of the
# two bounds is below that optimum. Stages coarser than ops would break this (a storage off
# the device for part of a stage counts as present there), hence op granularity only.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from ..errors import CapuchinError
from .coarsen import coarsen
from .problem import Problem


@dataclass(frozen=True)
class LowerBound:
    """``bound_ns``: proven lower bound on the extra ns of any plan that fits (``math.inf``
    when none can: the relaxation is infeasible). ``lp_ns``/``cpsat_ns``: the two bounds
    (None: not reached in time)."""

    bound_ns: float
    lp_ns: float | None
    cpsat_ns: int | None
    candidates: int
    variables: int
    constraints: int
    lp_s: float
    cpsat_s: float
    cpsat_status: str

    def gap(self, extra_ns: float) -> float | None:
        """How far a plan with ``extra_ns`` may be above the optimum, as a fraction of its own
        extra time ((extra - bound) / extra): 0 when it is optimal; None for infinite bounds."""
        if math.isinf(self.bound_ns):
            return None
        if extra_ns <= 0:
            return 0.0
        return max(0.0, (extra_ns - self.bound_ns) / extra_ns)


def lower_bound(
    problem: Problem,
    budget_bytes: int,
    *,
    time_limit_s: float = 120.0,
    tick_ns: int | None = None,
    cpsat: bool = True,
) -> LowerBound:
    """See the module docstring. ``time_limit_s``: wall-clock seconds for the whole call; the
    model build and the LP run to completion, CP-SAT gets what is left (none: no CP-SAT bound).
    ``cpsat``: run CP-SAT at all. ``tick_ns``: the copy schedule's unit (default 1/100000 of the
    iteration, as the ``ilp`` policy)."""
    from .policies._ilp_model import _import_cp_model, _Model
    from .policies.ilp import DEFAULT_TICKS, candidates

    t0 = time.perf_counter()
    cands = [replace(c, trigger=c.evict_op + 1) for c in candidates(problem, budget_bytes)]
    if not cands:
        over = bool((problem.live_bytes > budget_bytes).any())
        return LowerBound(
            math.inf if over else 0.0,
            None,
            None,
            0,
            0,
            0,
            0.0,
            0.0,
            "INFEASIBLE" if over else "OPTIMAL",
        )
    n = problem.n_ops
    stages = coarsen(problem.durations_ns.tolist(), problem.live_bytes.tolist(), max_stages=n)
    if not stages.is_op_level:  # pragma: no cover - coarsen keeps every op when asked to
        raise CapuchinError("lower_bound needs the model at op granularity")
    if tick_ns is None:
        tick_ns = max(1, problem.time_ns // DEFAULT_TICKS)
    model = _Model(problem, stages, budget_bytes, cands, tick_ns)
    proto = model.m.proto
    if model.hopeless:
        return LowerBound(
            math.inf,
            None,
            None,
            len(cands),
            len(proto.variables),
            len(proto.constraints),
            0.0,
            0.0,
            "INFEASIBLE",
        )
    t_lp = time.perf_counter()
    lp = _lp_bound(model)
    lp_s = time.perf_counter() - t_lp
    cp_model = _import_cp_model()
    solver = cp_model.CpSolver()
    left = time_limit_s - (time.perf_counter() - t0)
    cp_bound, status, cp_s = None, "SKIPPED", 0.0
    if cpsat and left > 1 and not (lp is not None and math.isinf(lp)):
        t_cp = time.perf_counter()
        solver.parameters.max_time_in_seconds = left
        solver.parameters.num_workers = 1
        solver.parameters.linearization_level = 2
        code = solver.solve(model.m)
        cp_s = time.perf_counter() - t_cp
        status = solver.status_name(code)
        if code == cp_model.INFEASIBLE:
            cp_bound = math.inf
        elif code in (cp_model.OPTIMAL, cp_model.FEASIBLE, cp_model.UNKNOWN):
            # the tie-break adds at most scale - 1 to scale * objective (_Model.__init__)
            cp_bound = max(0, int(solver.best_objective_bound + 1e-6) // model.scale)
    bounds = [b for b in (lp, cp_bound) if b is not None]
    return LowerBound(
        max(bounds, default=0.0),
        lp,
        cp_bound,
        len(cands),
        len(proto.variables),
        len(proto.constraints),
        lp_s,
        cp_s,
        status,
    )


def _lp_bound(model) -> float | None:
    """The optimum of the linear relaxation of ``model``'s time objective (ns), ``math.inf``
    when the relaxation is infeasible, None when GLOP gives no answer."""
    from ortools.linear_solver import pywraplp

    proto = model.m.proto
    lp = pywraplp.Solver.CreateSolver("GLOP")
    inf = lp.infinity()
    xs = []
    for v in proto.variables:
        dom = list(v.domain)
        xs.append(lp.NumVar(float(dom[0]), float(dom[-1]), ""))
    for c in proto.constraints:
        if not c.has_linear() or len(c.enforcement_literal):
            raise CapuchinError(
                "lower_bound: the model has a constraint that is not plain "
                "linear (no LP relaxation here)"
            )
        lin = c.linear
        dom = list(lin.domain)  # (a split domain relaxes to its hull)
        lo, hi = dom[0], dom[-1]
        const = 0.0
        terms = []
        for ref, coef in zip(lin.vars, lin.coeffs, strict=True):
            if ref < 0:  # a negated literal: 1 - x
                const += coef
                terms.append((-ref - 1, -coef))
            else:
                terms.append((ref, coef))
        row = lp.Constraint(
            -inf if lo <= -(2**62) else lo - const, inf if hi >= 2**62 else hi - const
        )
        for i, coef in terms:
            row.SetCoefficient(xs[i], row.GetCoefficient(xs[i]) + coef)
    obj = lp.Objective()
    for (_b, j), v in model.R.items():
        x = xs[v.Index()]
        obj.SetCoefficient(x, obj.GetCoefficient(x) + model.problem.ops[j].duration_ns)
    for v in model.stall.values():
        x = xs[v.Index()]
        obj.SetCoefficient(x, obj.GetCoefficient(x) + model.q)
    obj.SetMinimization()
    code = lp.Solve()
    if code == pywraplp.Solver.INFEASIBLE:
        return math.inf
    if code != pywraplp.Solver.OPTIMAL:
        return None
    # GLOP's optimum is a float; shave its tolerance so the bound stays below the true one
    return max(0.0, obj.Value() * (1 - 1e-7) - 1.0)
