"""Search around a policy: combinators that turn a planner for one target into a better policy.

A *target planner* (``TargetPlanner``) makes one plan for one memory target and says what the
simulator made of it (``Attempt``). The Capuchin policy's Algorithm 1 is one
(policies/capuchin.py). The combinators here only read decisions and simulations, never a
planner's internals:

- ``prune``: drop decisions that cost time but are no longer needed for the budget.
- ``switch_stalled``: Algorithm 1's swap-or-recompute comparison redone with *simulated* costs
  (Note [Stalled swaps]).
- ``grid`` and ``pick``: plans for a fixed, budget-independent grid of targets, then the
  cheapest that fits (Note [Targets]); made once per problem and cached.
- ``hidden``: the fitting plans with replays and stalled swaps switched to swaps the simulation
  hides (hiding.py; Note [Hidden swaps, on the grid]).
- ``best_of``: the fastest fitting plan among several (Note [Best of variants]).
- ``searched``: ``grid`` and ``pick``, or ``descend`` on problems too large for the grid.

All plans are judged by the one simulator; a combinator keeps a change only when the simulated
plan gets faster without its peak rising above the bound it was given.

# Note: [Targets]
# Greedy selection is not monotone in the budget (a larger budget can end in a costlier plan),
# and its estimates are optimistic. So ``grid`` plans for a fixed grid of targets (the floor,
# ``grid_steps`` steps up to the peak, and three below the floor), independent of the budget,
# and ``pick`` returns the cheapest of those plans whose simulated peak fits: a larger budget
# can only choose among more plans, so it never costs more.
#
# Note: [Search breadth]
# One rule sets how many plans the search makes for a problem. The grid takes the most of 40, 20
# and 10 steps up to the peak whose product with the problem's ops is under ``GRID_OP_STEPS``
# (each grid holds the coarser grids' targets: more plans to pick from, for time in proportion).
# A *small* problem, one whose grid is finer than the coarsest, also gets the extras that cost a
# plan per target: a stalled plan made again with switching after every round (Note [Stalled
# swaps]), the hidden variants of every fitting plan instead of the front's only (Note [Hidden
# swaps, on the grid]), and its deep targets always (policies/capuchin.py Note [Deep targets on
# large problems]). Each won cells on small traces; on larger ones the grid is most of the
# policy's time and none of them won a cell measured (docs/planner.md, "Search breadth").
#
# Note: [Deep targets]
# A planner's *deep* targets are the grid's targets at and below the floor
# (``Problem.floor_bytes``, a peak no plan reaches) and, going down from the highest target,
# every target from the first whose plan misses it (simulated peak above the target) or costs
# more than ``DEEP_OVERHEAD`` baseline iterations extra on: there the planner evicts all it can,
# and its plans cost the most to make, prune and switch (the cost jumps between two targets, and
# no such plan won a cell measured where another fit). Deciding that costs a plan too, the
# costliest, so the planner is first asked for a probe: it may give up once its own estimate of
# the extra time (Algorithm 2's recompute overheads of what it selected; swap estimates run far
# above the simulation) passes ``DEEP_OVERHEAD`` iterations; a target whose probe gave up is
# deep, and its whole plan is made only when the deep targets are. ``grid(..., deep=False)``
# leaves the deep targets out, and ``fitting_grid(..., deep=None)`` adds them only when no plan
# of the other targets fits the budget; each target's plans are made once per problem either
# way, so grids with and without the deep targets share them. That keeps a planner's reach (the
# lowest budget it fits); where they are taken, ``deep_floor`` keeps the pick monotone (Note
# [Monotone by construction]).
#
# Note: [Op limits]
# ``searched`` plans on the grid up to ``SEARCH_MAX_OPS`` ops and ``descend``s above it (a plan
# for the budget itself, then for lower targets: cheap, not monotone in the budget), where the
# grid costs more than the planning-time goal allows. The one limit holds for every policy that
# searches (``capuchin``, ``swap``, ``recompute``), so up to it they are all monotone in the
# budget by construction (Note [Monotone by construction]).
#
# Note: [Monotone by construction]
# A pick over a budget-independent set of plans never costs more at a larger budget: the plans
# that fit a budget fit every larger one. Variants made only of the plans that fit (``hidden``)
# keep that, since a larger budget makes every variant a smaller one does. One choice depends
# on the budget: a candidate's deep targets, made only where none of its other plans fits (Note
# [Deep targets]). Below ``S``, the lowest peak of those other plans, the pick is among deep plans; at
# or above ``S`` among the others, and every budget from ``S`` up gets a plan at most as slow as
# ``T``, the fastest of the others with peak ``S``. So where the deep targets are taken
# ``deep_floor`` returns ``T`` and no fitting plan faster than ``T`` is offered (``at_least``),
# and the pick below ``S`` is never faster than any pick above (the price: a deep plan faster
# than ``T`` is lost at those budgets). tests/test_planner_properties.py holds generated
# problems that were not monotone without ``deep_floor``.
#
# Note: [Stalled swaps]
# Algorithm 1 compares a swap's *estimated* overhead with a recomputation's. The estimate sees
# the copy channel as the swaps chosen so far occupy it, but the simulation can show a swap
# stalling much longer (swap-outs delayed behind others, on-demand restores of swapped sources,
# prefetches pushed later by the peak window). ``switch_stalled`` re-decides with the simulated
# costs: a swap whose simulated stall exceeds the time of replaying it becomes a recomputation;
# a recomputation that waited for a swapped-out source regenerates that source instead, or is
# swapped itself, when that is cheaper than the wait (all such switches at once first, else the
# most wasteful alone); then the replay that would gain most as a swap (overhead estimated on the
# channels as simulated). Each pass keeps the first switch the accept rule keeps (bound
# ``max(bound, current peak)``), until none is. On the grid the switched plans are *added* next
# to the unswitched one (each pruned on its own): the final plan switched; on small problems
# (Note [Search breadth]), when it stalled, a plan switched after every round of selection (the
# planner's ``after_round``, which changes what is selected next); and every stalled plan
# switched against the next two grid targets above its peak. The grid only gains plans, so
# switching never makes a plan worse and stays budget-independent.
#
# Note: [Hidden swaps, on the grid]
# ``searched(..., hiding=True)`` picks among a grid's plans and their ``hide`` variants (hiding.py
# Note [Hidden swaps]); the capuchin policy searches its hybrid and recompute-only grids so
# (``swap`` and ``recompute`` stay the paper's baselines, and the policy's swap-only grid gets
# none). A variant is made from its plan alone, bounded by the plan's own peak, for the fitting
# plans on the list's front (no other plan has a peak and a time both no larger; on small
# problems every fitting plan, Note [Search breadth]), each once, cached. Which plans are
# converted depends on the list alone, so the pick stays monotone in the budget.
#
# Note: [Best of variants]
# ``best_of`` simulates each candidate plan in order and returns the best by improve Note [One
# selector], stopping early at a plan that fits at no cost. With the capuchin policy's
# candidates (its own plan, then the recompute-only and swap-only plans) ``capuchin`` is never
# worse than ``swap`` or ``recompute`` under the simulator on the grid's problems; above
# ``SEARCH_MAX_OPS`` ops, where every policy descends, the ``recompute`` policy's plan and DTR's
# are candidates too (policies/capuchin.py Note [Never worse than the baselines]).
#
# Note: [Restricted first]
# More candidates can end in a costlier greedy plan (selection is not monotone in its
# candidates). The ``capuchin`` policy plans on ``Problem.restricted()`` (without the persistent
# candidates, problem.py Note [Wrap-around gaps]) and on the full problem and returns the better
# under the simulator, ties to the restricted plan, so the persistent candidates never make a
# plan worse. When the restricted plan fits at no cost the other is not made: fewer swaps, and
# the runtime's first planned iteration starts as the plan assumes (docs/persistent-state.md).
#
# Note: [Pruning what costs host work]
# On a CPU trace every decision costs the runtime's host work on the compute stream (costs.py
# Note [Host work on the compute stream]), so a swap whose copies hide is not free, and
# Algorithm 1 takes many such swaps (small wrap-around swaps of biases and their optimizer
# state). ``prune`` counts a swap's host work in its cost (``_host_ns``; zero on CUDA traces), so
# a hidden swap is tried too; it tries the smaller of equally costly decisions first (the host
# work is per decision, the memory per byte), and its estimate covers both ranges of a
# wrap-around swap. A recomputation's cost stays its replay time (counting its host work
# reorders the replays and lost a drop). Each grid plan is pruned against its own target, so
# the grid stays budget-independent.
#
# Note: [Pruned up to the next target]
# A plan for a low target, pruned against the next grid target above its own, can beat the plan
# made for that target: Algorithm 1 aiming lower evicts other storages, and pruning keeps the
# costliest of them out only where the higher target needs it. So on problems with host work
# (CPU traces) each grid plan that costs time is also pruned against the next grid target above
# its target and its peak, and offered when that is faster: a variant of the plan and the grid
# alone, so the grid stays budget-independent. On CUDA traces it is left out (it costs seconds
# per cell on the large GPU traces, which are at the planning-time goal).
#
# Note: [Pruned once per plan]
# The grid's targets often end in the same plan, and pruning simulates a plan once per trial,
# most of the grid's simulations. ``prune`` is a function of the problem, the plan (decisions,
# ``regen`` and simulation), the budget and ``max_exact``, so its result is remembered per
# problem under that key. (The simulator's own memo keeps the most recent plans only,
# simulator.py ``_MEMO_EVENTS``: too few to catch these repeats.)
#
# Note: [Pruned in groups]
# ``prune``'s exact part tries the ``max_exact`` costliest decisions, and most such trials
# succeed. So they are tried in groups: all at once first, kept by the accept rule when the plan
# without them fits and is no slower; a group that is refused is split in halves, each tried on
# its own in order, down to single decisions. Before each try a decision is left out when the
# conservative check already says its bytes overflow an op surely without it in the current plan
# (from its memory's release to its swap-in or return as the current plan's simulation has them,
# both ranges of a wrap-around gap). A group is judged as a whole: a plan without several
# decisions may be kept where one of them alone would be refused on time (never on peak), so
# plans can differ from one-at-a-time pruning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from ..errors import PlanError
from .hiding import hide
from .improve import Attempt, accept, improve, rank
from .lineage import (
    EvictionWindows,
    finish_decisions,
    regen_resident,
    replay_for,
    reresolved,
)
from .plan import Decision, Method, window_key
from .problem import Problem
from .simulator import SimResult, simulate
from .swapping import SwapTimer


class GridPlan(NamedTuple):
    decisions: list[Decision]
    peak_bytes: int
    time_ns: int
    regen: frozenset = frozenset()


AfterRound = Callable[[Attempt], Attempt]


class TargetPlanner(Protocol):
    """Plans for one target (bytes). ``after_round``: applied to each intermediate plan of an
    iterative planner (to its result only, for others). Hashable: results are cached per
    planner."""

    def __call__(
        self,
        problem: Problem,
        target: int,
        after_round: AfterRound | None = None,
        max_extra_ns: int | None = None,
    ) -> Attempt:
        """``max_extra_ns``: the planner may give up (``Attempt([], None)``) once its own
        estimate of the plan's extra time is above it (Note [Deep targets])."""
        ...


