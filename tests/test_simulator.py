"""The simulator: timing model on hand-computed cases, and every invariant violation raises."""

from __future__ import annotations

from dataclasses import replace

import pytest
from capuchin.errors import PlanError
from capuchin.planner.build import complete_decisions
from capuchin.planner.costs import (
    NO_HOST_COST,
    HostCost,
    host_cost,
    runtime_cost_ns,
    simulated_host_ns,
)
from capuchin.planner.plan import Decision, Method
from capuchin.planner.problem import Problem
from capuchin.planner.simulator import simulate


def chain() -> Problem:
    # X -> A -> B -> C -> D; backward reads C, B, A again. Ops 100 ns, copies of 100 B 100 ns.
    ops = [
        ("f1", 100, ["X"], ["A"]),
        ("f2", 100, ["A"], ["B"]),
        ("f3", 100, ["B"], ["C"]),
        ("f4", 100, ["C"], ["D"]),
        ("b4", 100, ["D", "C"], ["E"], [], "backward"),
        ("b3", 100, ["E", "B"], ["F"], [], "backward"),
        ("b2", 100, ["F", "A"], ["G"], [], "backward"),
    ]
    sizes = dict(X=10, A=100, B=100, C=100, D=10, E=10, F=10, G=10)
    return Problem.from_lists(ops, sizes, bandwidth_bytes_per_s=1e9)


def test_baseline_matches_problem_curve():
    p = chain()
    r = simulate(p, [])
    assert list(r.op_peak_bytes) == list(p.live_bytes) == [110, 200, 300, 310, 320, 220, 120]
    assert r.peak_bytes == 320 and r.time_ns == p.time_ns == 700 and r.overhead == 0


def test_swap_out_frees_at_copy_end_and_prefetch_hides():
    p = chain()
    r = simulate(p, [Decision("A", Method.SWAP, 100, 1, 6, trigger_op=5)])
    (o,) = r.outcomes
    assert (o.out_start_ns, o.out_end_ns) == (200, 300)  # after f2 ends; 100 B at 1 GB/s
    assert (o.in_start_ns, o.in_end_ns) == (500, 600)  # at the in-trigger (op 5 starts at 500)
    assert o.stall_ns == 0 and r.time_ns == 700
    # op 2 (200-300) still holds A; op 3 and 4 do not; op 5 has it back
    assert list(r.op_peak_bytes) == [110, 200, 300, 210, 220, 220, 120]


def test_late_prefetch_stalls_and_channel_serializes():
    p = chain()
    r = simulate(
        p,
        [
            Decision("A", Method.SWAP, 100, 1, 6, trigger_op=6),
            Decision("B", Method.SWAP, 100, 2, 5, trigger_op=5),
        ],
    )
    a, b = sorted(r.outcomes, key=lambda o: o.storage_id)
    assert (b.out_start_ns, b.out_end_ns) == (300, 400)  # waits for A's copy (200-300)
    assert (b.in_start_ns, b.in_end_ns) == (500, 600)
    assert b.stall_ns == 100  # b3 starts at 500, B arrives at 600
    assert a.in_start_ns == 700 and a.stall_ns == 100  # on demand at b2 (starts at 700 now)
    assert r.time_ns == 900 and r.overhead == pytest.approx(2 / 7)


def test_host_work_is_charged_on_the_compute_stream():
    # costs.py Note [Host work on the compute stream]: 3 ns before each op with an action,
    # 7 ns per swap-out (after its evicted-access) and per swap-in (at its start), 11 ns per
    # replayed op, 13 ns after each recompute decision's drop
    p = replace(chain(), host=HostCost(swap_ns=7, replay_op_ns=11, action_op_ns=3, drop_ns=13))
    r = simulate(p, [Decision("A", Method.SWAP, 100, 1, 6, trigger_op=5)])
    (o,) = r.outcomes
    assert (o.out_start_ns, o.out_end_ns) == (210, 310)  # op 1 runs 103-203, then the call
    assert (o.in_start_ns, o.in_end_ns) == (520, 620)  # op 5's slow path, then the call
    assert o.stall_ns == 0 and r.time_ns == 700 + 3 * 3 + 2 * 7
    r = simulate(p, [Decision("B", Method.RECOMPUTE, 100, 2, 5, replay_ops=(1,), sources=("A",))])
    (o,) = r.outcomes
    assert o.recompute_ns == 100 + 11 and r.time_ns == 700 + 100 + 11 + 13 + 3 * 3  # ops 1, 2, 5
    assert o.freed_ns == 306  # op 2 runs 206-306 (both slow paths before it), then the call
    assert r.op_start_ns[3] == 306 + 13


