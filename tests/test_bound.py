"""``bound.lower_bound`` is below every plan that fits, and not trivially zero.

On small generated traces every plan of the ILP's decision space is simulated (brute force,
tests/test_ilp_bruteforce.py), the capuchin and DTR plans are simulated too, and so is every plan
``search_plans`` visits from capuchin's (in-triggers anywhere in the gap, outside the ILP's
space): the bound must be at most each of their extra times, and above zero where every fitting
plan costs time. The cuts (``add_cuts``) are checked where they raise the LP bound.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("ortools")

from capuchin.planner.bound import lower_bound  # noqa: E402
from capuchin.planner.improve import search_plans  # noqa: E402
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
    _below_searched_plans(problem, budget, b.bound_ns)
    if best > 0:
        assert b.bound_ns > 0  # the relaxation sees that something must cost time
    assert b.gap(best) is not None and 0.0 <= b.gap(best) < 1.0 or best == 0


def _below_searched_plans(problem, budget, bound_ns, steps=300):
    seen = []
    start = get_policy("capuchin")(problem, budget).decisions
    found = search_plans(problem, budget, start, steps=steps, visit=lambda ds, v: seen.append(v))
    assert found.fitting == len(seen)
    for v in seen:
        assert bound_ns <= v
    return found


def _cell(seed: int, fraction: float, bandwidth: float | None = None):
    """A small generated trace (its copy bandwidth replaced when given), the budget at
    ``fraction`` of its peak, and the brute-force optimum there (some plan fits)."""
    problem = small_problem(seed)
    if bandwidth is not None:
        problem = problem.with_bandwidth(bandwidth, bandwidth)
    budget = int(problem.peak_bytes * fraction)
    best = brute_force(problem, budget)
    assert best is not None
    return problem, budget, best


# (seed, fraction): small traces where the cuts raise the LP bound (measured: 211 -> 565 ns at
# (0, 0.8), 69 -> 297 at (3, 0.8), ...; brute force 1000 and 800 there)
CUT_CASES = [(0, 0.8), (3, 0.8), (21, 0.8), (22, 0.8), (0, 0.7), (3, 0.7), (19, 0.7), (22, 0.7)]


@pytest.mark.parametrize(("seed", "fraction"), CUT_CASES)
def test_cuts_hold_for_every_plan_and_bind(seed, fraction):
    problem, budget, best = _cell(seed, fraction)
    plain = lower_bound(problem, budget, cpsat=False, cuts=())
    cut = lower_bound(problem, budget, cpsat=False)
    assert plain.bound_ns < cut.bound_ns <= best  # the cuts bind, and stay below the optimum
    full = lower_bound(problem, budget, time_limit_s=20)
    assert full.bound_ns <= best
    _below_searched_plans(problem, budget, full.bound_ns)


# (seed, fraction, copy bandwidth or None: the generator's): small traces whose optimum meets a
# cut with equality (a swap's copies back to back; swap-outs queued behind an earlier one), so a
# cut stronger than the simulator allows lifts the bound above brute force. Found by mutating
# add_cuts (need doubled: caught at the first two; FIFO's earlier copy counted twice: the third).
TIGHT_CASES = [(9, 0.9, None), (26, 0.9, None), (79, 0.9, 2e9)]


@pytest.mark.parametrize(("seed", "fraction", "bandwidth"), TIGHT_CASES)
def test_cuts_tight_at_the_optimum_stay_below_it(seed, fraction, bandwidth):
    problem, budget, best = _cell(seed, fraction, bandwidth)
    assert lower_bound(problem, budget, cpsat=False).bound_ns <= best
    full = lower_bound(problem, budget, time_limit_s=20)
    assert full.bound_ns <= best
    _below_searched_plans(problem, budget, full.bound_ns)


# (seed, fraction): small traces where ``sources_restored`` lifts the full bound (CP-SAT's; not
# the LP's here): 3400 -> 3800 ns at (62, 0.5), brute force 4000; 6300 -> 9900 at (9, 0.8), the
# optimum; 2400 -> 3500 at (26, 0.7), brute force 4100. Made to start one op before the replay
# (or at the gap's start) it lifts (62, 0.5) above brute force (to infinity). Measured over the
# three cuts that were the defaults then (the default rows of Note [Replays take memory] reach
# 3800 at (62, 0.5) by themselves).
SOURCE_CASES = [(62, 0.5), (9, 0.8), (26, 0.7)]
THREE_CUTS = ("one_per_storage", "copies_in_sequence", "swap_outs_in_order")


@pytest.mark.parametrize(("seed", "fraction"), SOURCE_CASES)
def test_restored_sources_cut_binds_and_stays_below_every_plan(seed, fraction):
    from capuchin.planner.bound import CUTS, SOURCES_RESTORED

    problem, budget, best = _cell(seed, fraction)
    cuts = (*THREE_CUTS, SOURCES_RESTORED)
    plain = lower_bound(problem, budget, time_limit_s=20, cuts=THREE_CUTS)
    full = lower_bound(problem, budget, time_limit_s=20, cuts=cuts)
    assert plain.bound_ns < full.bound_ns <= best
    assert lower_bound(problem, budget, cpsat=False, cuts=cuts).bound_ns <= best
    _below_searched_plans(problem, budget, full.bound_ns)
    every = lower_bound(problem, budget, time_limit_s=20, cuts=(*CUTS, SOURCES_RESTORED))
    assert every.bound_ns <= best


def test_search_plans_returns_a_fitting_plan_no_slower_than_its_start():
    from capuchin.planner.build import complete_decisions

    problem = small_problem(3)
    budget = int(problem.peak_bytes * 0.7)
    start = get_policy("capuchin")(problem, budget).decisions
    start_extra = _extra(problem, budget, "capuchin")
    found = search_plans(problem, budget, start, steps=200, seed=1)
    assert found.extra_ns is not None and found.extra_ns <= start_extra
    sim = simulate(problem, complete_decisions(problem, list(found.decisions)))
    assert sim.peak_bytes <= budget
    assert sim.time_ns - problem.time_ns == found.extra_ns
    again = search_plans(problem, budget, start, steps=200, seed=1)
    assert again.extra_ns == found.extra_ns and again.decisions == found.decisions


def test_nothing_over_budget_costs_nothing():
    problem = small_problem(0)
    b = lower_bound(problem, problem.peak_bytes)
    assert b.bound_ns == 0 and b.gap(0) == 0.0


def test_dual_value_is_below_the_lp_optimum_for_any_multipliers(monkeypatch):
    """Note [A bound from any dual]: the solvers' duals give the LP optimum (to the 1 ns shave),
    and multipliers far from optimal (perturbed, signs flipped) give less, never more."""
    import numpy as np
    from capuchin.planner import bound
    from ortools.linear_solver import pywraplp

    models = []
    real = bound._lp_bound
    monkeypatch.setattr(bound, "_lp_bound", lambda m: models.append(m) or real(m))
    problem = small_problem(0)
    bound.lower_bound(problem, int(problem.peak_bytes * 0.8), cpsat=False)
    lp = bound._relaxation(models[0])
    # the LP optimum, by a primal simplex solve of the same arrays (independent of the duals)
    s = pywraplp.Solver.CreateSolver("GLOP")
    xs = [s.NumVar(float(a), float(b), "") for a, b in zip(lp.lo, lp.hi, strict=True)]
    rows = [s.Constraint(float(a), float(b)) for a, b in zip(lp.row_lo, lp.row_hi, strict=True)]
    for r, c, v in zip(lp.rows, lp.cols, lp.vals, strict=True):
        rows[r].SetCoefficient(xs[c], float(v))
    for j in np.nonzero(lp.c)[0]:
        s.Objective().SetCoefficient(xs[j], float(lp.c[j]))
    s.Objective().SetMinimization()
    assert s.Solve() == pywraplp.Solver.OPTIMAL
    opt = s.Objective().Value()
    assert opt > 100  # (565.6 ns here)
    rng = np.random.default_rng(0)
    for solver in ("highs", "glop"):
        y = bound._lp_duals(lp, solver)
        assert isinstance(y, np.ndarray)
        assert opt - 1.01 <= bound._dual_value(lp, y) <= opt
        for scale in (1e-3, 1e-1, 1.0, 10.0):
            noisy = y + scale * np.abs(y).max() * rng.standard_normal(len(y))
            assert bound._dual_value(lp, noisy) <= opt
        flipped = np.where(rng.random(len(y)) < 0.5, -y, y)
        assert bound._dual_value(lp, flipped) <= opt
        assert bound._dual_value(lp, -y) <= opt


def test_dual_value_ignores_a_multiplier_on_a_missing_side():
    """min x over -10 <= x <= 10, x <= 5 (optimum -10): a multiplier of the wrong sign for the
    row's only side must count for nothing, not as if the missing side were 0."""
    import numpy as np
    from capuchin.planner.bound import _dual_value, _Relaxation

    lp = _Relaxation(
        c=np.array([1.0]),
        lo=np.array([-10.0]),
        hi=np.array([10.0]),
        rows=np.array([0]),
        cols=np.array([0]),
        vals=np.array([1.0]),
        row_lo=np.array([-np.inf]),
        row_hi=np.array([5.0]),
    )
    for y in (-3.0, -1.0, 0.0, 1.0, 3.0):
        assert _dual_value(lp, np.array([y])) <= -10
    assert _dual_value(lp, np.array([0.0])) >= -11.01


