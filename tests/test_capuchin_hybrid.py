"""The hybrid ``capuchin`` policy against its own restricted variants (``swap``, ``recompute``).

Algorithm 1 takes, per tensor, the cheaper of swapping and recomputing; the policy must never
end up with a plan that is slower (or does not fit where a variant fits) than what swapping
alone or recomputing alone achieves with the same machinery. All judged by the simulator.
"""

from __future__ import annotations

import pytest
from capuchin.planner.plan import Method
from capuchin.planner.policies import capuchin as cap
from capuchin.planner.problem import Problem
from capuchin.planner.search import Switching, grid, pick
from capuchin.planner.simulator import simulate
from capuchin.tracer.dtr_import import dtr_logs_path
from capuchin.tracer.synthetic import random_ops, trace_from_ops, transformer_ops

DTR_ZIP = dtr_logs_path()


def _judge(problem: Problem, decisions, budget: int):
    """(fits, simulated time in ns) of a plan."""
    sim = simulate(problem, decisions)
    return sim.peak_bytes <= budget, sim.time_ns


def assert_not_worse(problem: Problem, budget: int) -> tuple[bool, int]:
    hy = _judge(problem, cap.capuchin(problem, budget).decisions, budget)
    for name, policy in (("swap", cap.swap_only), ("recompute", cap.recompute_only)):
        other = _judge(problem, policy(problem, budget).decisions, budget)
        if other[0]:
            assert hy[0], f"{name} fits {budget} B but capuchin does not"
            assert hy[1] <= other[1], (
                f"capuchin {hy[1]} ns slower than {name} {other[1]} ns at {budget} B"
            )
    return hy


def _transformer(hidden_bytes: int = 1 << 16, bw: float = 12e9) -> Problem:
    ops, sizes, persistent = transformer_ops(2, 12, hidden_bytes=hidden_bytes)
    return Problem.from_trace(
        trace_from_ops(ops, sizes, persistent=persistent, bandwidth_bytes_per_s=bw)
    )


def _random(seed: int) -> Problem:
    ops, sizes, persistent = random_ops(seed, 10, max_bytes=1 << 20)
    return Problem.from_trace(
        trace_from_ops(ops, sizes, persistent=persistent, bandwidth_bytes_per_s=2e9)
    )


GENERATED = [
    ("transformer", _transformer),
    ("transformer-slow-pcie", lambda: _transformer(1 << 18, 1e9)),
]
GENERATED += [(f"random{s}", lambda s=s: _random(s)) for s in range(6)]


@pytest.mark.parametrize("name,make", GENERATED, ids=[g[0] for g in GENERATED])
@pytest.mark.parametrize("frac", [0.45, 0.6, 0.8])
def test_generated_hybrid_not_worse_than_variants(name, make, frac):
    p = make()
    assert_not_worse(p, int(p.peak_bytes * frac))


def test_stalled_decisions_are_switched_in_the_hybrids_own_plan():
    # Before search Note [Stalled swaps], the hybrid's own plan here recomputed a tensor whose replay
    # waited ~44 us for a swapped-out source queued behind five prefetches (+6.9% vs the
    # recompute-only +2.0%). The hybrid's own selection (without the safety net) must now beat
    # recompute-only and still swap. Activations only: a swapped parameter is a source no replay
    # can regenerate (its wait is the union's to weigh, policies/capuchin.py _plan).
    p = _transformer().restricted()
    budget = p.peak_bytes // 2
    own = pick(grid(p, cap.Capuchin("hybrid"), Switching()), budget)
    rec = pick(grid(p, cap.Capuchin("recompute")), budget)
    fits, t_own = _judge(p, own, budget)
    assert fits
    assert t_own <= _judge(p, rec, budget)[1]
    assert any(d.method == Method.SWAP for d in own)
    sim = simulate(p, own)
    stalled = [o for o in sim.outcomes if o.stall_ns > 0 and o.method == Method.RECOMPUTE]
    assert sum(o.stall_ns for o in stalled) < 10_000


@pytest.fixture(scope="module")
def resnet32(tmp_path_factory) -> Problem:
    if not DTR_ZIP.exists():
        pytest.skip("DTR logs not available")
    from capuchin.tracer.dtr_import import import_dtr_log
    from capuchin.tracer.reader import load_trace

    path = import_dtr_log(
        f"{DTR_ZIP}/resnet32", tmp_path_factory.mktemp("dtr") / "r32.trace.parquet"
    )
    return Problem.from_trace(load_trace(path))


@pytest.mark.slow
@pytest.mark.parametrize("frac", [0.4, 0.43, 0.5, 0.6])
def test_resnet32_hybrid_not_worse_than_variants(resnet32, frac):
    fits, _ = assert_not_worse(resnet32, int(resnet32.peak_bytes * frac))
    assert fits


