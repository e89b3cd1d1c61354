"""Capuchin's policy (paper §4.3-4.5, Algorithms 1 and 2), and its swap-only and
recompute-only variants. Registered as ``capuchin``, ``swap`` and ``recompute``.

# Note: [Required reduction, per op]
# The paper stops once the evicted bytes reach the "required memory reduction" measured in
# passive mode, a single number. Here the required reduction is kept *per op*: ``excess[k]`` is
# how far op k's memory is above the budget, a decision lowers it by its size on the ops it
# covers (those that run entirely while the storage is out), and selection stops when no op
# exceeds the budget. The peak window is the set of ops still above the budget. Since that is
# still an estimate, every round ends with the simulator: if the *simulated* peak is above the
# budget, the excess is re-read from the simulated curve and another round adds decisions, until
# it fits or nothing helps any more (then the best plan found is returned and the plan builder
# marks it infeasible).
#
# Note: [Targets]
# Greedy selection is not monotone in the budget (a larger budget can end in a costlier plan),
# and its estimates are optimistic. So on problems of up to SEARCH_MAX_OPS ops the policy plans
# for a fixed grid of targets (the floor, nine steps up to the peak, and three below the floor),
# independent of the budget, and returns the cheapest of those plans whose simulated peak fits:
# a larger budget can only choose among more plans, so it never costs more. Larger problems plan
# for the budget itself, then aim lower while the simulated peak does not fit.
#
# Note: [Stalled swaps]
# Algorithm 1 compares a swap's *estimated* overhead with a recomputation's. The estimate sees
# the copy channel as the swaps chosen so far occupy it, but the simulation can still show a
# swap stalling much longer (swap-outs delayed behind others, on-demand restores of swapped
# sources, prefetches pushed later by the peak window). So the hybrid re-decides with the
# simulated costs (``_convert_stalled``): a swap whose simulated stall exceeds the time of
# replaying it becomes a recomputation; a recomputation that waited for a swapped-out source
# regenerates that source instead, or is swapped itself, when that is cheaper than the wait
# (all such switches at once first, else the most wasteful alone); when no stalled decision is
# left, the one replay that would gain most as a swap (overhead estimated on the channels as
# simulated) is tried. A switch is kept only when the re-simulated plan is faster and its peak
# not above the target; repeated until nothing improves. This is Algorithm 1's comparison with
# measured instead of estimated overheads. On the target grid (Note [Targets]) the switched
# plans are *added* next to the unswitched one (each pruned on its own): the final plan
# switched; when it stalled, also a second selection that switches after every round before
# selecting more (this changes which decisions follow; better on some traces, worse on
# others); and every stalled plan switched against the next two grid targets above its peak
# (more room for replay temporaries). The grid only gains plans, so the hybrid never gets
# worse than without the switching, and it stays budget-independent; the price is up to about
# twice the hybrid's planning time on traces with stalls. Larger problems switch their final
# plan against the budget.
#
# Note: [Restricted variants]
# A safety net, not part of the paper: the hybrid also computes the swap-only and the
# recompute-only plans (same machinery, same target grid, cached) and returns whichever of the
# three fits with the smallest simulated time (when none fits: the lowest peak; ties keep the
# hybrid's own plan). Greedy hybrid selection can lose to a restricted variant on real traces
# (e.g. DTR's resnet32 trace at 4 GiB, 43% of peak: the hybrid's own plan +22.5% after Note
# [Stalled swaps], +46.7% before it, vs recompute-only +16.5%), because swaps taken early as
# "free" leave the expensive recomputations for later (long replays through evicted
# intermediates) and still stall once the copy channels are crowded; with the net, ``capuchin`` is never worse than ``swap`` or
# ``recompute`` under the simulator. It costs the time of planning the two variants (on the
# bundled transformer trace, 627 ops, about 3x the hybrid's own planning time, most of it the
# recompute-only grid's pruning), so it is applied only on problems of up to SEARCH_MAX_OPS ops
# (those that get the target grid); larger problems keep the planner-speed target and get the
# hybrid's own plan, with no such guarantee. When the hybrid's own plan fits at no cost (its
# simulated time equals the baseline), the variants are not planned at all.
#
# Note: [Persistent candidates]
# Parameters, gradient buffers and optimizer state are swap candidates too, over their gaps
# within the iteration and across its boundary (problem.py Note [Wrap-around gaps]; their swap
# timing: swapping.py Note [Wrap-around swaps]); they are never recomputed. They enter the
# selection like any access pair, ranked by free time: optimizer state, whose free time is the
# whole forward and backward pass, is usually swapped first, at no cost. Because greedy
# selection is not monotone in its candidates (more candidates can end in a costlier plan), the
# policy also plans without them (``Problem.restricted()``: planning as it was before) and
# returns the better plan under the simulator (ties: the one without), so the persistent
# candidates never make a plan worse; the plan with them comes first and, when it fits at no
# cost, the other is not made. Measured planning time with both: about 2-3x the planning
# without them on the bundled traces (docs/persistent-state.md).
#
# Note: [Recompute first]
# Algorithm 1 takes swaps first (those the free time hides) and compares methods only for the
# rest, with *estimated* swap costs. On GPU traces, where a replay is cheap next to a 12 GB/s
# copy, the early swaps crowd the copy channels and the plan ends up slower than Algorithm 2's
# recompute-only plan (DTR's ResNet-32 at 40%: +22.5% vs +16.5%). So the hybrid also runs
# Algorithm 1's comparison the other way round, with *simulated* costs: start from each
# recompute-only grid plan that fits the budget and switch, one at a time, the replay that a
# swap would make cheapest (in-trigger and channels as simulated; up to
# RECOMPUTE_FIRST_TRIES candidates per step, RECOMPUTE_FIRST_PASSES steps), keeping a switch
# only when the re-simulated plan is faster and its peak not above the plan's own. The
# conversion of a grid plan does not depend on the budget and is cached, so the hybrid stays
# monotone in the budget. Measured (`capuchin compare ... --policies capuchin,recompute,dtr`):
# InceptionV4 60% +7.5% -> +3.5% (DTR +6.8%), 40% +12.7% -> +8.9% (DTR +11.7%); ResNet-32
# 60% +8.6% -> +6.7%. This is the paper's per-tensor choice between the two methods, applied
# to the replays the recompute-only plan chose, not a new heuristic.
"""