def test_host_work_moves_from_the_runtime_cost_into_the_simulation():
    plain = chain()
    charged = replace(plain, host=host_cost("cpu"))
    ds = complete_decisions(plain, [Decision("A", Method.SWAP, 100, 1, 6, trigger_op=5)])
    a, b = simulate(plain, ds), simulate(charged, ds)
    assert b.time_ns - a.time_ns == simulated_host_ns(charged, ds) > 0  # the swap stays hidden
    assert runtime_cost_ns(plain, ds) - runtime_cost_ns(charged, ds) == b.time_ns - a.time_ns
    # a recompute decision's drop too (Note [Recompute decisions on the host])
    ds = complete_decisions(
        plain, [Decision("B", Method.RECOMPUTE, 100, 2, 5, replay_ops=(1,), sources=("A",))]
    )
    a, b = simulate(plain, ds), simulate(charged, ds)
    assert charged.host.drop_ns > 0
    assert b.time_ns - a.time_ns == simulated_host_ns(charged, ds) > 0
    assert runtime_cost_ns(plain, ds) - runtime_cost_ns(charged, ds) == b.time_ns - a.time_ns
    assert host_cost("cuda") == NO_HOST_COST and host_cost("cpu", "synthetic") == NO_HOST_COST
    assert plain.host == NO_HOST_COST  # a synthetic trace


def test_recompute_adds_replay_time_and_temporaries():
    p = chain()
    r = simulate(p, [Decision("B", Method.RECOMPUTE, 100, 2, 5, replay_ops=(1,), sources=("A",))])
    (o,) = r.outcomes
    assert o.recompute_ns == 100 and r.time_ns == 800
    assert list(r.op_peak_bytes)[:5] == [110, 200, 300, 210, 220]
    assert r.op_peak_bytes[5] == 220  # B back (100) + F (10) on top of A, E


def test_collective_recomputation_keeps_intermediate():
    p = chain()
    ds = [
        Decision("B", Method.RECOMPUTE, 100, 2, 5, replay_ops=(1,), sources=("A",)),
        Decision("C", Method.RECOMPUTE, 100, 3, 4, replay_ops=(1, 2), sources=("A",), keep=("B",)),
    ]
    r = simulate(p, ds)
    out = {o.storage_id: o for o in r.outcomes}
    assert out["C"].recompute_ns == 200 and out["B"].recompute_ns == 0  # B kept: no replay
    no_keep = simulate(
        p, [ds[0], Decision("C", Method.RECOMPUTE, 100, 3, 4, replay_ops=(1, 2), sources=("A",))]
    )
    assert no_keep.time_ns == r.time_ns + 100


@pytest.mark.parametrize(
    "decision, match",
    [
        (Decision("Q", Method.SWAP, 100, 1, 6), "no such storage"),
        (Decision("X", Method.SWAP, 10, 0, 1), "not evictable"),
        (Decision("A", Method.SWAP, 99, 1, 6), "size"),
        (Decision("A", Method.SWAP, 100, 0, 6), "consecutive"),
        (Decision("A", Method.SWAP, 100, 6, 1), "evict_op < back_op"),
        (Decision("A", Method.SWAP, 100, 1, 6, trigger_op=1), "in-trigger"),
        (Decision("B", Method.RECOMPUTE, 100, 2, 5), "without replay_ops"),
        (Decision("B", Method.RECOMPUTE, 100, 2, 5, replay_ops=(0,), sources=("X",)), "producer"),
        (Decision("B", Method.RECOMPUTE, 100, 2, 5, replay_ops=(1,), sources=()), "sources"),
        (Decision("A", Method.RECOMPUTE, 100, 1, 6, replay_ops=(0,), sources=("X",)), "not alive"),
    ],
)
def test_broken_plans_raise(decision, match):
    with pytest.raises(PlanError, match=match):
        simulate(chain(), [decision])


def test_two_decisions_on_one_storage_raise():
    d = Decision("A", Method.SWAP, 100, 1, 6)
    with pytest.raises(PlanError, match="overlaps"):
        simulate(chain(), [d, d])


def test_dropped_source_raises():
    # C's replay reads B, but B is dropped (recompute) at that moment and not regenerated
    ds = [
        Decision("B", Method.RECOMPUTE, 100, 2, 5, replay_ops=(1,), sources=("A",)),
        Decision("C", Method.RECOMPUTE, 100, 3, 4, replay_ops=(2,), sources=("B",)),
    ]
    with pytest.raises(PlanError, match="dropped"):
        simulate(chain(), ds)


