"""The paper's choices, one by one, on hand-made problems (reference/capuchin.md §1.7-1.8).

Each problem is small enough to work out by hand: the copy bandwidth is 1 byte/ns both ways,
so a storage of 1,000 bytes takes 1,000 ns to copy out or in. Each test forces one choice of
Algorithm 1 (free-time order; swap while it hides; the cheaper of swap and recompute) or
Algorithm 2 (largest MSPS first; the update after a selection) and asserts the one the paper
makes, through ``Capuchin`` (Algorithm 1 for one memory target) or ``MspsQueue``. Unlike the
golden fixture, each fails when its own rule is inverted or removed.
"""

from __future__ import annotations

import pytest
from capuchin.planner.gaps import AccessGap
from capuchin.planner.lineage import EvictionWindows
from capuchin.planner.msps import MspsQueue
from capuchin.planner.plan import Method
from capuchin.planner.policies.capuchin import Capuchin
from capuchin.planner.problem import Problem
from capuchin.planner.simulator import simulate

K = 1000


def _plan(problem: Problem, mode: str, target: int) -> dict[str, Method]:
    """Algorithm 1 (or its one-method variants) for ``target``: storage -> method."""
    got = Capuchin(mode)(problem, target)
    assert got.sim is not None and got.sim.peak_bytes <= target
    return {d.storage_id: d.method for d in got.decisions}


def _free_time_problem(producer_ns: int = 1000) -> Problem:
    # X (made by op 0) and Y (op 1) are read again in backward, X last: X's gap (after op 1,
    # back at op 7) holds Y's (after op 2, back at op 6). The peak is op 4 (P) alone; both
    # copies out end before it (during ops 2 and 3) and both prefetches hide during op 5, the
    # first op after the peak window (§4.4 (a)). The target needs one of them out.
    ops = [
        ("f0", producer_ns, ["I"], ["X"]),
        ("f1", 1000, ["X"], ["Y"]),
        ("f2", 1000, ["Y"], ["Z"]),
        ("f3", 2000, ["Z"], ["A"]),
        ("f4", 1000, ["A"], ["P"]),
        ("f5", 2000, ["A"], ["B"]),
        ("b6", 1000, ["B", "Y"], ["gY"]),
        ("b7", 1000, ["gY", "X"], ["gX"]),
    ]
    sizes = {"I": 10, "X": K, "Y": K, "Z": 10, "A": 10, "P": 4 * K, "B": 10}
    sizes |= {"gY": 10, "gX": 10}
    return Problem.from_lists(ops, sizes, persistent=["I"]).restricted()