from __future__ import annotations

import heapq
import weakref
from dataclasses import dataclass

import numpy as np

from ...errors import PlanError
from ..lineage import Residency, keepable, replay_for
from ..msps import MspsQueue
from ..plan import Decision, Method
from ..problem import Problem
from ..registry import register
from ..simulator import simulate
from ..swapping import (
    SwapEstimate,
    SwapTimer,
    WrapEstimate,
    estimate_wrap,
    reserve_wrap,
    wrap_free_time,
)


@dataclass(frozen=True)
class _Pair:
    storage_id: str
    size_bytes: int
    evict_op: int
    back_op: int
    free_time_ns: int
    wraps: bool = False  # a wrap-around gap (problem.py Note [Wrap-around gaps])


@register("capuchin")
def capuchin(problem: Problem, budget_bytes: int, *, max_rounds: int = 12,
             collective: bool = True, max_replay_ops: int = 200) -> list[Decision]:
    """Capuchin's hybrid policy.

    1. Candidates: evictable storages accessed more than once with an access gap (consecutive
       accesses, the evicted-access and the back-access) spanning an op above the budget.
    2. Access pairs ranked by free time (paper Eq. 1), longest first; swaps are taken from the
       top while an in-trigger hides them completely (swapping.py Note [In-trigger search]).
    3. Then Algorithm 1: the cheapest remaining swap (exposed wait) against the recomputation
       with the largest MSPS (Algorithm 2, msps.py), whichever costs less, until no op exceeds
       the budget (Note [Required reduction, per op]).

    ``max_rounds``: simulate-and-extend rounds. ``collective``: keep intermediates regenerated by
    a replay when they are needed later and memory allows (paper §5.3). ``max_replay_ops``:
    longest replay considered for one recomputation.

    The plan returned is the cheapest fitting one among plans for a fixed grid of targets on
    problems of up to ``SEARCH_MAX_OPS`` ops (Note [Targets]), so more budget never costs more.
    Decisions that stalled in simulation longer than the other method would cost are switched
    (Note [Stalled swaps]). Safety net, on problems of up to ``SEARCH_MAX_OPS``
    ops: when the swap-only or recompute-only plan fits faster, that plan is returned instead
    (Note [Restricted variants]).

    Output contract (registry Note [Policy contract]): at most one decision per storage; swap
    decisions carry their in-trigger, recompute decisions their replay ops, sources and keeps.
    """
    return _plan(problem, budget_bytes, "hybrid", max_rounds, collective, max_replay_ops)


