"""The runtime cost model counts each op once by its path (hot, guarded, slow), however many
decision windows cover it."""

from __future__ import annotations

from capuchin.planner.costs import RuntimeCosts, runtime_cost_ns
from capuchin.planner.plan import Decision, Method
from capuchin.planner.problem import Problem

COSTS = RuntimeCosts(
    hot_op_ns=1,
    guarded_op_ns=100,
    slow_op_ns=10_000,
    swap_action_ns=1_000_000,
    replay_op_ns=100_000_000,
    copies_share_compute=False,
)


def test_overlapping_windows_count_each_op_once():
    # ops 0..7; A is read at 1 and 6, B at 2 and 5: windows [1, 6] and [2, 5] overlap
    ops = [
        ("f0", 10, [], ["A"]),
        ("f1", 10, ["A"], ["B"]),
        ("f2", 10, ["B"], ["C"]),
        ("f3", 10, ["C"], ["D"]),
        ("f4", 10, ["D"], ["E"]),
        ("b5", 10, ["E", "B"], ["F"], [], "backward"),
        ("b6", 10, ["F", "A"], ["G"], [], "backward"),
        ("b7", 10, ["G"], ["H"], [], "backward"),
    ]
    sizes = dict(A=100, B=100, C=10, D=10, E=10, F=10, G=10, H=10)
    p = Problem.from_lists(ops, sizes, bandwidth_bytes_per_s=1e9)
    ds = [
        Decision("A", Method.SWAP, 100, 1, 6, trigger_op=4),
        Decision("B", Method.SWAP, 100, 2, 5, trigger_op=4),
    ]
    # action ops (slow): 1, 2, 4, 5, 6; guarded: 3 (in a window, no action, no write);
    # outside every window: 0 and 7 (hot only)
    slow, guarded = 5, 1
    expect = 8 * 1 + guarded * 100 + slow * 10_000 + 2 * 2 * 1_000_000
    assert runtime_cost_ns(p, ds, COSTS) == expect
    assert runtime_cost_ns(p, [], COSTS) == 0
