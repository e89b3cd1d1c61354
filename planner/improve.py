"""The improvement kernel: one accept rule, one loop of moves and one selector for every search
over plans. No torch.

# Note: [The accept rule]
# Every local improvement of a plan (search.prune, search.switch_stalled, hiding.hide and
# hiding.advance, search_plans below, behind ``capuchin-ls``) proposes trial plans and keeps one
# by the same rule, ``accept``: the trial is made and simulated; it is kept when it breaks no
# invariant (``PlanError`` while making or simulating it rejects it), its simulated peak is at
# most the bound, and it is faster than the current plan. With ``ties=True`` an equally fast trial is kept too: a sideways move, for
# dropping a decision that costs nothing (fewer decisions at the same time) and for the seeded
# local search (which walks across plateaus). Each move bounds the peak by the plan's own
# bound, so an improved plan stays where the grid put it (search Note [Targets]).
#
# Note: [One improvement kernel]
# ``improve`` is the loop around the accept rule: a *move* reads the current plan and proposes
# trials in order (generators: a trial is made only when the one before it was refused); in
# each round the first trial kept becomes the current plan (with ``best``: every trial is tried
# and the fastest kept wins), and a round that keeps none ends it. ``switch_stalled`` (its
# switches of stalled decisions), ``hide`` (its switches to hidden swaps, halved while refused)
# and ``advance`` (its in-trigger steps, ``best``) are moves of it; ``prune`` splits the groups a
# refusal leaves and ``search_plans`` (random single-decision moves, behind ``capuchin-ls`` and
# the lower bound's upper bound) walks on past refusals, so they call ``accept`` alone.
#
# Note: [One selector]
# Among finished plans, ``rank`` orders by: fits the budget first; among those the fastest, then
# the higher peak (at the same time, the plan that evicts less); among the others the lowest
# peak; ties keep the earlier. ``search.pick`` (over the grid) and ``search.best_of`` (over the
# policy's variants) both choose by it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import PlanError
from .plan import Decision, Method
from .problem import Problem
from .simulator import SimResult, simulate


class Attempt(NamedTuple):
    """A plan with its simulation; ``regen``: recompute decisions whose replays regenerate
    their swapped-out sources rather than wait for them (search Note [Stalled swaps])."""

    decisions: list[Decision]
    sim: SimResult | None
    regen: frozenset = frozenset()


Trial = Sequence[Decision] | None
# a move: from the current plan, the trials to try in order, each with its plan's ``regen``
Move = Callable[[Attempt], Iterable[tuple[Callable[[], Trial] | Trial, frozenset]]]


def accept(
    problem: Problem,
    make: Callable[[], Trial] | Trial,
    time_ns: float,
    bound: int,
    *,
    ties: bool = False,
    seen: Callable[[Sequence[Decision], SimResult], None] | None = None,
) -> tuple[Sequence[Decision], SimResult] | None:
    """Note [The accept rule]: the trial (``make()``, or ``make`` itself when it is not
    callable; None: no trial) and its simulation when it breaks no invariant, its peak is at
    most ``bound`` and its time is below ``time_ns`` (at most, with ``ties``); else None.
    ``seen(trial, sim)`` is called for every trial within the bound, kept or not."""
    try:
        trial = make() if callable(make) else make
        if trial is None:
            return None
        sim = simulate(problem, trial)
    except PlanError:
        return None
    if sim.peak_bytes > bound:
        return None
    if seen is not None:
        seen(trial, sim)
    if sim.time_ns < time_ns or (ties and sim.time_ns == time_ns):
        return trial, sim
    return None


def improve(
    problem: Problem,
    a: Attempt,
    bound: int | Callable[[Attempt], int],
    move: Move,
    *,
    rounds: int,
    best: bool = False,
) -> Attempt:
    """Note [One improvement kernel]: ``a`` improved by ``move`` for at most ``rounds`` rounds,
    each trial judged by the accept rule against ``bound`` (``bound(current)`` when callable);
    ``a`` itself (the same objects) when no trial is kept."""
    for _ in range(rounds):
        kept = None
        cap = bound(a) if callable(bound) else bound
        for make, regen in move(a):
            got = accept(problem, make, (kept or a).sim.time_ns if best else a.sim.time_ns, cap)
            if got is not None:
                kept = Attempt(got[0], got[1], regen)
                if not best:
                    break
        if kept is None:
            break
        a = kept
    return a


def rank(peak_bytes: int, time_ns: int, budget: int) -> tuple[int, int, int]:
    """Note [One selector]: the sort key of a plan (smaller is better; ``min`` keeps the
    earlier of equal keys)."""
    if peak_bytes <= budget:
        return (0, time_ns, -peak_bytes)
    return (1, peak_bytes, 0)


def bisect_monotone(
    ok: Callable[[int], bool],
    lo: int,
    hi: int,
    tol: int | Callable[[int], int] = 1,
    max_steps: int | None = None,
) -> int:
    """The smallest value found for which ``ok`` holds, by bisection between ``lo`` (taken as
    failing) and ``hi`` (taken as holding): stops once ``hi - lo <= tol`` (``tol(hi)`` when
    callable) or after ``max_steps`` probes, and returns ``hi``. For predicates monotone in
    their argument (a larger budget fits when a smaller one does); on others it returns some
    value that holds, not necessarily the smallest."""
    steps = 0
    while hi - lo > (tol(hi) if callable(tol) else tol):
        if max_steps is not None and steps >= max_steps:
            break
        steps += 1
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


@dataclass(frozen=True)
class Found:
    """The best plan ``search_plans`` found: ``extra_ns`` its simulated extra time (None: no
    fitting plan seen), ``decisions`` its decisions; ``steps`` plans simulated, ``fitting`` how
    many of them fit the budget."""

    extra_ns: int | None
    decisions: tuple
    steps: int
    fitting: int


def search_plans(
    problem: Problem,
    budget_bytes: int,
    start,
    *,
    steps: int = 20_000,
    seed: int = 0,
    visit=None,
) -> Found:
    """An upper bound on the optimum: a seeded local search over plans from the decisions
    ``start`` (e.g. the capuchin plan's). Each step changes one decision (to a swap with a
    random in-trigger, or a swap to a recomputation), removes one, or adds one on a random
    candidate gap (``ilp.candidates``; replacing that storage's decision), completes its
    lineage and keeps it by ``accept`` (fits the budget, no slower: sideways moves). Every
    plan is judged by the simulator, so ``extra_ns`` is the extra time of a plan that fits:
    the optimum is at most that. ``visit(decisions, extra_ns)`` is called for every fitting plan
    simulated (the tests check the bound against each). Deterministic for a ``seed``."""
    import random

    from .build import complete_decisions
    from .policies.ilp import candidates

    rng = random.Random(seed)
    cands = [c for c in candidates(problem, budget_bytes) if not c.wraps]

    def fresh(d):
        if d.method == Method.SWAP:
            return Decision(
                d.storage_id,
                Method.SWAP,
                d.size_bytes,
                d.evict_op,
                d.back_op,
                trigger_op=d.trigger_op,
                wraps=d.wraps,
            )
        return d.switched(Method.RECOMPUTE)

    fitting = 0

    def evaluate(ds, best_ns: float) -> int | None:
        """improve Note [The accept rule], sideways: the extra ns of ``ds`` (completed by the
        builder's lineage) when it fits and is no slower than ``best_ns`` extra, else None."""

        def seen(_, sim):
            nonlocal fitting
            fitting += 1
            if visit is not None:
                visit(ds, int(sim.time_ns - problem.time_ns))

        got = accept(
            problem,
            lambda: complete_decisions(problem, ds),
            problem.time_ns + best_ns,
            budget_bytes,
            ties=True,
            seen=seen,
        )
        return None if got is None else int(got[1].time_ns - problem.time_ns)

    best_ds = [fresh(d) for d in start]
    best = evaluate(best_ds, math.inf)
    for _ in range(steps):
        ds = list(best_ds)
        move = rng.random()
        if move < 0.35 and ds:  # change how one comes back
            i = rng.randrange(len(ds))
            d = ds[i]
            if d.wraps:
                continue
            if (
                d.method == Method.SWAP
                and rng.random() < 0.5
                and problem.storages[d.storage_id].evictable
            ):
                ds[i] = d.switched(Method.RECOMPUTE)
            else:
                trig = rng.randint(d.evict_op + 1, d.back_op)
                ds[i] = d.switched(Method.SWAP, trig)
        elif move < 0.55 and ds:  # keep one resident
            ds.pop(rng.randrange(len(ds)))
        elif cands:  # evict in another gap
            c = rng.choice(cands)
            ds = [d for d in ds if d.storage_id != c.storage_id]
            if c.chain is not None and rng.random() < 0.4:
                ds.append(c.decision(Method.RECOMPUTE))
            else:
                ds.append(
                    c.decision(Method.SWAP, trigger_op=rng.randint(c.evict_op + 1, c.back_op))
                )
        v = evaluate(ds, math.inf if best is None else best)
        if v is not None:
            best, best_ds = v, ds
    return Found(best, tuple(best_ds) if best is not None else (), steps, fitting)