def test_source_written_in_place_after_read_raises():
    ops = [
        ("f", 10, ["X"], ["A"]),
        ("g", 10, ["A"], ["B"]),
        ("inc", 10, [], [], ["A"]),
        ("h", 10, ["B"], ["C"]),
        ("b", 10, ["C", "B", "A"], ["D"]),
    ]
    p = Problem.from_lists(ops, dict(X=4, A=8, B=8, C=8, D=8))
    with pytest.raises(PlanError, match="written in place"):
        simulate(p, [Decision("B", Method.RECOMPUTE, 8, 3, 4, replay_ops=(1,), sources=("A",))])


def test_swapped_source_is_restored_on_demand():
    p = chain()
    ds = [
        Decision("A", Method.SWAP, 100, 1, 6),  # no prefetch
        Decision("B", Method.RECOMPUTE, 100, 2, 5, replay_ops=(1,), sources=("A",)),
    ]
    r = simulate(p, ds)
    out = {o.storage_id: o for o in r.outcomes}
    assert out["B"].stall_ns == 100 and out["B"].recompute_ns == 100
    assert out["A"].stall_ns == 0  # already back when its own back-access comes


def test_unchecked_access_while_out_raises_at_that_op():
    # evicted after f1 but f2 (op 1, no decision acts there) reads A: the simulator's own
    # check finds it even when the static checks are skipped (Note [Only the ops of decisions])
    p = chain()
    with pytest.raises(PlanError, match=r"op 1 \(f2\) accesses storage A"):
        simulate(p, [Decision("A", Method.SWAP, 100, 0, 6, trigger_op=5)], check=False)


def test_a_decision_s_remembered_hash_is_of_its_fields_and_not_pickled():
    # plan.py Note [Decision hash]: equal decisions hash alike whatever was hashed before, and
    # the hash stays in the process (string hashes differ between processes)
    import pickle

    from capuchin.planner.plan import Decision, Method

    d = Decision("s1", Method.RECOMPUTE, 64, 1, 5, replay_ops=(0, 1), sources=("x",))
    e = Decision("s1", Method.RECOMPUTE, 64, 1, 5, replay_ops=(0, 1), sources=("x",))
    f = Decision("s1", Method.RECOMPUTE, 64, 1, 5, replay_ops=(0, 2), sources=("x",))
    assert hash(d) == hash(e) and d == e and d != f
    assert len({d, e, f}) == 2
    assert "_hash" not in pickle.loads(pickle.dumps(d)).__dict__
    assert pickle.loads(pickle.dumps(d)) == d
    assert d.to_dict() == e.to_dict() and "_hash" not in d.to_dict()
    # every field is in the hash: a decision differing in any one field hashes differently
    from dataclasses import fields, replace

    def other(v):
        if isinstance(v, Method):
            return Method.SWAP
        if isinstance(v, bool):
            return not v
        if v is None:
            return 7
        if isinstance(v, int):
            return v + 1
        if isinstance(v, str):
            return v + "y"
        return (*v, 9)

    for f in fields(Decision):
        g = replace(d, **{f.name: other(getattr(d, f.name))})
        assert g != d and hash(g) != hash(d), f.name


def test_new_decision_is_the_constructor_s_decision():
    # plan.new_decision skips the frozen dataclass's setattr per field: the same fields, the
    # same defaults, equal and equally hashed, and an unknown field refused
    from dataclasses import fields

    import pytest
    from capuchin.planner.plan import Decision, Method, new_decision

    kw = dict(replay_ops=(0, 1), sources=("x",), keep=("y",))
    for args, more in [
        (("s1", Method.RECOMPUTE, 64, 1, 5), kw),
        (("s2", Method.SWAP, 8, 0, 3), {}),
        (("s3", Method.SWAP, 8, 0, 3), {"trigger_op": 2, "out_done_op": 1}),
    ]:
        a, b = Decision(*args, **more), new_decision(*args, **more)
        assert a == b and hash(a) == hash(b) and type(b) is Decision
        assert {f.name: getattr(b, f.name) for f in fields(Decision)} == {
            f.name: getattr(a, f.name) for f in fields(Decision)
        }
        assert a.to_dict() == b.to_dict()
    with pytest.raises(TypeError):
        new_decision("s1", Method.SWAP, 8, 0, 3, nonsense=1)