@pytest.mark.slow
def test_the_hybrid_beats_both_variants_on_resnet32(resnet32):
    # at 60% the hybrid's plan is faster than recomputing alone and than swapping alone (which
    # does not fit), and it really mixes both methods
    budget = int(resnet32.peak_bytes * 0.6)
    hy = cap.capuchin(resnet32, budget).decisions
    fits, t_hy = _judge(resnet32, hy, budget)
    assert fits
    fits_rec, t_rec = _judge(resnet32, cap.recompute_only(resnet32, budget).decisions, budget)
    assert fits_rec and t_hy < t_rec
    assert not _judge(resnet32, cap.swap_only(resnet32, budget).decisions, budget)[0]
    methods = {d.method for d in hy}
    assert methods == {Method.SWAP, Method.RECOMPUTE}


def test_deep_targets_only_when_the_others_fit_nothing(resnet32):
    # Note [Deep targets]: on DTR's ResNet-32 the recompute-only plans of the deep targets
    # (at and below the floor) reach a lower peak than the others; fitting_grid(deep=None)
    # leaves them out where another plan fits, and takes them where none does (the reach)
    from capuchin.planner import search
    from capuchin.planner.search import grid_targets

    p = resnet32.restricted()
    rec = cap.Capuchin("recompute")
    shallow = grid(p, rec, deep=False)
    every = grid(p, rec)
    low = min(g.peak_bytes for g in shallow)
    assert min(g.peak_bytes for g in every) < low  # the deep plans reach lower
    deep_targets = [t for t in grid_targets(p) if t <= p.floor_bytes()]
    assert deep_targets
    search.problem_cache(p).clear()
    assert (
        search.fitting_grid(p, rec, low, deep=None) == shallow
    )  # another plan fits: no deep plans made
    made = {k[3] for k in search.problem_cache(p) if k[0] == "target"}
    assert made.isdisjoint(deep_targets)
    budget = low - 1  # none of the others fits: every target, deep ones included
    assert search.fitting_grid(p, rec, budget, deep=None) == every
    d = search.searched(p, budget, rec, deep=None)
    assert simulate(p, d).peak_bytes <= budget


def test_a_target_whose_plan_costs_too_much_is_deep(resnet32, monkeypatch):
    # Note [Deep targets]: going down from the highest target, the first whose plan costs more
    # than DEEP_OVERHEAD baseline iterations extra starts the deep targets, like a miss does;
    # where another plan fits, neither it nor a lower target is pruned or offered
    from capuchin.planner import search
    from capuchin.planner.search import grid_targets

    p = resnet32.restricted()
    rec = cap.Capuchin("recompute")
    search.problem_cache(p).clear()
    top_down = sorted(search._shallow(p, rec), reverse=True)
    assert len(top_down) >= 3

    def extra(t):  # the plan's extra time, in baseline iterations
        s = search._attempt(p, rec, t).sim
        return (s.time_ns - s.baseline_time_ns) / s.baseline_time_ns

    costs = [extra(t) for t in top_down]
    assert costs[-1] > costs[0]  # lower targets cost more here
    k = next(i for i, c in enumerate(costs) if c > costs[-1] / 2)  # the first over half the last
    assert 0 < k < len(top_down)
    monkeypatch.setattr(search, "DEEP_OVERHEAD", costs[-1] / 2)
    search.problem_cache(p).clear()
    assert search._shallow(p, rec) == frozenset(top_down[:k])
    shallow = grid(p, rec, deep=False)
    low = min(g.peak_bytes for g in shallow)
    search.problem_cache(p).clear()
    assert search.fitting_grid(p, rec, low, deep=None) == shallow  # another plan fits
    made = {key[3] for key in search.problem_cache(p) if key[0] == "target"}
    assert made == set(top_down[:k])  # the costly target's plan was made, never pruned
    assert top_down[k] in grid_targets(p)


def test_a_probe_gives_up_and_the_whole_plan_is_still_made_when_asked(resnet32):
    # Note [Deep targets]: _shallow asks for probes; a planner gives up once Algorithm 2's
    # overheads of its recomputations pass the limit, and that target's whole plan is made
    # only when asked for without one, the same plan as the planner's own
    from capuchin.planner import search
    from capuchin.planner.search import grid_targets

    p = resnet32.restricted()
    rec = cap.Capuchin("recompute")
    t = min(x for x in grid_targets(p) if x > p.floor_bytes())
    whole = rec(p, t)
    assert whole.sim is not None and whole.sim.recompute_ns > 0
    search.problem_cache(p).clear()
    assert search._attempt(p, rec, t, 1) == search.Attempt([], None)  # gave up at once
    assert ("attempt", rec, t) not in search.problem_cache(p)
    a = search._attempt(p, rec, t)
    assert a.sim is not None and a.decisions == whole.decisions
    # a probe that does not give up is the whole plan, remembered as the attempt
    search.problem_cache(p).clear()
    a = search._attempt(p, rec, t, 10**18)
    assert a.decisions == whole.decisions and search.problem_cache(p)[("attempt", rec, t)] is a
