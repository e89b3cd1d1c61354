"""Stage coarsening and the ILP model: partitions, the relaxation property, the policy's contract."""

from __future__ import annotations

import random
import sys

import pytest
from capuchin.errors import CapuchinError
from capuchin.planner.coarsen import coarsen

# ---- coarsening (no OR-Tools needed) -------------------------------------------------------------


def _check_partition(st, dur, live):
    n = len(dur)
    assert st.first_op[0] == 0 and st.last_op[-1] == n - 1
    for a, b in zip(st.last_op, st.first_op[1:], strict=False):
        assert b == a + 1  # contiguous, no overlap
    for s in range(len(st)):
        ops = range(st.first_op[s], st.last_op[s] + 1)
        assert st.duration_ns[s] == sum(dur[k] for k in ops)
        assert st.peak_bytes[s] == max(live[k] for k in ops)
        for k in ops:
            assert st.stage_of(k) == s


@pytest.mark.parametrize("seed", range(5))
def test_coarsen_is_a_partition_within_the_target(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 60)
    dur = [rng.randint(0, 1000) for _ in range(n)]
    live = [rng.randint(0, 10**6) for _ in range(n)]
    for target in (1, 3, 10, n, n + 5):
        st = coarsen(dur, live, max_stages=target)
        _check_partition(st, dur, live)
        assert len(st) == min(target, n)
    assert coarsen(dur, live, max_stages=n).is_op_level


def test_coarsen_fuses_cheap_chains_and_keeps_expensive_ops_alone():
    dur = [1, 1, 1, 500, 1, 1, 1, 1, 400, 1]
    st = coarsen(dur, [0] * len(dur), max_stages=4)
    assert (3, 3) in set(zip(st.first_op, st.last_op, strict=True))
    assert st.duration_ns[st.stage_of(4)] == 4  # the cheap chain 4..7 fused alone
    assert st.duration_ns[st.stage_of(8)] <= 401


def test_coarsen_keeps_pinned_boundaries_by_priority():
    dur = [1] * 10
    st = coarsen(dur, [0] * 10, max_stages=3, pinned={5: 10, 7: 5})
    assert set(st.first_op) == {0, 5, 7}
    st = coarsen(dur, [0] * 10, max_stages=2, pinned={5: 10, 7: 5, 2: 1})
    assert set(st.first_op) == {0, 5}  # only the highest priority fits


def test_coarsen_empty():
    assert len(coarsen([], [], max_stages=5)) == 0


# ---- the ILP -------------------------------------------------------------------------------------
ortools = pytest.importorskip("ortools")

from capuchin.planner.build import build_plan  # noqa: E402
from capuchin.planner.policies import ilp  # noqa: E402
from capuchin.planner.problem import Problem  # noqa: E402
from capuchin.tracer.synthetic import trace_from_ops, transformer_ops  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_ilp_bruteforce import small_problem  # noqa: E402