def _stall_problem(recomputable: bool = True):
    """Ops f0 -> A, f1 -> B, a long op, then two ops over the budget that B must be off for,
    then B's back-access; B's replay (f0, f1) holds A (8 kB) and B (4 kB) over a device that
    has x (1 kB, persistent) and P (3 kB, persistent) on it: 16 kB, more than op ``use``
    itself (9 kB). Swapping B instead stalls its whole in-copy (4,000 ns: it cannot start
    before the peak ops end), dropping it costs the replay (200 ns). Not ``recomputable``: f0
    reads an input already freed at ``use``, so only the swap remains."""
    from capuchin.planner.problem import Problem

    src = "x" if recomputable else "inp"
    ops = [
        ("f0", 100, [src], ["A"]),
        ("f1", 100, ["A"], ["B"]),
        ("mid", 5000, ["x"], ["P"]),
        ("h1", 100, ["x"], ["H"]),
        ("h2", 100, ["H"], ["G"]),
        ("use", 100, ["B"], ["Y"]),
    ]
    sizes = {"x": 1000, "inp": 1000, "A": 8000, "B": 4000, "P": 3000, "H": 8000, "G": 2000}
    sizes["Y"] = 1000
    return Problem.from_lists(
        ops, sizes, bandwidth_bytes_per_s=1e9, persistent={"x", "P"}
    ).restricted()


