"""The ``capuchin-ls`` policy: the ``capuchin`` plan, then a seeded local search around it.

# Note: [Local search after the plan]
# On DTR's U-Net and ResNet-32 (planner/improve.py's ``search_plans``, docs/planner.md "Lower
# bound"), a local search from capuchin's plan finds simulated plans 26-66% cheaper in five of
# six cells: greedy selection on the grid leaves time on the table that single-decision moves
# (another in-trigger, swap <-> recompute, one decision dropped, another gap evicted) recover.
# ``capuchin-ls`` runs that search from the ``capuchin`` plan for a number of steps that shrinks
# with the trace (``steps_for``: each step simulates a whole plan) and returns the found plan
# when the simulator says it is faster and fits, else capuchin's own. So it is never slower than
# ``capuchin`` at the same budget (as simulated), but, unlike ``capuchin``, it is **not monotone
# in the budget**: the search starts from a different plan at each budget and may end in a
# costlier plan at a larger one. That is why it is a separate policy and not ``capuchin``'s last
# stage (``capuchin``'s guarantee, search Note [Targets], is tested:
# tests/test_planner_properties.py ``test_more_budget_never_costs_more``).
"""

from __future__ import annotations

from ..build import complete_decisions
from ..collector import gc_paused
from ..improve import accept, search_plans
from ..problem import Problem
from ..registry import PolicyResult, register
from ..simulator import simulate
from .capuchin import capuchin

WORK = 1_000_000  # steps x ops: 2-4 s of CPU per budget on DTR U-Net and ResNet-32 (~4,000 steps)
MIN_STEPS, MAX_STEPS = 100, 5_000


def steps_for(problem: Problem) -> int:
    """Local-search steps for a problem: ``WORK`` ops' worth, within [MIN_STEPS, MAX_STEPS]."""
    return max(MIN_STEPS, min(MAX_STEPS, WORK // max(problem.n_ops, 1)))


@register("capuchin-ls")
@gc_paused
def capuchin_ls(
    problem: Problem, budget_bytes: int, *, steps: int | None = None, seed: int = 0
) -> PolicyResult:
    """``capuchin``'s plan improved by ``search_plans`` (Note [Local search after the plan]):
    ``steps`` plans simulated (default ``steps_for(problem)``), seeded. Output: capuchin's
    decisions, or the search's (completed by the builder's lineage) when they fit and simulate
    faster. Never slower than ``capuchin`` at the same budget; not monotone in the budget."""
    base = capuchin(problem, budget_bytes)
    if not base.decisions:
        return base
    sim = simulate(problem, list(base.decisions))
    if sim.peak_bytes > budget_bytes or sim.time_ns <= sim.baseline_time_ns:
        return base  # nothing fits to start from, or nothing to gain
    n = steps_for(problem) if steps is None else steps
    found = search_plans(problem, budget_bytes, base.decisions, steps=n, seed=seed)
    figures = {"local_search_steps": n, "local_search_fitting": found.fitting}
    if found.extra_ns is not None:  # improve Note [The accept rule]
        ds = list(found.decisions)
        got = accept(problem, lambda: complete_decisions(problem, ds), sim.time_ns, budget_bytes)
        if got is not None:
            fsim = got[1]
            return PolicyResult(
                got[0],
                notes=(
                    f"local search ({n} steps) from the capuchin plan: "
                    f"{(sim.time_ns - sim.baseline_time_ns) / 1e6:.2f} -> "
                    f"{(fsim.time_ns - fsim.baseline_time_ns) / 1e6:.2f} ms extra",
                ),
                figures=figures,
            )
    return PolicyResult(base.decisions, notes=base.notes, figures=figures)
