"""Several eviction windows per storage (planner/plan.py Note [Several windows per storage]): the
simulator against its oracle, the refusals of overlapping windows (simulator and plan load),
and the runtime carrying out a plan that evicts one parameter or Adam moment twice an
iteration, bitwise."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from capuchin.errors import PlanError, PlanFormatError
from capuchin.planner import simulator
from capuchin.planner.build import build_plan
from capuchin.planner.plan import Decision, Method, Plan
from capuchin.planner.policies.capuchin import capuchin as capuchin_policy
from capuchin.planner.problem import Problem
from capuchin.planner.simulator import simulate
from capuchin.tracer.schema import Kind

from .test_persistent import _adam_like

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oracle_simulator import oracle_pass  # noqa: E402
from test_simulator_fast import SCALARS, assert_same  # noqa: E402


def _same_as_oracle(p: Problem, ds: list[Decision]):
    bw_out, bw_in = p.bandwidth_d2h_bytes_per_s, p.bandwidth_h2d_bytes_per_s
    ref = simulator._steady(p, tuple(ds), bw_out, bw_in, oracle_pass)
    got = simulator._steady(p, tuple(ds), bw_out, bw_in, simulator._pass, detail=True)
    for f in SCALARS:
        assert getattr(got, f) == getattr(ref, f), f
    assert_same(got, ref)
    return got


def _windows(p: Problem, sid: str, trigger_lead: int = 1) -> list[Decision]:
    """Every window of persistent storage ``sid``: each gap within the iteration and the
    wrap-around one, each prefetched ``trigger_lead`` ops before its back-access (a wrap-around
    one in the next iteration)."""
    s = p.storages[sid]
    ds = [
        Decision(sid, Method.SWAP, s.size_bytes, a, b, trigger_op=max(a + 1, b - trigger_lead))
        for a, b in s.gaps()
    ]
    last, first = s.wrap
    trig = max(0, first - trigger_lead)
    ds.append(Decision(sid, Method.SWAP, s.size_bytes, last, first, trigger_op=trig, wraps=True))
    return ds


@pytest.mark.parametrize("bw", [1e12, 4e9])  # copies that hide, copies that stall
def test_a_parameter_out_in_every_gap_simulates_as_the_oracle(bw):
    p = _adam_like(bw)
    w = p.storages["W"]
    assert list(w.accesses) == [1, 5, 6] and w.wrap == (6, 1)
    ds = _windows(p, "W", 0)  # (1, 5), (5, 6) and (6, 1): they touch at ops 5, 6 and 1
    ds.insert(1, Decision("W", Method.SWAP, w.size_bytes, 5, 6))  # no op inside: on demand
    assert [(d.evict_op, d.back_op) for d in ds] == [(1, 5), (5, 6), (6, 1)]
    sim = _same_as_oracle(p, ds)
    assert len(sim.outcomes) == 3
    for d in ds:
        _same_as_oracle(p, [d])
    if bw == 1e12:  # copies take no time: W is off the curve wherever no op accesses it
        base = simulate(p, []).op_peak_bytes
        off = [int(x) for x in base - sim.op_peak_bytes]
        assert off == [400, 0, 400, 400, 400, 0, 0, 400], off
    # the same plan through the public entry (its static checks accept touching windows)
    assert simulate(p, ds).peak_bytes == sim.peak_bytes


def test_overlapping_windows_of_one_storage_are_refused():
    p = _adam_like()
    a, wrap = _windows(p, "W")
    b = Decision("W", Method.SWAP, a.size_bytes, 5, 6)
    with pytest.raises(PlanError, match="overlaps"):
        simulate(p, [a, a])
    on_demand = Decision("W", Method.SWAP, a.size_bytes, a.evict_op, a.back_op)
    with pytest.raises(PlanError, match="overlaps"):  # the same gap, another trigger
        simulate(p, [a, b, on_demand, wrap])
    simulate(p, [a, b, wrap])  # touching windows are fine


def test_the_first_overlap_in_plan_order_is_named_checked_again_or_not():
    """check_decisions checks each storage's decisions once per problem (the windows memo):
    the error names the storage whose overlapping decision comes first in the plan, the same
    when the same decisions come again (from the memo) as the first time."""
    p = _adam_like()
    a = _windows(p, "W")[0]
    on_demand = Decision("W", Method.SWAP, a.size_bytes, a.evict_op, a.back_op)
    size = p.storages["A"].size_bytes
    x = Decision("A", Method.SWAP, size, 1, 2)
    y = Decision("A", Method.SWAP, size, 1, 2, trigger_op=2)
    for _ in range(2):  # the second time from the memo
        # W's first decision comes first, but A's overlapping one (3rd) before W's (4th)
        with pytest.raises(PlanError, match=r"^storage A: 2 decisions evict it: .*overlaps"):
            simulator.check_decisions(p, [a, x, y, on_demand])
        with pytest.raises(PlanError, match=r"^storage W: 2 decisions evict it: .*overlaps"):
            simulator.check_decisions(p, [a, on_demand, x, y])
        simulator.check_decisions(p, [a, x])  # one decision each: fine


def _plan_doc(p: Problem, ds: list[Decision]) -> dict:
    plan, _ = build_plan(p, ds, policy="hand", budget_bytes=p.peak_bytes)
    back = Plan.from_json(plan.to_json())
    assert back.decisions == plan.decisions  # several windows of one storage load back
    return json.loads(plan.to_json())


def _windows_of(doc: dict, sid: str) -> list[dict]:
    return [d for d in doc["decisions"] if d["storage_id"] == sid]


def test_a_plan_with_overlapping_windows_is_refused_at_load():
    p = _adam_like()
    a, wrap = _windows(p, "W")
    doc = _plan_doc(p, [a, Decision("W", Method.SWAP, a.size_bytes, 5, 6), wrap])
    assert len(_windows_of(doc, "W")) == 3

    def refused(doc: dict, match: str) -> None:
        with pytest.raises(PlanFormatError, match=match):
            Plan.from_json(json.dumps(doc))

    bad = json.loads(json.dumps(doc))
    inside, _, wrap = _windows_of(bad, "W")
    inside["back_op"] = 6  # (1, 6) overlaps (5, 6)
    refused(bad, "'W' has two decisions .*overlaps")
    bad = json.loads(json.dumps(doc))
    _, _, wrap = _windows_of(bad, "W")
    wrap["back_op"] = 2  # the wrap-around window runs into the next iteration's (1, 5)
    refused(bad, "'W' has two decisions .*overlaps")
    bad = json.loads(json.dumps(doc))
    inside, between, _ = _windows_of(bad, "W")
    for d in (inside, between):  # two recomputations of one storage: the runtime keys by it
        d.update(method="recompute", replay_ops=[1], trigger_op=None)
    refused(bad, "two recomputations")


def test_the_runtime_keys_decisions_by_storage_and_window():
    from capuchin.runtime.actions import compile_plan

    p = _adam_like()
    a, wrap = _windows(p, "W")
    between = Decision("W", Method.SWAP, a.size_bytes, 5, 6)
    plan, _ = build_plan(p, [a, between, wrap], policy="hand", budget_bytes=p.peak_bytes)
    tbl = compile_plan(plan)
    evicted = {k: [s for s, sid in acts.after] for k, acts in tbl.ops.items() if acts.after}
    assert sorted(evicted) == [1, 5, 6]
    for k, d in ((1, a), (5, between), (6, wrap)):  # each eviction is its own window's
        assert tbl.evicting("W", k).back_op == d.back_op
    assert tbl.evicting("W", 6).wraps and not tbl.evicting("W", 5).wraps
    assert tbl.evicting("W", 2) is None


# ---- the policy ----------------------------------------------------------------------------------
def _state_twice() -> Problem:
    """W, a parameter, read in forward and backward and written by the optimizer; M, its Adam
    moment; T, a large activation between W's forward and backward use, U a large temporary
    after the optimizer step. Only W and M can make room: W over its gap within the iteration
    (for T) and across the boundary (for U), M across the boundary."""
    ops = [
        ("f0", 100, ["X"], ["X1"]),
        ("f1", 100, ["X1", "W"], ["A"]),
        ("f2", 100, ["A"], ["T"]),
        ("f3", 100, ["T"], ["B"]),
        ("b3", 100, ["T", "B"], ["GB"], [], "backward"),
        ("b2", 100, ["GB", "A", "W"], ["G"], [], "backward"),
        ("opt", 100, ["G"], [], ["W", "M"], "optimizer"),
        ("post", 100, ["X"], ["U"]),
        ("post2", 100, ["U"], ["V"]),
    ]
    small = dict.fromkeys(["X", "X1", "A", "B", "GB", "G", "V"], 10)
    sizes = {**small, "W": 400, "M": 400, "T": 1000, "U": 1000}
    return Problem.from_lists(
        ops,
        sizes,
        persistent=["W", "M"],
        kinds={"M": Kind.OPTIMIZER_STATE},
        bandwidth_bytes_per_s=1e12,
    )


def test_capuchin_swaps_a_parameter_in_both_of_its_gaps_to_reach_the_floor():
    """policies/capuchin.py Note [A candidate per gap of persistent storages]: with one decision
    per storage the smallest plan was 1,410 B (W out for T only); the floor is 1,020 B."""
    p = _state_twice()
    assert p.storages["W"].gaps() == [(1, 5)] and p.storages["W"].wrap == (6, 1)
    floor = p.floor_bytes()
    assert floor == 1020 and p.peak_bytes == 1840
    ds = capuchin_policy(p, floor).decisions
    assert simulate(p, ds).peak_bytes <= floor
    w = sorted((d.evict_op, d.back_op, d.wraps) for d in ds if d.storage_id == "W")
    assert w == [(1, 5, False), (6, 1, True)]
    plan, _ = build_plan(p, ds, policy="capuchin", budget_bytes=floor)
    assert Plan.from_json(plan.to_json()).decisions == plan.decisions


# ---- runtime ---------------------------------------------------------------------------------
SCRIPT = Path(__file__).resolve().parent / "frameworks" / "big_state.py"


@pytest.mark.slow
def test_big_state_trains_bitwise_with_its_state_out_in_every_gap(tmp_path):
    """Both embeddings and their four Adam moments (768 kB each) out in every gap: between
    their forward use (or their first Adam op) and their update, and across the iteration
    boundary, so each leaves twice an iteration; the budget is the plan's simulated peak."""
    from capuchin.planner.api import load_problem
    from capuchin.runtime.engine import Runtime
    from capuchin.testing.training import FIXED_BANDWIDTH, run_example, state_mismatches

    from .test_frameworks_big_state import traced_with_fixed_costs

    p = load_problem(traced_with_fixed_costs(tmp_path), bandwidth=FIXED_BANDWIDTH)
    big = [
        sid
        for sid, s in p.storages.items()
        if s.persistent and s.wrap is not None and s.gaps() and s.size_bytes >= 500_000
    ]
    assert len(big) == 6, big
    ds = [d for sid in big for d in _windows(p, sid, trigger_lead=2)]
    assert len(ds) == 12
    sim = simulate(p, ds)
    assert sim.peak_bytes < p.peak_bytes - 3 * 768_000
    plan, _ = build_plan(p, ds, policy="hand", budget_bytes=sim.peak_bytes)

    args = ["--steps", "6"]
    rt = Runtime(plan, measure_memory=True)
    got = run_example(SCRIPT, args, rt)
    assert state_mismatches(run_example(SCRIPT, args), got) == []
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 2]
    assert len(its) == 4 and not any(s.diverged for s in its)
    assert all(s.evictions == len(ds) for s in its), [s.evictions for s in its]
    ratios = [round(s.peak_bytes / plan.budget_bytes, 3) for s in its]
    assert all(r <= 1.05 for r in ratios), ratios