@dataclass(frozen=True)
class Switching:
    """Options of ``switch_stalled``: collective keeps, longest replay considered."""

    collective: bool = True
    max_replay_ops: int = 200


def problem_cache(problem: Problem, name: str = "_search_cache") -> dict:
    """A dict kept on the problem itself. Not a weak-keyed dict: what is cached (attempts with
    their simulations, which run the simulator's pass again on their problem on first use of
    their memory curve) refers to the problem, and a weak key whose value refers to it is never
    freed; as an attribute the two form a cycle the garbage collector frees. ``capuchin
    max-batch`` plans a new problem per value it tries (tests/test_search.py checks a planned
    problem is freed)."""
    per = problem.__dict__.get(name)
    if per is None:
        per = {}
        object.__setattr__(problem, name, per)
    return per


def cached(problem: Problem, key, make: Callable[[], Any]):
    """``make()``, once per problem and key."""
    per = problem_cache(problem)
    if key not in per:
        per[key] = make()
    return per[key]


GRID_OP_STEPS = 20_000  # the grid's steps times the ops stay under it (Note [Search breadth])


def grid_steps(problem: Problem) -> int:
    """Note [Search breadth]: the grid's steps from the floor up to the peak."""
    return next((k for k in (40, 20) if k * problem.n_ops < GRID_OP_STEPS), 10)