def test_a_plan_that_stalls_longer_than_every_replay_stays_feasible():
    """The time cuts' clock may reach every stall the model allows: with B not recomputable
    the only plan that fits swaps it and stalls 4,000 ns, far more than any replay (a clock
    capped at the replays' ticks made the model infeasible: bound infinite)."""
    problem = _stall_problem(recomputable=False)
    budget = 15_000
    best = brute_force(problem, budget)
    assert best == 4000
    b = lower_bound(problem, budget, time_limit_s=20)
    assert b.bound_ns <= best and b.lp_ns is not None and b.lp_ns <= best
    assert b.bound_ns > 0


def test_replay_memory_binds_and_is_tight():
    """Note [Replays take memory]: at 15 kB dropping B fits every memory row of the model but
    not the simulator (its replay holds 16 kB): with ``replay_memory`` the bound reaches the
    optimum, the swap (4,000 ns; 200 without it). At 16 kB the replay fits exactly and the
    bound stays at the drop's 200 ns; counting op ``use``'s output as resident during the
    replay, or B itself as back before its own replay, lifts it above brute force there."""
    from capuchin.planner import bound
    from capuchin.planner.bound import CUTS, REPLAY_MEMORY

    problem = _stall_problem()
    cuts = (*CUTS, REPLAY_MEMORY)
    assert brute_force(problem, 15_000) == 4000
    assert lower_bound(problem, 15_000, time_limit_s=20).bound_ns <= 200
    assert lower_bound(problem, 15_000, time_limit_s=20, cuts=cuts).bound_ns == 4000
    lp = lower_bound(problem, 15_000, cpsat=False).bound_ns
    assert lp < lower_bound(problem, 15_000, cpsat=False, cuts=cuts).bound_ns <= 4000
    assert brute_force(problem, 16_000) == 200
    assert lower_bound(problem, 16_000, time_limit_s=20, cuts=cuts).bound_ns <= 200
    real = bound._replay_memory
    for mutant in ("op", "back"):
        bound._replay_memory = lambda m, p, mutant=mutant: real(m, p, mutant)
        try:
            got = lower_bound(problem, 16_000, time_limit_s=20, cuts=cuts).bound_ns
        finally:
            bound._replay_memory = real
        assert got > 200, mutant