def _fixed_solve(problem, budget, choices):
    """The op-level ILP with every candidate's choice fixed: (feasible, objective ns)."""
    from ortools.sat.python import cp_model

    cands = ilp.candidates(problem, budget)
    stages = coarsen(problem.durations_ns.tolist(), problem.live_bytes.tolist(), max_stages=10**6)
    model = ilp._Model(problem, stages, budget, cands, tick_ns=max(1, problem.time_ns // 100_000))
    for lit in model.literals(choices):
        model.m.add(lit == 1)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 10
    code = solver.solve(model.m)
    assert code != cp_model.UNKNOWN
    if code == cp_model.INFEASIBLE:
        return False, None
    return True, int(round(solver.objective_value)) // model.scale


@pytest.mark.parametrize("seed", [1, 2, 7, 10])
def test_ilp_is_a_relaxation_of_the_simulator(seed):
    """Note [Where the ILP and the simulator differ]: at op granularity, every choice the
    simulator accepts the ILP accepts too, at no more than the simulated extra time."""
    problem = small_problem(seed)
    budget = int(problem.peak_bytes * 0.8)
    cands = ilp.candidates(problem, budget)
    by_key = {c.key: c for c in cands}
    rng = random.Random(seed)
    checked = 0
    for _ in range(100):
        ch = {}
        for c in cands:
            opts = [ilp.Choice.KEEP, ilp.Choice.SWAP]
            if c.chain is not None:
                opts.append(ilp.Choice.RECOMPUTE)
            ch[c.key] = rng.choice(opts)
        sim = ilp.simulated_extra_ns(problem, budget, ilp.to_decisions(problem, budget, by_key, ch))
        if sim is None:
            continue
        feasible, objective = _fixed_solve(problem, budget, ch)
        assert feasible, ch
        assert objective <= sim, (ch, objective, sim)
        checked += 1
    assert checked >= 10  # the sample must exercise the property


def _transformer(hidden=1 << 14):
    ops, sizes, persistent = transformer_ops(layers=2, ops_per_layer=12, hidden_bytes=hidden)
    return Problem.from_trace(
        trace_from_ops(ops, sizes, persistent=persistent, bandwidth_bytes_per_s=2e9)
    )


@pytest.mark.slow
def test_coarse_plan_passes_the_simulator_and_reports_its_solve():
    problem = _transformer()  # 54 ops
    budget = int(problem.peak_bytes * 0.5)
    result = ilp.ilp_policy(problem, budget, max_stages=24, time_limit_s=5)
    ds, p = result.decisions, result.figures
    assert p["stages"] == 24 and not p["op_level"]
    assert result.status == p["status"] and result.status in ("OPTIMAL", "FEASIBLE")
    assert result.bound_ns == p["ilp_objective_ns"] and result.notes == tuple(p["notes"])
    assert p["solve_time_s"] < 5 + 3  # the time limit holds (model building included)
    plan, sim = build_plan(problem, ds, policy="ilp", budget_bytes=budget, parameters=p)
    assert plan.predictions.feasible and sim.peak_bytes <= budget
    assert p["simulated_extra_ns"] == sim.time_ns - problem.time_ns
    assert 0.0 <= p["optimality_gap"] <= 1.0
    # the ILP's bound never exceeds what it found (it is a lower bound of its decision space)
    assert p["ilp_objective_ns"] <= p["simulated_extra_ns"]
    assert plan.provenance.parameters["optimality_gap"] == p["optimality_gap"]


@pytest.mark.slow
def test_warm_start_is_never_beaten_by_its_own_hint():
    """With the capuchin plan as warm start, the ILP's plan is at least as good in the
    simulator (the hint is the first incumbent, with the hybrid's own in-triggers)."""
    from capuchin.planner.registry import get_policy

    problem = _transformer()
    budget = int(problem.peak_bytes * 0.5)
    cap = get_policy("capuchin")(problem, budget).decisions
    _, cap_sim = build_plan(problem, cap, policy="capuchin", budget_bytes=budget)
    result = ilp.ilp_policy(problem, budget, max_stages=24, time_limit_s=5)
    _, sim = build_plan(problem, result.decisions, policy="ilp", budget_bytes=budget)
    # the guarantee holds when the hybrid's plan maps whole onto the ILP's candidates
    whole = not any(n.startswith(("no warm start", "warm start:")) for n in result.notes)
    assert cap_sim.peak_bytes <= budget and whole  # else this case no longer tests anything
    assert sim.peak_bytes <= budget
    assert sim.time_ns <= cap_sim.time_ns


def test_budget_cases():
    problem = small_problem(3)
    # at or above the peak: nothing to do, proven
    r = ilp.ilp_policy(problem, problem.peak_bytes)
    assert r.decisions == () and r.status == "OPTIMAL"
    # below what must stay resident: no plan, no exception
    r = ilp.ilp_policy(problem, max(1, problem.floor_bytes() - 1))
    assert r.decisions == () and r.status == "INFEASIBLE"


def test_zero_size_storages_are_never_candidates():
    ops = [
        ("f", 10, ["X"], ["A"]),
        ("g", 10, ["A"], ["Z"]),
        ("h", 10, ["A", "Z"], ["B"]),
        ("i", 10, ["B", "A", "Z"], ["C"]),
    ]
    problem = Problem.from_lists(ops, {"X": 4, "A": 8, "Z": 0, "B": 8, "C": 4})
    budget = problem.peak_bytes - 4
    assert all(c.size_bytes > 0 for c in ilp.candidates(problem, budget))
    r = ilp.ilp_policy(problem, budget, max_stages=100)
    plan, sim = build_plan(problem, r.decisions, policy="ilp", budget_bytes=budget)
    assert all(d.storage_id != "Z" for d in plan.decisions)
    assert plan.predictions.feasible == (r.status != "INFEASIBLE")


def test_missing_ortools_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)
    monkeypatch.setitem(sys.modules, "ortools.sat.python.cp_model", None)
    problem = small_problem(0)
    with pytest.raises(CapuchinError, match=r"pip install capuchin\[ilp\]"):
        ilp.ilp_policy(problem, int(problem.peak_bytes * 0.7), warm_start=False)
