"""planner/improve.py: the accept rule, the selector key and the bisection, each on its own."""

from __future__ import annotations

from capuchin.errors import PlanError
from capuchin.planner.improve import accept, bisect_monotone, rank
from capuchin.planner.plan import Decision, Method
from capuchin.planner.problem import Problem
from capuchin.planner.simulator import simulate


def _chain() -> Problem:
    # A made by f1 and read again by b2; evicting it over ops 2-4 lowers the peak by 100 B.
    ops = [
        ("f1", 100, ["X"], ["A"]),
        ("f2", 100, ["A"], ["B"]),
        ("f3", 100, ["B"], ["C"]),
        ("f4", 100, ["C"], ["D"]),
        ("b2", 100, ["D", "A"], ["G"], [], "backward"),
    ]
    sizes = dict(X=10, A=100, B=100, C=100, D=10, G=10)
    return Problem.from_lists(ops, sizes, bandwidth_bytes_per_s=1e9)


def test_accept_keeps_a_faster_plan_within_the_bound_only():
    p = _chain()
    on_demand = [Decision("A", Method.SWAP, 100, 1, 4)]  # swap-in at b2: stalls 100 ns
    sim = simulate(p, on_demand)
    assert sim.time_ns == p.time_ns + 100
    none = accept(p, [], sim.time_ns, p.peak_bytes)  # keeping A: faster, peak = the peak
    assert none is not None and none[1].time_ns == p.time_ns
    assert accept(p, [], sim.time_ns, p.peak_bytes - 1) is None  # over the bound
    assert accept(p, on_demand, sim.time_ns, p.peak_bytes) is None  # not faster
    assert accept(p, on_demand, sim.time_ns, p.peak_bytes, ties=True) is not None  # sideways
    assert accept(p, None, sim.time_ns, p.peak_bytes) is None  # no trial


def test_accept_rejects_a_trial_that_breaks_an_invariant():
    p = _chain()
    seen = []

    def broken():
        raise PlanError("no replay")

    assert accept(p, broken, 10**12, p.peak_bytes, seen=lambda t, s: seen.append(t)) is None
    bad = [Decision("A", Method.SWAP, 100, 0, 4)]  # op 0 is not an access of A
    assert accept(p, bad, 10**12, p.peak_bytes, seen=lambda t, s: seen.append(t)) is None
    assert not seen
    accept(p, [], 0, p.peak_bytes, seen=lambda t, s: seen.append(t))
    assert seen == [[]]  # within the bound, though not kept


def test_rank_fitting_first_then_fastest_then_higher_peak_else_lowest_peak():
    budget = 100
    plans = [(120, 5), (90, 30), (80, 30), (95, 40), (110, 1)]
    assert min(plans, key=lambda x: rank(*x, budget)) == (90, 30)
    over = [(130, 5), (120, 9), (120, 1)]
    assert min(over, key=lambda x: rank(*x, budget)) == (120, 9)  # lowest peak, the earlier


def test_bisect_monotone_finds_the_threshold():
    calls = []

    def ok(x):
        calls.append(x)
        return x >= 737

    assert bisect_monotone(ok, 0, 1000) == 737
    assert bisect_monotone(ok, 0, 1000, tol=100) - 737 in range(0, 101)
    calls.clear()
    got = bisect_monotone(ok, 0, 1000, max_steps=3)
    assert len(calls) == 3 and ok(got)
    assert bisect_monotone(ok, 0, 1000, tol=lambda hi: hi // 10) - 737 in range(0, 100)