# (seed, fraction): small traces where ``tight_memory`` (the memory rows' coefficients capped
# at the row's excess) lifts the LP bound: 282 -> 506 ns at (0, 0.9), brute force 1000; 370 ->
# 1599 at (21, 0.8), brute force 1600; 265 -> 1799 at (62, 0.5), brute force 4000; 3 -> 1115
# at (66, 0.9), brute force 1800. Capped at half the excess it lifts (0, 0.9) above brute force.
TIGHT_MEMORY_CASES = [(0, 0.9), (21, 0.8), (62, 0.5), (66, 0.9)]


@pytest.mark.parametrize(("seed", "fraction"), TIGHT_MEMORY_CASES)
def test_tight_memory_rows_bind_and_stay_below_every_plan(seed, fraction):
    from capuchin.planner.bound import CUTS, TIGHT_MEMORY

    problem, budget, best = _cell(seed, fraction)
    loose = tuple(c for c in CUTS if c != TIGHT_MEMORY)
    plain = lower_bound(problem, budget, cpsat=False, cuts=loose)
    tight = lower_bound(problem, budget, cpsat=False)
    assert plain.bound_ns < tight.bound_ns <= best
    full = lower_bound(problem, budget, time_limit_s=20)
    assert full.bound_ns <= best
    _below_searched_plans(problem, budget, full.bound_ns)