@register("swap")
def swap_only(problem: Problem, budget_bytes: int, *, max_rounds: int = 12) -> list[Decision]:
    """Capuchin restricted to swapping: zero-overhead swaps by free time, then the swaps with the
    smallest exposed wait, until the simulated peak fits."""
    return _plan(problem, budget_bytes, "swap", max_rounds, False, 0)


@register("recompute")
def recompute_only(problem: Problem, budget_bytes: int, *, max_rounds: int = 12,
                   collective: bool = True, max_replay_ops: int = 200) -> list[Decision]:
    """Capuchin restricted to recomputation: Algorithm 2 (largest MSPS first, iterative update)
    until the simulated peak fits."""
    return _plan(problem, budget_bytes, "recompute", max_rounds, collective, max_replay_ops)


SEARCH_MAX_OPS = 5000  # problems up to this size get the budget-independent target grid
_GRID_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plan(problem: Problem, budget: int, mode: str, max_rounds: int, collective: bool,
          max_replay_ops: int) -> list[Decision]:
    """Note [Persistent candidates], then ``_plan_one``."""
    if problem.n_ops == 0 or problem.peak_bytes <= budget:
        return []
    base = problem.restricted()
    if base is problem:
        return _plan_one(problem, budget, mode, max_rounds, collective, max_replay_ops)
    best = None
    for prob in (problem, base):
        ds = _plan_one(prob, budget, mode, max_rounds, collective, max_replay_ops)
        try:
            sim = simulate(problem, ds)
        except PlanError:
            continue
        key = (sim.peak_bytes > budget, sim.time_ns if sim.peak_bytes <= budget
               else sim.peak_bytes)
        if best is None or key <= best[0]:  # ties keep the plan without persistent swaps
            best = (key, ds)
        if not key[0] and sim.time_ns <= sim.baseline_time_ns:
            break  # fits at no cost: nothing can beat it
    return best[1] if best else []


def _plan_one(problem: Problem, budget: int, mode: str, max_rounds: int, collective: bool,
              max_replay_ops: int) -> list[Decision]:
    """See Note [Targets]; the hybrid also Note [Restricted variants]."""
    if mode != "hybrid" or problem.n_ops > SEARCH_MAX_OPS:  # net: Note [Restricted variants]
        return _plan_mode(problem, budget, mode, max_rounds, collective, max_replay_ops)
    best = None
    for m, col, rep in (("hybrid", collective, max_replay_ops), ("recompute", collective,
                                                                  max_replay_ops),
                        ("swap", False, 0)):
        decisions = _plan_mode(problem, budget, m, max_rounds, col, rep)
        try:
            sim = simulate(problem, decisions)
        except PlanError:
            continue
        key = (sim.peak_bytes > budget, sim.time_ns if sim.peak_bytes <= budget
               else sim.peak_bytes)
        if best is None or key < best[0]:  # ties keep the earlier: the hybrid's own plan
            best = (key, decisions)
        if not key[0] and sim.time_ns <= sim.baseline_time_ns:
            return decisions  # fits at no cost: nothing can beat it
    # Note [Recompute first]
    for ds, _peak, t in _recompute_first(problem, budget, max_rounds, collective,
                                         max_replay_ops):
        if best is None or (False, t) < best[0]:
            best = ((False, t), ds)
    return best[1] if best else []


