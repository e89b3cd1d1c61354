"""Tiny hand-built traces whose right answer is known, planned by the registered policies."""

from __future__ import annotations

import pytest
from capuchin.errors import InfeasibleBudgetError
from capuchin.planner.api import make_plan
from capuchin.planner.plan import Method, Plan
from capuchin.planner.problem import Problem
from capuchin.planner.simulator import simulate, simulate_plan

US = 1000  # ns


def swap_hides_problem() -> Problem:
    """A (400 B) is made first and read again only at the end; long ops in between.

    Copies of A take 400 ns at 1 GB/s; the ops between its accesses take 1 us each, so a swap
    fully hides. A cannot be recomputed (its input X is freed after op 0).
    """
    ops = [
        ("f0", US, ["X"], ["A"]),
        ("f1", US, ["A"], ["B"]),
        ("f2", US, ["B"], ["C"]),
        ("f3", US, ["C"], ["D"]),  # peak: A, C, D (and B freed after f2)
        ("f4", US, ["D"], ["E"]),
        ("f5", US, ["E"], ["F"]),
        ("b", US, ["F", "A"], ["G"], [], "backward"),
    ]
    sizes = {"X": 4, "A": 400, "B": 100, "C": 300, "D": 300, "E": 50, "F": 50, "G": 10}
    return Problem.from_lists(ops, sizes, bandwidth_bytes_per_s=1e9)


def recompute_only_problem() -> Problem:
    """B (400 B) = cheap(W); W is a parameter, so B can be recomputed from it at any time.

    The copy channel is so slow (1 MB/s: 400 us per copy) that a swap-out of B would not even
    finish before the peak, so swapping cannot lower the peak; recomputing B costs one 100 ns op.
    """
    ops = [
        ("cheap", 100, ["W"], ["B"]),
        ("f1", US, ["B"], ["C"]),
        ("f2", US, ["C"], ["D"]),  # peak: B, C, D
        ("f3", US, ["D"], ["E"]),
        ("b", US, ["E", "B"], ["G"], [], "backward"),
    ]
    sizes = {"W": 8, "B": 400, "C": 300, "D": 300, "E": 20, "G": 10}
    return Problem.from_lists(ops, sizes, persistent=["W"], bandwidth_bytes_per_s=1e6)


def dead_source_problem() -> Problem:
    """T3 = g(T2), T2 = f(T1): T2 is read only by g, so it is freed before T3's back-access.

    Recomputing T3 must replay f then g from T1 (a parameter), with T2 a temporary.
    """
    ops = [
        ("f", 200, ["T1"], ["T2"]),
        ("g", 300, ["T2"], ["T3"]),
        ("h1", US, ["T3"], ["U"]),
        ("h2", US, ["U"], ["V"]),  # peak: T3, U, V
        ("h3", US, ["V"], ["Y"]),
        ("b", US, ["Y", "T3"], ["Z"], [], "backward"),
    ]
    sizes = {"T1": 8, "T2": 100, "T3": 400, "U": 300, "V": 300, "Y": 20, "Z": 10}
    return Problem.from_lists(ops, sizes, persistent=["T1"], bandwidth_bytes_per_s=1e6)


def test_swap_hides_fully():
    p = swap_hides_problem()
    # op 2 still holds A while its copy runs (freed when the copy completes, paper §5.3): 800 B
    budget = p.peak_bytes - 200
    plan = make_plan(p, budget)
    assert [(d.storage_id, d.method) for d in plan.decisions] == [("A", Method.SWAP)]
    d = plan.decisions[0]
    assert (d.evict_op, d.back_op) == (1, 6)
    sim = simulate(p, plan.decisions)
    assert sim.peak_bytes <= budget
    assert sim.time_ns == p.time_ns  # fully hidden: no stall
    assert d.predicted_stall_ns == 0
    # the in-trigger is not inside the peak window and comes late enough to cover the peak op
    assert d.trigger_op is not None and d.trigger_op > p.peak_op
    assert sim.op_peak_bytes[d.trigger_op] <= budget
    # recompute-only cannot do it: A's input is gone
    with pytest.raises(InfeasibleBudgetError):
        make_plan(p, budget, policy="recompute")


def test_only_recomputation_helps():
    p = recompute_only_problem()
    budget = p.peak_bytes - 300
    with pytest.raises(InfeasibleBudgetError) as err:
        make_plan(p, budget, policy="swap")
    assert err.value.smallest_feasible_bytes > budget
    plan = make_plan(p, budget)  # the hybrid policy picks recomputation
    assert [(d.storage_id, d.method) for d in plan.decisions] == [("B", Method.RECOMPUTE)]
    d = plan.decisions[0]
    assert d.replay_ops == (0,) and d.sources == ("W",)
    sim = simulate(p, plan.decisions)
    assert sim.peak_bytes <= budget
    assert sim.time_ns == p.time_ns + 100  # one replayed op
    assert d.predicted_recompute_ns == 100