def test_tight_memory_capped_below_the_excess_overshoots(monkeypatch):
    """The cap is the row's excess, no lower: at half of it the bound exceeds brute force."""
    from capuchin.planner.policies import _ilp_model

    problem, budget, best = _cell(0, 0.9)
    assert lower_bound(problem, budget, cpsat=False).bound_ns <= best
    monkeypatch.setattr(
        _ilp_model,
        "tightened",
        lambda terms, need: [(n, min(s, max(1, need // 2)), v) for n, s, v in terms],
    )
    assert lower_bound(problem, budget, cpsat=False).bound_ns > best


@pytest.mark.parametrize(("seed", "fraction", "kind"), CASES)
def test_every_cut_family_stays_below_brute_force(seed, fraction, kind):
    """All of add_cuts' families and the model's opt-in rows together, LP and CP-SAT."""
    from capuchin.planner.bound import CUTS, REPLAY_MEMORY, SOURCES_RESTORED

    problem = small_problem(seed)
    budget = int(problem.peak_bytes * fraction)
    best = brute_force(problem, budget)
    if best is None:
        assert kind == "infeasible"
        return
    cuts = (*CUTS, SOURCES_RESTORED, REPLAY_MEMORY)
    full = lower_bound(problem, budget, time_limit_s=10, cuts=cuts)
    assert full.bound_ns <= best and full.lp_ns is not None and full.lp_ns <= best
    _below_searched_plans(problem, budget, full.bound_ns)


def test_kept_resident_binds_and_is_tight(monkeypatch):
    """Note [Replays take memory], ``kept_resident`` (a default): X's replay (op p) regenerates
    S whole, which the model may count kept there for free and still off at the two ops over
    the budget after X's back-access. At 11 kB the plan that keeps S does not fit (12 kB with
    S resident there): S is replayed again at its own back-access, 200 ns; the model without
    the rows says 100. At 12 kB keeping S fits (100 ns) and the bound stays there; counting S
    resident from the op before the replay that keeps it lifts the bound above that plan."""
    from capuchin.planner.bound import CUTS, KEPT_RESIDENT
    from capuchin.planner.plan import Decision, Method
    from capuchin.planner.policies import _ilp_model
    from capuchin.planner.problem import Problem

    ops = [
        ("p", 100, ["x"], ["X", "S"]),
        ("a", 100, ["X", "S"], ["Q"]),
        ("h1", 100, ["x"], ["H1"]),
        ("h2", 100, ["H1"], ["G1"]),
        ("useX", 100, ["X", "G1"], ["R1"]),
        ("h3", 100, ["x"], ["H2"]),
        ("h4", 100, ["H2"], ["G2"]),
        ("useS", 100, ["S", "G2"], ["Z"]),
    ]
    sizes = {"x": 1000, "X": 2000, "S": 4000, "Q": 1000, "H1": 9000, "G1": 1000}
    sizes.update({"R1": 1000, "H2": 6000, "G2": 1000, "Z": 1000})
    problem = Problem.from_lists(ops, sizes, persistent={"x"}).restricted()
    peaks = {}
    for keep in ((), ("S",)):
        plan = [
            Decision("X", Method.RECOMPUTE, 2000, 1, 4, replay_ops=(0,), sources=("x",), keep=keep),
            Decision("S", Method.RECOMPUTE, 4000, 1, 7, replay_ops=(0,), sources=("x",)),
        ]
        sim = simulate(problem, plan)
        peaks[keep] = (sim.peak_bytes, sim.time_ns - problem.time_ns)
    assert peaks == {(): (11_000, 200), ("S",): (12_000, 100)}
    assert KEPT_RESIDENT in CUTS
    loose = tuple(c for c in CUTS if c != KEPT_RESIDENT)
    assert lower_bound(problem, 11_000, time_limit_s=20, cuts=loose).bound_ns <= 100
    assert lower_bound(problem, 11_000, time_limit_s=20).bound_ns == 200
    assert lower_bound(problem, 11_000, cpsat=False).bound_ns <= 200
    _below_searched_plans(problem, 11_000, lower_bound(problem, 11_000).bound_ns)
    assert lower_bound(problem, 12_000, time_limit_s=20).bound_ns <= 100
    monkeypatch.setattr(_ilp_model, "kept_ops", lambda b, back: range(b - 1, back))
    assert lower_bound(problem, 12_000, time_limit_s=20).bound_ns > 100


def test_a_kept_storage_read_by_a_later_replay_costs_no_replay_of_its_own():
    """_ilp_model Note [A kept storage is a source]: X's replay (op p) keeps S; W's replay (op
    w) reads S, resident since. The plan costs p + w = 1,100 ns in the simulator and fits; the
    model charged p again at W's replay (2,100 ns: a bound above a plan that fits)."""
    from capuchin.planner.plan import Decision, Method
    from capuchin.planner.problem import Problem

    ops = [
        ("p", 1000, ["x"], ["X", "S"]),
        ("w", 100, ["S"], ["W"]),
        ("h1", 100, ["x"], ["H1"]),
        ("h2", 100, ["H1"], ["G1"]),
        ("useX", 100, ["X", "G1"], ["R1"]),
        ("useW", 100, ["W"], ["R2"]),
        ("h3", 100, ["x"], ["H3"]),
        ("useS", 100, ["S"], ["Z"]),
    ]
    sizes = {"x": 1000, "X": 2000, "S": 4000, "W": 2000, "H1": 8000}
    sizes.update({s: 1000 for s in ("G1", "R1", "R2", "H3", "Z")})
    problem = Problem.from_lists(
        ops, sizes, bandwidth_bytes_per_s=1e8, persistent={"x"}
    ).restricted()
    budget = 10_000
    plan = [
        Decision("X", Method.RECOMPUTE, 2000, 0, 4, replay_ops=(0,), sources=("x",), keep=("S",)),
        Decision("W", Method.RECOMPUTE, 2000, 1, 5, replay_ops=(1,), sources=("S",)),
        Decision("S", Method.RECOMPUTE, 4000, 1, 7, replay_ops=(0,), sources=("x",)),
    ]
    sim = simulate(problem, plan)
    assert sim.peak_bytes <= budget and sim.time_ns - problem.time_ns == 1100
    from capuchin.planner.bound import CUTS, REPLAY_MEMORY, SOURCES_RESTORED

    for cuts in (CUTS, (*CUTS, SOURCES_RESTORED, REPLAY_MEMORY)):
        b = lower_bound(problem, budget, time_limit_s=20, cuts=cuts)
        assert 0 < b.bound_ns <= 1100 and b.lp_ns <= 1100
