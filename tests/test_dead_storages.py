"""Dead decisions (planner/dead.py Note [Dead storages]): a storage the script holds after its last
access is swapped out there and never brought back by the plan. The simulator against its oracle,
the refusals, the plan format, the planner's choice, and a script trained under such a plan."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from capuchin.errors import PlanError
from capuchin.planner import simulator
from capuchin.planner.build import build_plan, run_policy, with_dead
from capuchin.planner.plan import Action, Decision, Method, Plan, Step
from capuchin.planner.problem import Problem
from capuchin.planner.registry import PolicyResult
from capuchin.planner.simulator import simulate

sys.path.insert(0, str(Path(__file__).parent))
from oracle_simulator import oracle_pass  # noqa: E402
from test_simulator_fast import SCALARS, assert_same  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HELD = Path(__file__).parent / "data" / "held_after_last_read.py"


def _held(p: Problem, sid: str, free_op: int) -> Problem:
    """``p`` with storage ``sid`` freed after op ``free_op`` instead of after its last access
    (what a script's reference does; synthetic traces free at the last access)."""
    s = p.storages[sid]
    last = s.free_op
    ops = list(p.ops)
    ops[last] = replace(ops[last], frees=tuple(x for x in ops[last].frees if x != sid))
    ops[free_op] = replace(ops[free_op], frees=(*ops[free_op].frees, sid))
    live = p.live_bytes.copy()
    live[last + 1 : free_op + 1] += s.size_bytes
    storages = {**p.storages, sid: replace(s, free_op=free_op)}
    return replace(p, ops=tuple(ops), storages=storages, live_bytes=live)


def _problem(bw: float = 1e12) -> Problem:
    """T (1000 B) is read last by op 3 and held by the script until op 8 ends; V and W (600 B
    each) peak at op 7 with U."""
    ops = [
        ("a", 100, ["X"], ["T"]),
        ("b", 100, ["T"], ["U"]),
        ("m", 100, ["U"], ["Z"]),
        ("n", 100, ["T", "Z"], []),  # T's last access; T's gap (1, 3)
        ("o", 100, ["U"], []),
        ("c", 100, ["U"], ["V"]),
        ("d", 100, ["V"], ["W"]),
        ("e", 100, ["W", "U"], ["Y"]),
        ("f", 100, ["Y"], []),
    ]
    sizes = {"X": 10, "T": 1000, "U": 10, "Z": 10, "V": 600, "W": 600, "Y": 10}
    p = Problem.from_lists(ops, sizes, bandwidth_bytes_per_s=bw)
    return _held(p, "T", 8)


def _dead(p: Problem) -> Decision:
    return Decision("T", Method.SWAP, 1000, 3, 8, dead=True)


def _same_as_oracle(p: Problem, ds: list[Decision]):
    bw_out, bw_in = p.bandwidth_d2h_bytes_per_s, p.bandwidth_h2d_bytes_per_s
    ref = oracle_pass(p, tuple(ds), bw_out, bw_in)
    got = simulator._pass(p, tuple(ds), bw_out, bw_in, detail=True)
    for f in SCALARS:
        assert getattr(got, f) == getattr(ref, f), f
    assert_same(got, ref)
    return got


def test_a_dead_storage_is_out_from_its_swap_out_until_the_script_frees_it():
    p = _problem()
    assert p.storages["T"].dead_gap == (3, 8)
    assert p.peak_bytes == 2210  # T, U, V, W at op 7
    sim = _same_as_oracle(p, [_dead(p)])
    assert sim.peak_bytes == 1210  # T left after op 3 (its copy takes 1 ns)
    o = sim.outcomes[0]
    assert o.out_start_ns == 400 and o.freed_ns == 401 and o.in_start_ns == -1
    assert o.stall_ns == 0 and sim.time_ns == p.time_ns
    # the floor counts it out over its dead gap, and not without dead decisions
    assert p.floor_bytes(dead=True) == 1200  # V and W at op 7 (U is in an access gap)
    assert replace(p, dead_evictions=False).floor_bytes(dead=True) == 2200
    assert p.floor_bytes() == 2200  # the policies' view: no dead decision of theirs


def test_freeing_a_dead_storage_waits_for_its_swap_out():
    p = _problem(bw=1e9)  # T's copy takes 1000 ns, from op 3's end (400) to 1400
    sim = _same_as_oracle(p, [_dead(p)])
    o = sim.outcomes[0]
    assert o.freed_ns == 1400
    assert o.stall_ns == 1400 - 900  # op 8 ends at 900, the free waits for the copy
    assert sim.time_ns == p.time_ns + 500
    assert sim.peak_bytes == p.peak_bytes  # still copying over the peak: counted resident


def test_a_dead_decision_with_another_decision_of_the_same_storage():
    p = _problem()
    ds = [Decision("T", Method.SWAP, 1000, 1, 3, trigger_op=2), _dead(p)]
    sim = _same_as_oracle(p, ds)
    assert sim.peak_bytes == 1210
    plan, _ = build_plan(p, ds, policy="hand", budget_bytes=1210)
    assert Plan.from_json(plan.to_json()).decisions == plan.decisions
    from capuchin.runtime.actions import compile_plan

    tbl = compile_plan(plan)  # the runtime keys decisions by storage and window
    assert tbl.evicting("T", 3).dead and not tbl.evicting("T", 1).dead
    with pytest.raises(PlanError):  # the other decision's window overlaps the dead one's
        simulate(p, [Decision("T", Method.SWAP, 1000, 3, 8, dead=True), _dead(p)])


def test_invalid_dead_decisions_are_refused():
    p = _problem()
    bad = [
        Decision("T", Method.SWAP, 1000, 1, 8, dead=True),  # not after its last access
        Decision("T", Method.SWAP, 1000, 3, 7, dead=True),  # not where the script frees it
        Decision("T", Method.RECOMPUTE, 1000, 3, 8, dead=True),  # a swap only
        Decision("T", Method.SWAP, 1000, 3, 8, trigger_op=5, dead=True),  # no prefetch
        Decision("T", Method.SWAP, 999, 3, 8, dead=True),
        Decision("U", Method.SWAP, 10, 7, 7, dead=True),  # freed at its last access
    ]
    for d in bad:
        with pytest.raises(PlanError):
            simulate(p, [d])
    # a replay at op 7 would read T (op 1 made U from it) after T left as dead
    recompute_u = Decision("U", Method.RECOMPUTE, 10, 5, 7, replay_ops=(1,), sources=("T",))
    simulate(p, [recompute_u])  # alone it is a valid plan: T is still held then
    with pytest.raises(PlanError, match="evicted as dead"):
        simulate(p, [recompute_u, _dead(p)])


def test_plan_format_dead_is_optional_and_has_one_action():
    p = _problem()
    plan, _ = build_plan(p, [_dead(p)], policy="hand", budget_bytes=1210)
    assert plan.actions == [Action(3, Step.EVICT_SWAP, "T")]  # no prefetch, no restore
    doc = json.loads(plan.to_json())
    assert doc["decisions"][0]["dead"] is True
    assert Plan.from_json(json.dumps(doc)).decisions == plan.decisions
    # a plan written before the field (no "dead" anywhere) loads, its decisions not dead
    plain, _ = build_plan(p, [Decision("T", Method.SWAP, 1000, 1, 3)], policy="h", budget_bytes=1)
    old = json.loads(plain.to_json())
    for d in old["decisions"]:
        del d["dead"]
    assert [d.dead for d in Plan.from_json(json.dumps(old)).decisions] == [False]
    for field, value in (("method", "recompute"), ("trigger_op", 5), ("wraps", True)):
        bad = json.loads(plan.to_json())
        bad["decisions"][0][field] = value
        with pytest.raises(Exception, match="dead|wrap|recompute"):
            Plan.from_json(json.dumps(bad))


def test_with_dead_adds_them_where_the_plan_is_over_the_budget():
    p = _problem()
    seen = []

    def policy(q: Problem) -> PolicyResult:  # evicts nothing, records what it planned on
        seen.append(q)
        return PolicyResult()

    r = with_dead(p, 1500, policy)
    assert [d.storage_id for d in r.decisions] == ["T"] and r.decisions[0].dead
    assert seen[-1].storages["T"].free_op == 3  # the policy planned with T gone after op 3
    assert seen[-1].peak_bytes == 1210
    seen.clear()
    assert with_dead(p, 2210, policy).decisions == ()  # fits: no dead decision
    assert with_dead(replace(p, dead_evictions=False), 1500, policy).decisions == ()
    plan, sim, _ = run_policy(p, "capuchin", 1500)
    assert plan.predictions.feasible and any(d.dead for d in plan.decisions)
    plan, sim, _ = run_policy(replace(p, dead_evictions=False), "capuchin", 1500)
    assert not any(d.dead for d in plan.decisions)
    for baseline in ("swap", "recompute"):  # comparison baselines plan as published
        plan, sim, _ = run_policy(p, baseline, 1500)
        assert not any(d.dead for d in plan.decisions), baseline


def _fixed_costs(trace):
    """Every op 100 us: a plan that does not rest on op times measured on a loaded host."""
    from capuchin.testing.training import with_fixed_costs

    return Problem.from_trace(with_fixed_costs(trace)).with_bandwidth(10e9, 10e9)


def _trace(path: Path, script: Path, args: list[str]) -> Path:
    import capuchin
    from capuchin.runmain import run_as_main

    with (
        contextlib.redirect_stdout(io.StringIO()),
        capuchin.Tracer(path, iterations=1, warmup=1, device="cpu", log=None),
    ):
        run_as_main(script, [*args, "--steps", "3"])
    return path


@pytest.mark.slow
def test_a_temporary_held_after_its_last_read_trains_bitwise_under_a_dead_decision(tmp_path):
    """tests/data/held_after_last_read.py keeps a 2 MiB temporary from its last read at the
    start of the forward to the step's end. With dead decisions the smallest feasible budget
    (fixed op costs) is below the floor of every plan without them (and so below the smallest
    budget without them); a 5-step run at it trains bitwise, every planned iteration within
    1.05x."""
    from capuchin.planner.api import smallest_feasible_budget
    from capuchin.planner.registry import get_policy
    from capuchin.runtime.engine import Runtime
    from capuchin.testing.training import run_example, state_mismatches

    p = _fixed_costs(_trace(tmp_path / "held.trace.parquet", HELD, []))
    fn = get_policy("capuchin")
    best = {}
    for on in (True, False):
        q = p if on else dataclasses.replace(p, dead_evictions=False)
        floor = q.floor_bytes(dead=True)
        best[on] = smallest_feasible_budget(q, fn, {}, start_bytes=floor, steps=10)
    no_dead_floor = dataclasses.replace(p, dead_evictions=False).floor_bytes()
    assert best[True] < no_dead_floor <= best[False], (best, no_dead_floor, p.peak_bytes)
    plan, _, _ = run_policy(p, "capuchin", best[True])
    assert plan.predictions.feasible
    held = [d for d in plan.decisions if d.dead and d.size_bytes == 2 << 20]
    assert len(held) == 1
    args = ["--steps", "5"]
    ref = run_example(HELD, args)
    rt = Runtime(plan, measure_memory=True)
    got = run_example(HELD, args, rt)
    assert state_mismatches(ref, got) == []
    its = [s for s in rt.report.iterations if s.complete]
    assert [s.iteration for s in its] == [0, 1, 2, 3, 4]
    for s in its[1:]:
        assert not s.diverged
        assert s.peak_bytes <= 1.05 * best[True], (s.iteration, s.peak_bytes / best[True])


@pytest.mark.slow
def test_foreach_adamw_floor_with_dead_decisions_is_the_loop_form_s(tmp_path, monkeypatch):
    """foreach AdamW's ``exp_avg_sq_sqrt`` list lives until ``step`` returns, after each
    element's last read: with dead decisions the floor of the mlp's foreach form is the loop
    form's (within 1%); without them it is 1.4x it. Traced with the step whole (no chunks:
    tracer/optimizer_chunks.py, where each chunk's temporaries die with the chunk), as a
    script that calls the multi-tensor ops itself would hold them."""
    from capuchin.tracer import optimizer_chunks

    monkeypatch.setattr(optimizer_chunks, "CHUNKED", ())
    mlp = ROOT / "traces" / "mlp.py"
    floors = {}
    for optim in ("adamw", "adamw-foreach"):
        args = ["--batch", "512", "--optim", optim]
        p = _fixed_costs(_trace(tmp_path / f"{optim}.trace.parquet", mlp, args))
        floors[optim] = (p.floor_bytes(dead=True), p.floor_bytes())
    loop, foreach = floors["adamw"][0], floors["adamw-foreach"]
    assert foreach[0] <= 1.01 * loop, floors
    assert foreach[1] >= 1.4 * loop, floors