def test_source_dies_before_back_access():
    p = dead_source_problem()
    assert not p.storages["T2"].alive_at(5)
    budget = p.peak_bytes - 300
    plan = make_plan(p, budget, policy="recompute")
    (d,) = plan.decisions
    assert d.storage_id == "T3" and d.method == Method.RECOMPUTE
    assert d.replay_ops == (0, 1)  # f then g: T2 is regenerated as a temporary
    assert d.sources == ("T1",)
    sim = simulate(p, plan.decisions)
    assert sim.time_ns == p.time_ns + 500
    # during the replay T2 (100 B) and T3 (400 B) exist together on top of what is live
    live_before = int(p.live_bytes[5]) - 400 - 10  # op 5 allocates Z (10 B); T3 counted there
    assert sim.op_peak_bytes[5] >= live_before + 100 + 400
    assert sim.peak_bytes <= budget


def test_budget_at_or_above_peak_gives_empty_plan():
    p = swap_hides_problem()
    plan = make_plan(p, p.peak_bytes)
    assert plan.decisions == [] and plan.actions == []
    assert plan.predictions.predicted_peak_bytes == p.peak_bytes
    assert any("nothing to evict" in n for n in plan.predictions.notes)


def test_below_floor_names_smallest_feasible_budget():
    p = swap_hides_problem()
    with pytest.raises(InfeasibleBudgetError) as err:
        make_plan(p, 10)
    best = err.value.smallest_feasible_bytes
    assert best is not None and best > 10 and str(best) in str(err.value)
    plan = make_plan(p, best)  # the named budget is indeed feasible
    assert plan.predictions.feasible


def test_action_table_and_json_round_trip(tmp_path):
    p = dead_source_problem()
    plan = make_plan(p, p.peak_bytes - 300)
    steps = {(a.op_index, a.step.value, a.storage_id) for a in plan.actions}
    d = plan.decisions[0]
    assert (d.evict_op, "evict_drop", d.storage_id) in steps
    assert (d.back_op, "recompute", d.storage_id) in steps
    path = plan.save(tmp_path / "x.plan.json")
    back = Plan.from_json(path.read_text())
    assert back.decisions == plan.decisions and back.actions == plan.actions
    assert back.provenance == plan.provenance and back.ops == plan.ops
    assert back.summary() == plan.summary()
    assert len(plan.ops) == p.n_ops and plan.provenance.trace_fingerprint == p.fingerprint()
    sim = simulate_plan(back, p)
    assert sim.peak_bytes == plan.predictions.predicted_peak_bytes
    assert list(back.decisions_frame()["storage_id"]) == ["T3"]


def test_collective_recomputation_chosen_by_the_policy():
    """A chain of cheap ops whose outputs are all needed again, in reverse order, late: with
    swapping impossible (tiny bandwidth), the policy recomputes them and the first replay keeps
    the intermediates the next back-accesses need (paper §5.3)."""
    ops = [
        ("p", 10, ["W"], ["T1"]),
        ("f2", 10, ["T1"], ["T2"]),
        ("f3", 10, ["T2"], ["T3"]),
        ("f4", 10, ["T3"], ["T4"]),
        ("big", US, ["T4"], ["H"]),
        ("use", US, ["H"], ["Y"]),
        ("b4", 10, ["Y", "T4"], ["G4"], [], "backward"),
        ("b3", 10, ["G4", "T3"], ["G3"], [], "backward"),
        ("b2", 10, ["G3", "T2"], ["G2"], [], "backward"),
    ]
    sizes = {
        "W": 8,
        "T1": 100,
        "T2": 100,
        "T3": 100,
        "T4": 100,
        "H": 300,
        "Y": 10,
        "G4": 10,
        "G3": 10,
        "G2": 10,
    }
    p = Problem.from_lists(ops, sizes, persistent=["W"], bandwidth_bytes_per_s=1e3)
    plan = make_plan(p, p.peak_bytes - 200, "recompute")
    sim = simulate(p, plan.decisions)
    assert sim.peak_bytes <= plan.budget_bytes
    assert all(d.method == Method.RECOMPUTE for d in plan.decisions)
    kept = {k for d in plan.decisions for k in d.keep}
    assert kept  # some intermediate is regenerated once and kept
    replays = {o.storage_id: o.recompute_ns for o in sim.outcomes}
    assert any(replays[k] == 0 for k in kept)  # its own back-access replays nothing


def test_top_level_api():
    import capuchin

    p = dead_source_problem()
    plan = capuchin.make_plan(p, budget=p.peak_bytes - 300, policy="capuchin")
    assert isinstance(plan, capuchin.Plan)
    assert capuchin.parse_budget("50%", peak_bytes=10) == 5
    mem = simulate_plan(plan, p).memory
    assert {"time_ns", "live_bytes", "op_index"} <= set(mem.columns)
    assert int(mem["live_bytes"].max()) == plan.predictions.predicted_peak_bytes