def _plan_mode(problem: Problem, budget: int, mode: str, max_rounds: int, collective: bool,
               max_replay_ops: int) -> list[Decision]:
    """One mode's plan for ``budget`` (Note [Targets])."""
    args = (mode, max_rounds, collective, max_replay_ops)
    if problem.n_ops <= SEARCH_MAX_OPS:
        plans = _grid(problem, args)
        fitting = [(t, -peak, i) for i, (ds, peak, t) in enumerate(plans) if peak <= budget]
        if fitting:
            return plans[min(fitting)[2]][0]
        return min(plans, key=lambda p: p[1])[0] if plans else []
    floor = problem.floor_bytes()
    best: tuple[int, list[Decision]] | None = None
    for target in dict.fromkeys([budget, (budget + floor) // 2, floor, floor * 9 // 10,
                                 floor // 2]):
        if target > budget or target <= 0:
            continue
        try:
            decisions, sim, regen = _attempt(problem, target, *args)
        except PlanError:
            continue
        if sim is not None and sim.peak_bytes <= budget:
            return _prune(problem, decisions, sim, budget, regen)
        if sim is not None and (best is None or sim.peak_bytes < best[0]):
            best = (sim.peak_bytes, decisions)
    return best[1] if best else []


def _grid(problem: Problem, args: tuple) -> list[tuple[list[Decision], int, int]]:
    """``_grid_plans(problem, *args)``, made once per problem and cached."""
    cache = _GRID_CACHE.setdefault(problem, {})
    if args not in cache:
        cache[args] = _grid_plans(problem, *args)
    return cache[args]


def _grid_plans(problem: Problem, *args) -> list[tuple[list[Decision], int, int]]:
    """Plans for a fixed grid of targets between the floor and the peak (and below the floor,
    as the estimates are optimistic), each pruned against its own target:
    ``(decisions, simulated peak, simulated time)``."""
    floor, peak = problem.floor_bytes(), problem.peak_bytes
    targets = [floor + (peak - floor) * i // 10 for i in range(10)]
    targets += [floor * 9 // 10, floor * 3 // 4, floor // 2]
    out = []
    for t in dict.fromkeys(x for x in targets if 0 < x < peak):
        try:
            decisions, sim, regen = _attempt(problem, t, *args)
        except PlanError:  # a target whose plan breaks an invariant is skipped, not fatal
            continue
        if sim is None:
            continue
        variants = [(decisions, sim, regen)]
        if args[0] == "hybrid" and sim.stall_ns + sim.recompute_ns > 0:
            # Note [Stalled swaps]: also the plan with its costly decisions switched (within
            # the target), pruned on its own: the grid only gains plans
            cds, csim, cregen = _convert_stalled(problem, decisions, sim, t, args[2], args[3])
            if cds is not decisions:
                variants.append((cds, csim, cregen))
            if sim.stall_ns > 0:  # and switched after every round, which changes the path
                try:
                    variants.append(_attempt(problem, t, *args, switch=True))
                except PlanError:
                    pass
        for ds, vsim, rg in variants:
            ds = _prune(problem, ds, vsim, max(t, vsim.peak_bytes), rg)
            vsim = simulate(problem, ds)
            out.append((ds, vsim.peak_bytes, vsim.time_ns))
            if args[0] != "hybrid" or vsim.stall_ns == 0:
                continue
            # and switched as far as the next grid targets above its peak allow
            for c in sorted(x for x in targets if vsim.peak_bytes < x < peak)[:2]:
                cds, csim, _ = _convert_stalled(problem, ds, vsim, c, args[2], args[3], rg)
                if csim.time_ns < vsim.time_ns and csim.peak_bytes <= c:
                    out.append((cds, csim.peak_bytes, csim.time_ns))
    return out


RECOMPUTE_FIRST_PASSES = 60  # switches tried one after another (Note [Recompute first])
RECOMPUTE_FIRST_TRIES = 8  # candidates tried per pass before giving up


def _recompute_first(problem: Problem, budget: int, max_rounds: int, collective: bool,
                     max_replay_ops: int) -> list[tuple[list[Decision], int, int]]:
    """Note [Recompute first]: the plans of the recompute-only grid that fit ``budget``, with
    the replays that a swap makes cheaper (as simulated) switched, none above its plan's own
    peak. Each conversion is made once per grid plan and cached (budget-independent)."""
    key = ("recompute", max_rounds, collective, max_replay_ops)
    plans = _grid(problem, key)
    done = _GRID_CACHE[problem].setdefault(("recompute-first", *key[1:]), {})
    out = []
    for i, (ds, peak, t) in enumerate(plans):
        if peak > budget:
            continue
        if i not in done:
            done[i] = None
            try:
                sim = simulate(problem, ds)
            except PlanError:
                continue
            if sim.recompute_ns <= 0:
                continue
            cds, csim, _ = _convert_stalled(problem, ds, sim, peak, collective, max_replay_ops,
                                            max_passes=RECOMPUTE_FIRST_PASSES,
                                            calm_tries=RECOMPUTE_FIRST_TRIES)
            if csim.time_ns < t and csim.peak_bytes <= peak:
                done[i] = (cds, csim.peak_bytes, csim.time_ns)
        if done[i] is not None:
            out.append(done[i])
    return out


def _attempt(problem: Problem, budget: int, mode: str, max_rounds: int, collective: bool,
             max_replay_ops: int, switch: bool = False):
    """Rounds of selection and simulation for one target; (decisions, simulation, regen) of
    the best round (the first that fits). ``switch``: switch stalled decisions after every
    round, before selecting more (Note [Stalled swaps])."""
    excess = problem.live_bytes.astype(np.int64) - budget
    chosen: dict[str, Decision] = {}
    timer = SwapTimer(problem, excess > 0)
    best = ([], None, frozenset())
    regen: frozenset = frozenset()  # Note [Stalled swaps]
    for _ in range(max_rounds):
        added = _round(problem, excess, chosen, timer, mode, max_replay_ops)
        decisions = _finish(problem, list(chosen.values()), excess, collective, regen)
        try:
            sim = simulate(problem, decisions)
        except PlanError:
            if collective:  # a keep that does not check out: plan without collective keeps
                decisions = _finish(problem, list(chosen.values()), excess, False, regen)
                sim = simulate(problem, decisions)
            else:
                raise
        if switch:
            decisions, sim, regen = _convert_stalled(problem, decisions, sim, budget,
                                                     collective, max_replay_ops, regen)
            chosen = {d.storage_id: d for d in decisions}
        if best[1] is None or sim.peak_bytes < best[1].peak_bytes:
            best = (decisions, sim, regen)
        if sim.peak_bytes <= budget or not added:
            break
        excess = sim.op_peak_bytes.astype(np.int64) - budget
        timer = _timer_from(problem, sim, decisions, excess > 0)
    return best


def _convert_stalled(problem: Problem, decisions: list[Decision], sim, budget: int,
                     collective: bool, max_replay_ops: int, regen: frozenset = frozenset(),
                     max_passes: int = 6, calm_tries: int = 1):
    """Note [Stalled swaps]: decisions whose simulated stall exceeds what the other method
    would cost are switched, most wasteful first, while the simulation confirms the plan gets
    faster without its peak rising above ``max(budget, current peak)``. Returns
    ``(decisions, simulation, regen)``."""
    ops = problem.ops
    for _ in range(max_passes):
        res = Residency(decisions)
        timer = None
        gains = []  # (time saved estimate, storage, replacement, regenerates its sources)
        calm = []  # the same for replays that did not stall: swapping them may be cheaper
        for d, o in zip(decisions, sim.outcomes, strict=True):
            if o.stall_ns <= 0 and o.recompute_ns <= 0:
                continue
            if d.method == Method.SWAP:  # recompute it instead
                if not problem.storages[d.storage_id].evictable:
                    continue  # persistent: swap only
                r = replay_for(problem, d.storage_id, d.evict_op, d.back_op, res,
                               max_ops=max_replay_ops)
                if r is not None:
                    rp_ns = sum(ops[j].duration_ns for j in r[0])
                    if rp_ns < o.stall_ns:
                        gains.append((o.stall_ns - rp_ns, d.storage_id, Decision(
                            d.storage_id, Method.RECOMPUTE, d.size_bytes, d.evict_op,
                            d.back_op), True))
                continue
            # a replay waiting for swapped-out sources: regenerate them, or swap the target;
            # a replay costlier than swapping given the channels as simulated: swap it
            r = None
            if o.stall_ns > 0:
                r = replay_for(problem, d.storage_id, d.evict_op, d.back_op, res,
                               resident=_regen_swapped(problem, res, d.back_op),
                               max_ops=max_replay_ops)
            if r is not None:
                extra = sum(ops[j].duration_ns for j in r[0]) - o.recompute_ns
                if extra < o.stall_ns:
                    gains.append((o.stall_ns - extra, d.storage_id, d, True))
                    continue
            if timer is None:
                timer = _timer_from(problem, sim, decisions, sim.op_peak_bytes > budget)
            e = timer.estimate(d.size_bytes, d.evict_op, d.back_op)
            if e.overhead_ns < o.stall_ns + o.recompute_ns:
                (gains if o.stall_ns > 0 else calm).append((
                    o.stall_ns + o.recompute_ns - e.overhead_ns, d.storage_id,
                    Decision(d.storage_id, Method.SWAP, d.size_bytes, d.evict_op, d.back_op,
                             trigger_op=e.trigger_op), False))
        gains.sort(key=lambda g: (-g[0], g[1]))
        calm.sort(key=lambda g: (-g[0], g[1]))
        cap = max(budget, sim.peak_bytes)
        improved = False
        # stalled decisions: all of them at once first (they also free the copy channel for
        # the others), then the most wasteful alone; then the one replay that would gain most
        # as a swap
        batches = [gains, gains[:1]] if len(gains) > 1 else [gains] if gains else []
        for batch in batches + [[c] for c in calm[:calm_tries]]:
            new = {g[1]: g[2] for g in batch}
            trial = [new.get(d.storage_id, d) for d in decisions]
            more = regen | {g[1] for g in batch if g[3]}
            excess = sim.op_peak_bytes.astype(np.int64) - budget
            try:
                trial = _finish(problem, trial, excess, collective, more)
                tsim = simulate(problem, trial)
            except PlanError:
                continue
            if tsim.peak_bytes <= cap and tsim.time_ns < sim.time_ns:
                decisions, sim, improved, regen = trial, tsim, True, frozenset(more)
                break
        if not improved:
            break
    return decisions, sim, regen


def _timer_from(problem: Problem, sim, decisions: list[Decision], in_peak) -> SwapTimer:
    """A swap timer whose channels hold the simulated copies of the decisions so far."""
    timer = SwapTimer(problem, in_peak)
    for o in sim.outcomes:
        if o.out_start_ns >= 0:
            timer.d2h.reserve(o.out_start_ns, o.out_end_ns)
        if o.in_start_ns >= 0:
            timer.h2d.reserve(o.in_start_ns, o.in_end_ns)
    return timer


def _round(problem: Problem, excess: np.ndarray, chosen: dict[str, Decision], timer: SwapTimer,
           mode: str, max_replay_ops: int) -> int:
    """One selection pass; updates ``excess`` in place and adds to ``chosen``. Returns the
    number of decisions added."""
    over = excess > 0
    if not over.any():
        return 0
    cnt = np.concatenate([[0], np.cumsum(over)])
    pairs: list[_Pair] = []
    n = problem.n_ops
    for s in problem.storages.values():
        if s.storage_id in chosen or not s.swappable:
            continue
        for a, b, wraps in problem.swap_gaps(s):
            if wraps:  # over-budget ops after a, or before b in the next iteration
                if cnt[n] - cnt[a + 1] + cnt[b] > 0:
                    pairs.append(_Pair(s.storage_id, s.size_bytes, a, b,
                                       wrap_free_time(timer, s.size_bytes, a, b), True))
            elif cnt[b] - cnt[a + 1] > 0:  # an over-budget op strictly inside the gap
                pairs.append(_Pair(s.storage_id, s.size_bytes, a, b,
                                   timer.free_time(s.size_bytes, a, b)))
    if not pairs:
        return 0
    pairs.sort(key=lambda p: (-p.free_time_ns, p.storage_id, p.evict_op))
    added = 0

    def useful(lo: int, hi: int) -> bool:
        return hi >= lo and bool((excess[lo:hi + 1] > 0).any())

    def estimate(p: _Pair) -> SwapEstimate | WrapEstimate:
        if p.wraps:
            return estimate_wrap(timer, p.size_bytes, p.evict_op, p.back_op, useful)
        return timer.estimate(p.size_bytes, p.evict_op, p.back_op, useful)

    def covers(e) -> list[tuple[int, int]]:
        return list(e.cover) if isinstance(e, WrapEstimate) else [(e.cover_lo, e.cover_hi)]

    def helps(e) -> bool:
        return any(useful(lo, hi) for lo, hi in covers(e))

    def take_swap(p: _Pair, e: SwapEstimate | WrapEstimate) -> None:
        nonlocal added
        chosen[p.storage_id] = Decision(p.storage_id, Method.SWAP, p.size_bytes, p.evict_op,
                                        p.back_op, trigger_op=e.trigger_op, wraps=p.wraps)
        if p.wraps:
            reserve_wrap(timer, e)
        else:
            timer.reserve(e)
        for lo, hi in covers(e):
            excess[lo:hi + 1] -= p.size_bytes
        added += 1

    # -- swaps while they are free (paper §4.5: "swap first, while zero overhead") ---------------
    if mode in ("hybrid", "swap"):
        for p in pairs:
            if p.storage_id in chosen:
                continue
            if p.free_time_ns < 0:
                break  # ranked by free time: no later pair can hide either
            e = estimate(p)
            if e.overhead_ns == 0 and helps(e):
                take_swap(p, e)
                if excess.max() <= 0:
                    return added

    # -- Algorithm 1: the cheaper of the best swap and the best recomputation --------------------
    best_pair: dict[str, _Pair] = {}  # one access pair per remaining candidate: its longest FT
    for p in pairs:
        if p.storage_id not in chosen and p.storage_id not in best_pair:
            best_pair[p.storage_id] = p
    swaps: list[tuple[int, int, str]] = []
    est: dict[str, SwapEstimate] = {}
    if mode in ("hybrid", "swap"):
        for i, p in enumerate(best_pair.values()):
            e = estimate(p)
            est[p.storage_id] = e
            heapq.heappush(swaps, (e.overhead_ns, i, p.storage_id))
    queue = None
    if mode in ("hybrid", "recompute"):
        queue = MspsQueue(problem, Residency(chosen.values()), max_replay_ops)
        for p in best_pair.values():
            if problem.storages[p.storage_id].evictable:  # persistent: swap only
                queue.add(p.storage_id, p.evict_op, p.back_op)

    def next_swap() -> tuple[_Pair, SwapEstimate] | None:
        while swaps:
            ov, i, sid = swaps[0]
            if sid in chosen:
                heapq.heappop(swaps)
                continue
            p = best_pair[sid]
            e = estimate(p)  # channels filled?
            if not helps(e):
                heapq.heappop(swaps)
                continue
            if e.overhead_ns > ov:
                heapq.heapreplace(swaps, (e.overhead_ns, i, sid))
                continue
            return p, e
        return None

    def rec_useful(c) -> bool:
        # with swapping available, a replay whose temporaries would push its back-access op
        # over the budget is not worth it (recompute-only accounts for them and goes on)
        return (c.storage_id not in chosen and useful(c.evict_op + 1, c.back_op - 1)
                and (mode == "recompute" or excess[c.back_op] + c.temp_bytes <= 0))

    while excess.max() > 0:
        s = next_swap() if mode != "recompute" else None
        r = queue.peek(rec_useful) if queue is not None else None
        if s is None and r is None:
            break
        s_cost = None
        if s is not None:
            s_cost = s[1].overhead_ns + (queue.swap_penalty(s[0].storage_id, s[0].evict_op,
                                                            s[0].back_op)
                                         if queue and not s[0].wraps else 0)
        if r is not None and mode == "hybrid" and (s is None or s_cost > r.overhead_ns):
            # Algorithm 1 compares swapping and recomputing the *same* tensor: the tensor with
            # the best MSPS is swapped instead when that costs less than its recomputation
            rp = best_pair[r.storage_id]
            e = timer.estimate(rp.size_bytes, rp.evict_op, rp.back_op, useful)
            cost = e.overhead_ns + queue.swap_penalty(rp.storage_id, rp.evict_op, rp.back_op)
            if useful(e.cover_lo, e.cover_hi) and cost <= r.overhead_ns:
                s, s_cost = (rp, e), cost
        if r is None or (s is not None and s_cost <= r.overhead_ns):
            p, e = s
            take_swap(p, e)
            if queue is not None and not p.wraps:
                queue.swapped(p.storage_id, p.evict_op, p.back_op)
        else:
            queue.select(r.storage_id)
            chosen[r.storage_id] = Decision(r.storage_id, Method.RECOMPUTE, r.size_bytes,
                                            r.evict_op, r.back_op)
            excess[r.evict_op + 1:r.back_op] -= r.size_bytes
            excess[r.back_op] += r.temp_bytes
            added += 1
    return added


def _regen_swapped(problem: Problem, res: Residency, back_op: int):
    """A ``resident`` test for ``replay_for`` that regenerates sources swapped out at
    ``back_op`` instead of restoring them on demand (Note [Stalled swaps])."""
    st = problem.storages

    def resident(x: str, j: int) -> bool:
        xs = st[x]
        return (xs.alive_at(back_op) and not xs.written_between(j, back_op)
                and res.out_at(x, back_op) is None)
    return resident


def _replay(problem: Problem, d: Decision, res: Residency, regen: frozenset):
    """``replay_for`` of a recompute decision: storages in ``regen`` first try to regenerate
    their swapped-out sources (``_regen_swapped``); otherwise, or when that finds no replay,
    the ordinary replay that restores them on demand."""
    r = None
    if d.storage_id in regen:
        r = replay_for(problem, d.storage_id, d.evict_op, d.back_op, res,
                       resident=_regen_swapped(problem, res, d.back_op))
    if r is None:
        r = replay_for(problem, d.storage_id, d.evict_op, d.back_op, res)
    return r


def _finish(problem: Problem, decisions: list[Decision], excess: np.ndarray,
            collective: bool, regen: frozenset = frozenset()) -> list[Decision]:
    """Exact lineage for the recompute decisions against the final residency, and collective
    recomputation keeps where the estimated memory has room for them. The replays of the
    storages in ``regen`` regenerate their swapped-out sources rather than wait for them."""
    res = Residency(decisions)
    room = -excess.astype(np.int64)  # estimated headroom per op (negative: over budget)
    out = []
    for d in sorted(decisions, key=lambda d: (d.back_op, d.storage_id)):
        if d.method == Method.RECOMPUTE:
            r = _replay(problem, d, res, regen)
            if r is None:  # its sources vanished under later decisions: swap it instead
                d = Decision(d.storage_id, Method.SWAP, d.size_bytes, d.evict_op, d.back_op)
            else:
                ops, srcs = r
                keep = []
                if collective:
                    for x in keepable(problem, d, ops, res):
                        xb = next(b for e, b, m in res._iv[x] if e < d.back_op <= b)
                        size = problem.storages[x].size_bytes
                        if room[d.back_op:xb].min(initial=size) >= size:
                            room[d.back_op:xb] -= size
                            keep.append(x)
                d = Decision(d.storage_id, Method.RECOMPUTE, d.size_bytes, d.evict_op,
                             d.back_op, replay_ops=tuple(ops), sources=tuple(srcs),
                             keep=tuple(keep))
        out.append(d)
    return sorted(out, key=lambda d: (d.evict_op, d.storage_id))


def _prune(problem: Problem, decisions: list[Decision], sim, budget: int,
           regen: frozenset = frozenset(), max_exact: int = 24) -> list[Decision]:
    """Drop decisions that cost time but are no longer needed for the budget.

    Greedy selection over-evicts: a recomputation picked for its MSPS can be made redundant by a
    later, larger one, a stalled swap by later swaps. The costliest decisions are tried first:
    the first ``max_exact`` by re-simulating the plan without them (kept out when it still fits),
    the rest by a conservative estimate (their bytes back on every op of their gap) confirmed by
    one final simulation.
    """
    cost = {d.storage_id: o.stall_ns + o.recompute_ns
            for d, o in zip(decisions, sim.outcomes, strict=True)}
    order = [d for d in sorted(decisions, key=lambda d: -cost[d.storage_id])
             if cost[d.storage_id] > 0]
    if not order:
        return decisions
    current = decisions
    excess = sim.op_peak_bytes.astype(np.int64) - budget
    out_of = {d.storage_id: o for d, o in zip(decisions, sim.outcomes, strict=True)}
    for d in order[:max_exact]:
        o = out_of[d.storage_id]
        back = o.in_start_ns if o.in_start_ns >= 0 else o.back_ns
        if o.freed_ns >= 0 and back > o.freed_ns:  # ops surely without it: it would add there
            lo = int(np.searchsorted(sim.op_start_ns, o.freed_ns, side="left"))
            hi = int(np.searchsorted(sim.op_end_ns, back, side="right"))
            if hi > lo and excess[lo:hi].max() + d.size_bytes > 0:
                continue
        try:
            trial = _without(problem, current, d, regen)
            tsim = simulate(problem, trial) if trial is not None else None
        except PlanError:
            continue
        if tsim is None:
            continue
        if tsim.peak_bytes <= budget and tsim.time_ns <= sim.time_ns:
            current, sim = trial, tsim
            excess = sim.op_peak_bytes.astype(np.int64) - budget
    live = {x.storage_id for x in current}
    rest = [d for d in order[max_exact:] if d.storage_id in live]
    if not rest:
        return current
    peak = sim.op_peak_bytes.astype(np.int64).copy()
    removed: set[str] = set()
    for d in rest:
        if d.wraps:  # out on two ranges; only the exact check above prunes it
            continue
        lo, hi = d.evict_op + 1, d.back_op
        if hi > lo and peak[lo:hi].max() + d.size_bytes > budget:
            continue
        peak[lo:hi] += d.size_bytes
        removed.add(d.storage_id)
    if not removed:
        return current
    kept = [d for d in current if d.storage_id not in removed]
    try:
        pruned = _finish(problem, kept, peak - budget, collective=True, regen=regen)
        psim = simulate(problem, pruned)
        if psim.peak_bytes <= budget and psim.time_ns <= sim.time_ns:
            return pruned
    except PlanError:
        pass
    return current


def _without(problem: Problem, decisions: list[Decision], gone: Decision,
             regen: frozenset = frozenset()) -> list[Decision] | None:
    """``decisions`` minus ``gone``: the replays that regenerated its storage now read it as a
    source instead (re-resolved, without collective keeps); the others are unchanged."""
    sid = gone.storage_id
    kept = [x for x in decisions if x is not gone]
    producer = problem.storages[sid].alloc_op
    res = Residency(kept)
    out = []
    for x in kept:
        if x.method == Method.RECOMPUTE and (sid in x.keep or producer in x.replay_ops):
            r = _replay(problem, x, res, regen)
            if r is None:
                return None
            x = Decision(x.storage_id, Method.RECOMPUTE, x.size_bytes, x.evict_op, x.back_op,
                         replay_ops=tuple(r[0]), sources=tuple(r[1]))
        out.append(x)
    return out