def small(problem: Problem) -> bool:
    """Note [Search breadth]: whether the problem's grid is finer than the coarsest."""
    return grid_steps(problem) > 10


def grid_targets(problem: Problem) -> list[int]:
    """Note [Targets]: the floor, ``grid_steps`` steps up to the peak, and three below the
    floor. Cached per problem."""
    done = problem_cache(problem, "_grid_targets")
    k = grid_steps(problem)
    if k not in done:
        floor, peak = problem.floor_bytes(), problem.peak_bytes
        targets = [floor + (peak - floor) * i // k for i in range(k)]
        targets += [floor * 9 // 10, floor * 3 // 4, floor // 2]
        done[k] = tuple(x for x in dict.fromkeys(targets) if 0 < x < peak)
    return list(done[k])


def grid(
    problem: Problem,
    planner: TargetPlanner,
    switching: Switching | None = None,
    deep: bool = True,
    below: int | None = None,
) -> list[GridPlan]:
    """Plans of ``planner`` for every grid target, each pruned against its own target, with the
    switched variants of Note [Stalled swaps] when ``switching`` is given. ``deep=False``: only
    the targets above the floor (Note [Deep targets]). ``below``: only the targets below it
    (and above the floor when not ``deep``). Cached per problem, each target once."""
    return cached(
        problem,
        ("grid", planner, switching, deep, below),
        lambda: [
            g
            for t in grid_targets(problem)
            if _within(problem, planner, t, deep, below)
            for g in _target_plans(problem, planner, switching, t)
        ],
    )


def _within(
    problem: Problem, planner: TargetPlanner, t: int, deep: bool, below: int | None
) -> bool:
    """Whether target ``t`` is one of ``grid(problem, planner, ..., deep, below)``'s: with
    ``below``, those below it (only those above the floor when not ``deep``); else all
    (``deep``) or the targets that are not deep (Note [Deep targets])."""
    if below is not None:
        return t < below and (deep or problem.floor_bytes() < t)
    return deep or t in _shallow(problem, planner)


DEEP_OVERHEAD = 10  # a plan costing more than this many baseline iterations extra is deep


def _shallow(problem: Problem, planner: TargetPlanner) -> frozenset[int]:
    """The targets that are not deep (Note [Deep targets]): above the floor, from the highest
    down, until the first whose plan misses it (its simulated peak above it) or costs more than
    ``DEEP_OVERHEAD`` baseline iterations extra. Cached."""

    def make() -> frozenset[int]:
        floor = problem.floor_bytes()
        out = []
        base = problem.time_ns  # the simulator's baseline too
        limit = DEEP_OVERHEAD * base
        for t in sorted((x for x in grid_targets(problem) if x > floor), reverse=True):
            a = _attempt(problem, planner, t, limit)  # a probe (Note [Deep targets])
            if a is None or a.sim is None or a.sim.peak_bytes > t or a.sim.time_ns - base > limit:
                break
            out.append(t)
        return frozenset(out)

    return cached(problem, ("shallow", planner), make)


def _attempt(
    problem: Problem, planner: TargetPlanner, t: int, max_extra_ns: int | None = None
) -> Attempt | None:
    """``planner(problem, t)``, once per problem (None: the plan broke an invariant). With
    ``max_extra_ns``, a probe: the planner may give up (an attempt without a simulation,
    remembered apart, so that the whole plan is still made when asked for without it)."""
    per = problem_cache(problem)
    key = ("attempt", planner, t)
    if key in per:
        return per[key]
    probe = ("probe", planner, t, max_extra_ns)
    if max_extra_ns is not None and probe in per:
        return per[probe]
    try:
        a = planner(problem, t, max_extra_ns=max_extra_ns)
    except PlanError:
        a = None
    if a is not None and a.sim is None and max_extra_ns is not None:
        per[probe] = a  # gave up
    else:
        per[key] = a
    return a


def _target_plans(
    problem: Problem, planner: TargetPlanner, switching: Switching | None, t: int
) -> list[GridPlan]:
    return cached(
        problem, ("target", planner, switching, t), lambda: _plans(problem, planner, switching, t)
    )


def _plans(
    problem: Problem, planner: TargetPlanner, switching: Switching | None, t: int
) -> list[GridPlan]:
    """The grid's plans for target ``t``: the planner's, its switched variants, each pruned."""
    peak = problem.peak_bytes
    targets = grid_targets(problem)
    out: list[GridPlan] = []
    a = _attempt(problem, planner, t)
    if a is None or a.sim is None:  # a target whose plan breaks an invariant is skipped
        return out
    variants = [a]
    if switching is not None and a.sim.stall_ns + a.sim.recompute_ns > 0:
        sw = switch_stalled(problem, a, t, switching)
        if sw.decisions is not a.decisions:
            variants.append(sw)
        if a.sim.stall_ns > 0 and small(problem):  # and switched after
            # every round, which changes the path (Note [Stalled swaps])
            try:
                variants.append(
                    planner(
                        problem,
                        t,
                        after_round=lambda x: switch_stalled(problem, x, t, switching),
                    )
                )
            except PlanError:
                pass
    for v in variants:
        ds = prune(problem, v, max(t, v.sim.peak_bytes))
        vsim = simulate(problem, ds)
        out.append(GridPlan(ds, vsim.peak_bytes, vsim.time_ns, v.regen))
        if problem.host and vsim.time_ns > problem.time_ns:
            # and pruned against the next grid target above (Note [Pruned up to the next target])
            up = [x for x in targets if max(t, vsim.peak_bytes) < x < peak]
            if up:
                uds = prune(problem, Attempt(ds, vsim, v.regen), min(up))
                if uds is not ds:
                    usim = simulate(problem, uds)
                    if usim.time_ns < vsim.time_ns:
                        out.append(GridPlan(uds, usim.peak_bytes, usim.time_ns, v.regen))
        if switching is None or vsim.stall_ns == 0:
            continue
        # and switched as far as the next grid targets above its peak allow
        for c in sorted(x for x in targets if vsim.peak_bytes < x < peak)[:2]:
            cds, csim, creg = switch_stalled(problem, Attempt(ds, vsim, v.regen), c, switching)
            if csim.time_ns < vsim.time_ns and csim.peak_bytes <= c:
                out.append(GridPlan(cds, csim.peak_bytes, csim.time_ns, creg))
    return out


def fitting_grid(
    problem: Problem,
    planner: TargetPlanner,
    budget: int,
    switching: Switching | None = None,
    deep: bool | None = True,
    below: int | None = None,
) -> list[GridPlan]:
    """``grid(problem, planner, switching, deep, below)``; ``deep=None``: the targets above the
    floor when one of their plans fits ``budget``, else every target (Note [Deep targets])."""
    if deep is None:
        deep = deep_needed(problem, planner, budget, switching)
    return grid(problem, planner, switching, deep, below)


def deep_needed(
    problem: Problem, planner: TargetPlanner, budget: int, switching: Switching | None = None
) -> bool:
    """Whether ``fitting_grid(..., deep=None)`` takes the deep targets: no plan of the others
    fits ``budget`` (Note [Deep targets]). Goes down from the highest target and stops at the
    first plan that fits: the targets below are made only when needed."""
    return not any(
        g.peak_bytes <= budget
        for t in sorted(_shallow(problem, planner), reverse=True)
        for g in _target_plans(problem, planner, switching, t)
    )


def at_least(plans: list[GridPlan], budget: int, min_ns: int) -> list[GridPlan]:
    """Note [Monotone by construction]: ``plans`` without those that fit ``budget`` faster than
    ``min_ns``."""
    return [g for g in plans if g.peak_bytes > budget or g.time_ns >= min_ns]


def pick(plans: Iterable[GridPlan], budget: int) -> list[Decision]:
    """The fastest plan whose simulated peak fits ``budget`` (ties: the higher peak, then the
    earlier); when none fits, the one with the lowest peak; ``[]`` when there is none."""
    plans = list(plans)  # improve Note [One selector]
    return (
        min(plans, key=lambda p: rank(p.peak_bytes, p.time_ns, budget)).decisions if plans else []
    )


def best_of(
    problem: Problem, budget: int, candidates: Iterable[Callable[[], list[Decision]]]
) -> list[Decision]:
    """Note [Best of variants]: the best plan among ``candidates`` (made lazily, in order) by
    improve Note [One selector]: the fastest fitting, when none fits the lowest peak."""
    best = None
    for make in candidates:
        decisions = make()
        try:
            sim = simulate(problem, decisions)
        except PlanError:
            continue
        key = rank(sim.peak_bytes, sim.time_ns, budget)
        if best is None or key < best[0]:
            best = (key, decisions)
        if key[0] == 0 and sim.time_ns <= sim.baseline_time_ns:
            return decisions  # fits at no cost: nothing can beat it
    return best[1] if best else []


def descend(problem: Problem, budget: int, planner: TargetPlanner) -> list[Decision]:
    """Without the grid: plan for the budget, then aim lower (halfway to the floor, the floor,
    below it) while the simulated peak does not fit; the first fitting plan, pruned, else the
    lowest peak. Cheaper than ``grid`` but not monotone in the budget."""
    floor = problem.floor_bytes()
    best: tuple[int, list[Decision]] | None = None
    for target in dict.fromkeys(
        [budget, (budget + floor) // 2, floor, floor * 9 // 10, floor // 2]
    ):
        if target > budget or target <= 0:
            continue
        try:
            a = planner(problem, target)
        except PlanError:
            continue
        if a.sim is not None and a.sim.peak_bytes <= budget:
            return prune(problem, a, budget)
        if a.sim is not None and (best is None or a.sim.peak_bytes < best[0]):
            best = (a.sim.peak_bytes, a.decisions)
    return best[1] if best else []


SEARCH_MAX_OPS = 10_000  # problems up to this size get the target grid (Note [Op limits])


def searched(
    problem: Problem,
    budget: int,
    planner: TargetPlanner,
    switching: Switching | None = None,
    deep: bool | None = True,
    hiding: bool = False,
    below: int | None = None,
) -> list[Decision]:
    """``pick(fitting_grid(...))`` up to ``SEARCH_MAX_OPS`` ops, ``descend`` above (Note [Op
    limits]); ``[]`` when the problem fits the budget as it is. ``deep``: as
    ``fitting_grid``'s. ``hiding``: pick among the fitting plans' ``hidden`` variants too (on
    the grid). ``below``: only the grid's targets below it. Where the deep targets are taken, no
    fitting plan faster than ``deep_floor`` (Note [Monotone by construction])."""
    if problem.n_ops == 0 or problem.peak_bytes <= budget:
        return []
    if problem.n_ops > SEARCH_MAX_OPS:
        return descend(problem, budget, planner)
    floor = deep_floor(problem, planner, budget, switching, deep)
    plans = at_least(fitting_grid(problem, planner, budget, switching, deep, below), budget, floor)
    if hiding:  # the variants of the plans offered only (``hidden`` stops at one costing nothing)
        plans += at_least(hidden(problem, plans, budget), budget, floor)
    return pick(plans, budget)


def deep_floor(
    problem: Problem,
    planner: TargetPlanner,
    budget: int,
    switching: Switching | None = None,
    deep: bool | None = True,
) -> int:
    """Note [Monotone by construction]: with ``deep=None`` and the deep targets taken at
    ``budget``, the time of the fastest plan with the lowest peak among the other targets'
    plans (every budget at or above that peak gets a plan at most this slow); else 0."""
    if deep is not None or not deep_needed(problem, planner, budget, switching):
        return 0
    shallow = [
        g for t in _shallow(problem, planner) for g in _target_plans(problem, planner, switching, t)
    ]
    return min(((g.peak_bytes, g.time_ns) for g in shallow), default=(0, 0))[1]


def hidden(problem: Problem, plans: list[GridPlan], budget: int) -> list[GridPlan]:
    """Note [Hidden swaps, on the grid]: ``hide`` of each plan on the front of ``plans`` that
    fits ``budget`` (of each plan that fits, on small problems), bounded by the plan's
    own peak; only those that got faster. Made once per plan and cached."""
    fitting = [g for g in plans if g.peak_bytes <= budget]
    if not fitting or any(g.time_ns <= problem.time_ns for g in fitting):
        return []  # none fits, or one costs nothing: no variant can be faster
    done = cached(problem, "hidden", dict)
    out = []
    front = None if small(problem) else _front(plans)  # Note [Search breadth]
    for g in fitting:
        if front is not None and id(g) not in front:
            continue
        i = _plan_key(g)
        if i not in done:
            done[i] = None
            try:
                sim = simulate(problem, g.decisions)
            except PlanError:
                continue
            if sim.stall_ns + sim.recompute_ns > 0:
                hds, hsim = hide(problem, g.decisions, sim, g.peak_bytes, g.regen)
                if hds is not g.decisions:
                    done[i] = GridPlan(hds, hsim.peak_bytes, hsim.time_ns, g.regen)
        if done[i] is not None:
            out.append(done[i])
    return out


def _plan_key(g: GridPlan) -> tuple:
    """A grid plan's identity for the per-problem memos: its values (what a variant made from it
    depends on), not the object."""
    return (tuple(g.decisions), g.peak_bytes, g.time_ns, g.regen)


def _front(plans: list[GridPlan]) -> set[int]:
    """The ids of the plans no other plan beats in both peak and time (ties: the earlier)."""
    out: set[int] = set()
    best = None
    for g in sorted(plans, key=lambda g: (g.peak_bytes, g.time_ns)):
        if best is None or g.time_ns < best:
            out.add(id(g))
            best = g.time_ns
    return out


def switch_stalled(
    problem: Problem,
    a: Attempt,
    bound: int,
    switching: Switching,
    *,
    max_passes: int = 6,
) -> Attempt:
    """Note [Stalled swaps]: decisions whose simulated stall exceeds what the other method
    would cost are switched, most wasteful first, while the simulation confirms the plan gets
    faster without its peak rising above ``max(bound, current peak)``.

    Remembered per problem: the grid's variants and targets switch the same plan for the same
    bound again (on DenseNet-121 19 of 65 calls). A plan that did not change comes back as
    ``a``'s own list, a changed one as a new list."""
    sim = a.sim
    key = (tuple(a.decisions), sim.time_ns, sim.peak_bytes, a.regen, bound, switching)
    key += (max_passes,)
    done = problem_cache(problem, "_switched")
    got = done.get(key, done)  # the dict itself: not remembered yet
    if got is done:
        new = improve(  # improve Note [One improvement kernel]
            problem,
            a,
            lambda cur: max(bound, cur.sim.peak_bytes),
            lambda cur: _stalled_switches(problem, cur, bound, switching),
            rounds=max_passes,
        )
        got = done[key] = new if new.decisions is not a.decisions else None
    if got is None:  # unchanged
        return Attempt(a.decisions, sim, a.regen)
    return Attempt(list(got.decisions), got.sim, got.regen)


def _stalled_switches(problem: Problem, cur: Attempt, bound: int, switching: Switching):
    """The trials of one pass of Note [Stalled swaps], in order: the stalled decisions' switches
    all at once, then the most wasteful alone, then the replay that would gain most as a swap."""
    decisions, sim, regen = cur
    collective, max_replay_ops = switching.collective, switching.max_replay_ops
    ops = problem.ops
    res = EvictionWindows(decisions)
    timer = None
    gains = []  # (time saved estimate, storage, replacement, regenerates its sources)
    calm = []  # the same for replays that did not stall: swapping them may be cheaper
    for d, o in zip(decisions, sim.outcomes, strict=True):
        if o.stall_ns <= 0 and o.recompute_ns <= 0:
            continue
        if d.method == Method.SWAP:  # recompute it instead
            if not problem.storages[d.storage_id].evictable:
                continue  # persistent: swap only (problem.py Note [Wrap-around gaps])
            # only a replay cheaper than the stall matters (lineage Note [Replays with a
            # time bound])
            r = replay_for(
                problem,
                d.storage_id,
                d.evict_op,
                d.back_op,
                res,
                max_ops=max_replay_ops,
                max_ns=o.stall_ns,
            )
            if r is not None:
                rp_ns = sum(ops[j].duration_ns for j in r[0])
                if rp_ns < o.stall_ns:
                    rec = d.switched(Method.RECOMPUTE)
                    gains.append((o.stall_ns - rp_ns, d.storage_id, rec, True))
            continue
        # a replay waiting for swapped-out sources: regenerate them, or swap the target;
        # a replay costlier than swapping given the channels as simulated: swap it
        r = None
        if o.stall_ns > 0:
            r = replay_for(
                problem,
                d.storage_id,
                d.evict_op,
                d.back_op,
                res,
                resident=regen_resident(problem, res, d.back_op),
                max_ops=max_replay_ops,
                max_ns=o.stall_ns + o.recompute_ns,  # extra < stall, or no use
            )
        if r is not None:
            extra = sum(ops[j].duration_ns for j in r[0]) - o.recompute_ns
            if extra < o.stall_ns:
                gains.append((o.stall_ns - extra, d.storage_id, d, True))
                continue
        if timer is None:
            timer = timer_from(problem, sim, sim.op_peak_bytes > bound)
        e = timer.estimate(d.size_bytes, d.evict_op, d.back_op)
        if e.overhead_ns < o.stall_ns + o.recompute_ns:
            swap = d.switched(Method.SWAP, e.trigger_op)
            gain = o.stall_ns + o.recompute_ns - e.overhead_ns
            (gains if o.stall_ns > 0 else calm).append((gain, d.storage_id, swap, False))
    gains.sort(key=lambda g: (-g[0], g[1]))
    calm.sort(key=lambda g: (-g[0], g[1]))
    excess = sim.op_peak_bytes.astype(np.int64) - bound
    batches = [gains, gains[:1]] if len(gains) > 1 else [gains] if gains else []
    for batch in batches + [calm[:1]] if calm else batches:
        new = {g[1]: g[2] for g in batch}
        trial = [new.get(d.storage_id, d) for d in decisions]
        more = regen | {g[1] for g in batch if g[3]}
        yield (
            lambda t=trial, m=more: finish_decisions(problem, t, excess, collective, m),
            frozenset(more),
        )


def timer_from(problem: Problem, sim: SimResult, in_peak) -> SwapTimer:
    """A swap timer whose channels hold the simulated copies of a plan."""
    timer = SwapTimer(problem, in_peak)
    for o in sim.outcomes:
        if o.out_start_ns >= 0:
            timer.d2h.reserve(o.out_start_ns, o.out_end_ns)
        if o.in_start_ns >= 0:
            timer.h2d.reserve(o.in_start_ns, o.in_end_ns)
    return timer


def prune(problem: Problem, a: Attempt, budget: int, max_exact: int = 24) -> list[Decision]:
    """Drop decisions that cost time but are no longer needed for the budget (Note [Pruned
    once per plan]: remembered per problem, keyed by the plan and the budget).

    Greedy selection over-evicts: a recomputation picked for its MSPS can be made redundant by a
    later, larger one, a stalled swap by later swaps. The costliest decisions are tried first
    (their stall, replay and host work: Note [Pruning what costs host work]; among equal costs
    the smaller first): the first ``max_exact`` by re-simulating the plan without them (kept
    out when it still fits), the rest by a conservative estimate (their bytes back on every op
    of their gap, both ranges of a wrap-around gap) confirmed by one final simulation. The
    exact part tries groups of decisions, split where refused (Note [Pruned in groups]).
    """
    sim = a.sim
    key = (tuple(a.decisions), sim.time_ns, sim.peak_bytes, a.regen, budget, max_exact)
    done = problem_cache(problem, "_pruned")
    got = done.get(key, done)  # the dict itself: not remembered yet
    if got is done:
        out = _prune_once(problem, a, budget, max_exact)
        got = done[key] = None if out is a.decisions else tuple(out)
    # an unchanged plan comes back as ``a``'s own list (callers test ``is``), a changed one as
    # a new list each time (callers may extend it)
    return a.decisions if got is None else list(got)


def _prune_once(problem: Problem, a: Attempt, budget: int, max_exact: int) -> list[Decision]:
    decisions, sim, regen = a
    # by window: a persistent storage may have several (plan.py Note [Several windows per
    # storage])
    cost = {
        window_key(d): o.stall_ns + o.recompute_ns + _host_ns(problem, d)
        for d, o in zip(decisions, sim.outcomes, strict=True)
    }
    order = [
        d
        for d in sorted(decisions, key=lambda d: (-cost[window_key(d)], d.size_bytes))
        if cost[window_key(d)] > 0
    ]
    if not order:
        return decisions
    out_of = {window_key(d): o for d, o in zip(decisions, sim.outcomes, strict=True)}
    # the plan, its simulation, its excess over the budget per op, its outcomes by window
    state = [decisions, sim, sim.op_peak_bytes.astype(np.int64) - budget, out_of]

    def surely_over(d: Decision) -> bool:
        """The conservative check against the current plan: ``d``'s bytes back on the ops
        surely without it (from its memory's release to its swap-in or return; both ranges of
        a wrap-around gap) overflow one of them."""
        o = state[3].get(window_key(d))
        if o is None:
            return False
        back = o.in_start_ns if o.in_start_ns >= 0 else o.back_ns
        if o.freed_ns < 0 or back < 0:
            return False
        s, e, excess = state[1].op_start_ns, state[1].op_end_ns, state[2]
        if back > o.freed_ns:
            spans = [(o.freed_ns, back)]
        elif d.wraps:
            spans = [(o.freed_ns, None), (None, back)]
        else:
            return False
        for t0, t1 in spans:
            lo = 0 if t0 is None else int(np.searchsorted(s, t0, side="left"))
            hi = len(e) if t1 is None else int(np.searchsorted(e, t1, side="right"))
            if hi > lo and excess[lo:hi].max() + d.size_bytes > 0:
                return True
        return False

    def drop(group: list[Decision]) -> None:
        """Note [Pruned in groups]: ``group`` dropped at once when the accept rule keeps that,
        else each half on its own, down to single decisions."""
        group = [d for d in group if not surely_over(d)]
        if not group:
            return
        # improve Note [The accept rule], sideways: a plan without them at the same time is kept
        got = accept(
            problem,
            lambda c=state[0], g=group: _without(problem, c, g, regen),
            state[1].time_ns,
            budget,
            ties=True,
        )
        if got is not None:
            state[0], state[1] = got
            state[2] = got[1].op_peak_bytes.astype(np.int64) - budget
            state[3] = {window_key(x): o for x, o in zip(got[0], got[1].outcomes, strict=True)}
        elif len(group) > 1:
            drop(group[: len(group) // 2])
            drop(group[len(group) // 2 :])

    drop(order[:max_exact])
    current, sim = state[0], state[1]
    live = {window_key(x) for x in current}
    rest = [d for d in order[max_exact:] if window_key(d) in live]
    if not rest:
        return current
    peak = sim.op_peak_bytes.astype(np.int64).copy()
    removed: set[tuple[str, int]] = set()
    n = problem.n_ops
    for d in rest:
        # the ops it is out on: one range, or two across the iteration boundary
        spans = [(d.evict_op + 1, n), (0, d.back_op)] if d.wraps else [(d.evict_op + 1, d.back_op)]
        if any(hi > lo and peak[lo:hi].max() + d.size_bytes > budget for lo, hi in spans):
            continue
        for lo, hi in spans:
            peak[lo:hi] += d.size_bytes
        removed.add(window_key(d))
    if not removed:
        return current
    kept = [d for d in current if window_key(d) not in removed]
    got = accept(
        problem,
        lambda: finish_decisions(problem, kept, peak - budget, collective=True, regen=regen),
        sim.time_ns,
        budget,
        ties=True,
    )
    return got[0] if got is not None else current


def _host_ns(problem: Problem, d: Decision) -> int:
    """Note [Pruning what costs host work]: the host work the simulator charges for a swap on
    the compute stream (both directions, and its three action ops: evict, in-trigger, back);
    zero on CUDA traces. A recomputation is left at its replay time."""
    h = problem.host
    if not h or d.method != Method.SWAP:
        return 0
    return 2 * h.swap_ns + 3 * h.action_op_ns


def _without(
    problem: Problem,
    decisions: list[Decision],
    gone: Iterable[Decision],
    regen: frozenset = frozenset(),
) -> list[Decision] | None:
    """``decisions`` minus those of ``gone``: the replays that regenerated their storages now
    read them as sources instead (``lineage.reresolved``); the others are unchanged."""
    ids = {id(x) for x in gone}
    kept = [x for x in decisions if id(x) not in ids]
    return reresolved(problem, kept, {x.storage_id for x in gone}, regen)
