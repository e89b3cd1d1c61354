"""``bound.lower_bound`` is below every plan that fits, and not trivially zero.

On small generated traces every plan of the ILP's decision space is simulated (brute force,
tests/test_ilp_bruteforce.py) and the capuchin, DTR and ILP plans are simulated too: the bound
must be at most each of their extra times, and above zero where every fitting plan costs time.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("ortools")

from capuchin.planner.bound import lower_bound  # noqa: E402
from capuchin.planner.registry import get_policy  # noqa: E402
from capuchin.planner.simulator import simulate  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_ilp_bruteforce import CASES, brute_force, small_problem  # noqa: E402


def _extra(problem, budget, policy):
    from capuchin.planner.build import complete_decisions

    ds = complete_decisions(problem, get_policy(policy)(problem, budget).decisions)
    sim = simulate(problem, ds)
    return sim.time_ns - problem.time_ns if sim.peak_bytes <= budget else None


@pytest.mark.parametrize(("seed", "fraction", "kind"), CASES)
def test_bound_below_every_fitting_plan(seed, fraction, kind):
    problem = small_problem(seed)
    budget = int(problem.peak_bytes * fraction)
    b = lower_bound(problem, budget, time_limit_s=20)
    best = brute_force(problem, budget)
    if best is None:  # nothing in the decision space fits; the bound may or may not see it
        assert kind == "infeasible"
        return
    assert not math.isinf(b.bound_ns)
    assert b.bound_ns <= best
    for policy in ("capuchin", "dtr"):
        extra = _extra(problem, budget, policy)
        if extra is not None:
            assert b.bound_ns <= extra, policy
    if best > 0:
        assert b.bound_ns > 0  # the relaxation sees that something must cost time
    assert b.gap(best) is not None and 0.0 <= b.gap(best) < 1.0 or best == 0


def test_nothing_over_budget_costs_nothing():
    problem = small_problem(0)
    b = lower_bound(problem, problem.peak_bytes)
    assert b.bound_ns == 0 and b.gap(0) == 0.0
