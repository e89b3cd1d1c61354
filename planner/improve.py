"""The improvement kernel: one accept rule and one selector for every search over plans. No torch.

# Note: [The accept rule]
# Every local improvement of a plan (search.prune, search.switch_stalled and through it the
# recompute-first conversions, hiding.hide and hiding.advance, bound.search_plans behind
# ``capuchin-ls``) proposes trial plans and keeps one by the same rule, ``accept``: the trial is
# made and simulated; it is kept when it breaks no invariant (``PlanError`` while making or
# simulating it rejects it), its simulated peak is at most the bound, and it is faster than the
# current plan. With ``ties=True`` an equally fast trial is kept too: a sideways move, for
# dropping a decision that costs nothing (fewer decisions at the same time) and for the seeded
# local search (which walks across plateaus). Each move bounds the peak by the plan's own
# bound, so an improved plan stays where the grid put it (search Note [Targets]).
#
# Note: [One selector]
# Among finished plans, ``rank`` orders by: fits the budget first; among those the fastest, then
# the higher peak (at the same time, the plan that evicts less); among the others the lowest
# peak; ties keep the earlier. ``search.pick`` (over the grid) and ``search.best_of`` (over the
# policy's variants) both choose by it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import PlanError
from .plan import Decision
from .problem import Problem
from .simulator import SimResult, simulate

Trial = Sequence[Decision] | None


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