@pytest.mark.parametrize("mode", ["hybrid", "swap"])
def test_pair_with_the_larger_free_time_is_swapped_first(mode):
    # Algorithm 1 line 1: candidates sorted by free time (Eq. 1), longest first; X's is 5,000
    # ns against Y's 3,000 ns, so X is swapped and Y, no longer needed, stays.
    p = _free_time_problem()
    assert _plan(p, mode, p.peak_bytes - K // 2) == {"X": Method.SWAP}


def _swap_or_recompute(producer_ns: int) -> Problem:
    # X is made by f0 from the parameter I (a replay of f0 costs ``producer_ns``), read by f1,
    # and needed again by b5. Its copy out runs during f2 (1,000 ns); the peak is f3 (P), where
    # no prefetch may start (§4.4 (a)); the prefetch starts with f4 and ends 400 ns after it:
    # a swap of X costs 400 ns, a recomputation ``producer_ns``.
    ops = [
        ("f0", producer_ns, ["I"], ["X"]),
        ("f1", 100, ["X"], ["A"]),
        ("f2", 1000, ["A"], ["B"]),
        ("f3", 100, ["B"], ["P"]),
        ("f4", 600, ["P"], ["Q"]),
        ("b5", 100, ["Q", "X"], ["G"]),
    ]
    sizes = {"I": 10, "X": K, "A": 10, "B": 2 * K, "P": 4 * K, "Q": 10, "G": 10}
    return Problem.from_lists(ops, sizes, persistent=["I"]).restricted()


def test_a_swap_that_hides_wins_over_a_cheap_recompute():
    # §4.5: swap first, while a swap costs nothing. X's replay costs 10 ns, its swap nothing.
    p = _free_time_problem(producer_ns=10)
    assert _plan(p, "recompute", p.peak_bytes - K // 2) == {"X": Method.RECOMPUTE}
    assert _plan(p, "hybrid", p.peak_bytes - K // 2) == {"X": Method.SWAP}


def test_a_partly_hidden_swap_wins_over_a_costlier_recompute():
    # Algorithm 1 lines 4-7: SwapOverhead (400 ns exposed) < RecomputeOverhead (3,000 ns).
    p = _swap_or_recompute(3000)
    target = p.peak_bytes - K // 2
    assert _plan(p, "recompute", target) == {"X": Method.RECOMPUTE}  # the alternative exists
    assert _plan(p, "hybrid", target) == {"X": Method.SWAP}
    assert simulate(p, Capuchin("hybrid")(p, target).decisions).time_ns == p.time_ns + 400


def test_a_recompute_wins_over_a_costlier_swap():
    # The same comparison the other way: replaying f0 (200 ns) costs less than the swap's 400 ns.
    p = _swap_or_recompute(200)
    target = p.peak_bytes - K // 2
    assert _plan(p, "swap", target) == {"X": Method.SWAP}  # the alternative exists
    assert _plan(p, "hybrid", target) == {"X": Method.RECOMPUTE}
    assert simulate(p, Capuchin("hybrid")(p, target).decisions).time_ns == p.time_ns + 200


def _msps_problem(x1: tuple[int, int], x2: tuple[int, int]) -> Problem:
    # X1 and X2 (size, replay ns) are made from the parameter I, read by f2 and again in
    # backward; both gaps hold the peak (ops 3-4, Q), and either one out meets the target.
    ops = [
        ("f0", x1[1], ["I"], ["X1"]),
        ("f1", x2[1], ["I"], ["X2"]),
        ("f2", 100, ["X1", "X2"], ["P"]),
        ("f3", 100, ["P"], ["Q"]),
        ("f4", 100, ["Q"], ["R"]),
        ("b5", 100, ["R", "X2"], ["G2"]),
        ("b6", 100, ["G2", "X1"], ["G1"]),
    ]
    sizes = {"I": 10, "X1": x1[0], "X2": x2[0], "P": 10, "Q": 4 * K, "R": 10}
    sizes |= {"G2": 10, "G1": 10}
    return Problem.from_lists(ops, sizes, persistent=["I"]).restricted()


@pytest.mark.parametrize(
    "x1,x2,first",
    [
        ((2 * K, 300), (K, 200), "X1"),  # MSPS 6.7 vs 5: the larger and costlier one
        ((2 * K, 1000), (K, 200), "X2"),  # MSPS 2 vs 5: the smaller one
    ],
)
def test_the_larger_msps_is_recomputed_first(x1, x2, first):
    # Algorithm 2: MSPS = memory saved / recompute time (Eq. 2), largest first. The two cases
    # differ from "largest first" and from "cheapest first".
    p = _msps_problem(x1, x2)
    assert _plan(p, "recompute", p.peak_bytes - K // 2) == {first: Method.RECOMPUTE}


def _chain_problem() -> Problem:
    # x0 -> x1 -> x2, and z beside them, all read again in backward (z between x1 and x0);
    # every gap holds the peak (op 5, L). Replays: x1 (f1 100 ns), x2 (f2 200 ns),
    # z (fz 250 ns), x0 (f0 5,000 ns). Equal sizes: MSPS order x1 > x2 > z > x0.
    ops = [
        ("fz", 250, ["I"], ["z"]),
        ("f0", 5000, ["I"], ["x0"]),
        ("f1", 100, ["x0"], ["x1"]),
        ("f2", 200, ["x1"], ["x2"]),
        ("f3", 100, ["x2", "z"], ["P"]),
        ("f4", 100, ["P"], ["L"]),
        ("b2", 100, ["L", "x2"], ["g2"]),
        ("b1", 100, ["g2", "x1"], ["g1"]),
        ("bz", 100, ["g1", "z"], ["gz"]),
        ("b0", 100, ["gz", "x0"], ["g0"]),
    ]
    sizes = {"I": 10, "z": K, "x0": K, "x1": K, "x2": K, "P": 2 * K, "L": 4 * K}
    sizes |= {"g2": 10, "g1": 10, "gz": 10, "g0": 10}
    return Problem.from_lists(ops, sizes, persistent=["I"]).restricted()


def test_the_update_recharges_the_candidates_that_read_the_chosen_one():
    # Algorithm 2 lines 17-21: once x1 is recomputed, it is out when x2 comes back (x2's
    # back-access b2 lies in x1's eviction interval), so x2's replay starts from x1's source x0
    # and costs f1 + f2 = 300 ns.
    p = _chain_problem()
    q = MspsQueue(p, EvictionWindows([]), 200)
    for sid in ("z", "x0", "x1", "x2"):
        (a, b, _) = p.swap_gaps(p.storages[sid])[0]
        assert q.add(AccessGap(sid, K, a, b)) is not None
    assert q.cands["x2"].srcs == {"x1"}
    assert q.peek(lambda c: True).storage_id == "x1"
    q.select("x1")
    x2 = q.cands["x2"]
    assert x2.srcs == {"x0"} and x2.overhead_ns == 300
    assert q.peek(lambda c: True).storage_id == "z"  # 250 ns now beats x2's 300


def test_after_the_update_the_next_choice_follows_the_new_msps():
    # The same in the policy: two recomputations are needed; x1 first (100 ns), then z (250 ns)
    # and not x2, whose replay now costs 300 ns (before the update it cost 200 ns).
    p = _chain_problem()
    assert _plan(p, "recompute", p.peak_bytes - 3 * K // 2) == {
        "x1": Method.RECOMPUTE,
        "z": Method.RECOMPUTE,
    }
