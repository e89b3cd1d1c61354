"""planner/improve.py: the accept rule, the improvement kernel, the selector key and the bisection,
each on its own."""

from __future__ import annotations

from capuchin.errors import PlanError
from capuchin.planner.improve import Attempt, accept, bisect_monotone, improve, rank
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


def _two() -> Problem:
    # A and B, made early and read again by b2: each swapped out with an on-demand restore
    # stalls 100 ns; prefetched (A before op 3, B before op 4) neither stalls, at a peak of 310 B;
    # prefetched later (A before op 4, B before op 5) neither stalls either, at 300 B
    ops = [
        ("f1", 100, ["X"], ["A"]),
        ("f2", 100, ["A"], ["B"]),
        ("f3", 100, ["B"], ["C"]),
        ("f4", 100, ["C"], ["D"]),
        ("f5", 100, ["D"], ["E"]),
        ("f6", 100, ["E"], ["F"]),
        ("b2", 100, ["F", "A", "B"], ["G"], [], "backward"),
    ]
    sizes = dict(X=10, A=100, B=100, C=100, D=10, E=10, F=10, G=10)
    return Problem.from_lists(ops, sizes, bandwidth_bytes_per_s=1e9)


def _plans(p: Problem) -> dict[str, list[Decision]]:
    def a(t):
        return Decision("A", Method.SWAP, 100, 1, 6, trigger_op=t)

    def b(t):
        return Decision("B", Method.SWAP, 100, 2, 6, trigger_op=t)

    plans = {
        "on demand": [a(None), b(None)],  # +200 ns, peak 300
        "A early": [a(3), b(None)],  # +100 ns, peak 310
        "both early": [a(3), b(4)],  # +0, peak 310
        "both later": [a(4), b(5)],  # +0, peak 300
    }
    sims = {k: simulate(p, v) for k, v in plans.items()}
    got = {k: (s.time_ns - p.time_ns, s.peak_bytes) for k, s in sims.items()}
    assert got == {  # the premise
        "on demand": (200, 300),
        "A early": (100, 310),
        "both early": (0, 310),
        "both later": (0, 300),
    }
    return plans


def test_improve_keeps_the_first_trial_kept_each_round_until_a_round_keeps_none():
    # Note [One improvement kernel]
    p = _two()
    plans = _plans(p)
    start = Attempt(plans["on demand"], simulate(p, plans["on demand"]))
    calls = []

    def move(cur):
        calls.append(cur.sim.time_ns - p.time_ns)
        yield plans["A early"], frozenset()
        yield plans["both early"], frozenset({"x"})

    one = improve(p, start, 400, move, rounds=1)
    assert one.decisions == plans["A early"] and calls == [200]  # the first kept ends the round
    calls.clear()
    got = improve(p, start, 400, move, rounds=10)
    assert got.decisions == plans["both early"] and got.regen == frozenset({"x"})
    assert calls == [200, 100, 0]  # the third round kept nothing: the end
    assert got.sim.time_ns == p.time_ns


def test_improve_with_best_keeps_the_fastest_trial_of_a_round():
    p = _two()
    plans = _plans(p)
    start = Attempt(plans["on demand"], simulate(p, plans["on demand"]))

    def move(cur):
        yield plans["A early"], frozenset()
        yield plans["both early"], frozenset()

    got = improve(p, start, 400, move, rounds=1, best=True)
    assert got.decisions == plans["both early"]


def test_improve_keeps_to_its_bound_and_returns_the_start_when_nothing_is_kept():
    p = _two()
    plans = _plans(p)
    start = Attempt(plans["on demand"], simulate(p, plans["on demand"]))
    bounds = []

    def move(cur):
        yield plans["A early"], frozenset()  # peak 310: over a bound of 300
        yield plans["both early"], frozenset()
        yield plans["both later"], frozenset()

    def bound(cur):
        bounds.append(cur.sim.peak_bytes)
        return 300

    got = improve(p, start, bound, move, rounds=3)
    assert got.decisions == plans["both later"] and bounds == [300, 300]
    nothing = improve(p, start, 299, move, rounds=3)  # every trial over the bound
    assert nothing is start


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
