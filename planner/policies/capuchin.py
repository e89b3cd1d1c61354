"""Capuchin's policy (paper §4.3-4.5; reference/capuchin.md §1.7-1.8): Algorithm 1, the hybrid
choice between swapping and recomputing, with Algorithm 2 (msps.py) ranking the recomputations.
Registered as ``capuchin``, and restricted to one method as ``swap`` and ``recompute``.
``Capuchin`` is Algorithm 1 for one memory target (a ``search.TargetPlanner``); the policies wrap
it in the generic search of planner/search.py, which is not in the paper.

# Note: [Required reduction, per op]
# The paper stops once the evicted bytes reach the "required memory reduction" measured in
# passive mode, one number. Here it is kept per op: ``excess[k]`` is how far op k's memory is
# above the target; a decision lowers it on the ops it covers (those that run entirely while the
# storage is out) and selection stops when no op exceeds the target. That is an estimate, so each
# round ends with the simulator: while the simulated peak is above the target, the excess is
# re-read from the simulated curve and another round adds decisions, until the plan fits or
# nothing helps (then the round with the lowest simulated peak is returned).
#
# Note: [Persistent candidates]
# Parameters, gradients and optimizer state are swap candidates too, within the iteration and
# across its boundary (problem.py Note [Wrap-around gaps]), never recomputed. Greedy selection is
# not monotone in its candidates, so ``capuchin`` also plans without them (search Note
# [Restricted first]). ``swap`` and ``recompute``, baselines, keep to the paper's candidates.
#
# Note: [A candidate per gap of persistent storages]
# An activation is one candidate (the paper's tensor): once chosen over one of its gaps its
# other gaps are no longer candidates, and Algorithm 2 replays it over one gap. With
# ``Capuchin.per_gap`` a parameter, a persistent gradient or an optimizer moment is one
# candidate per gap instead (``_key``): its gaps within the iteration and its wrap-around gap
# may all be chosen, each a swap of its own, their windows disjoint (plan.py Note [Several
# windows per storage]). Where state dominates memory the floor counts every gap of it out
# (problem.py ``floor_bytes``), and only a candidate per gap reaches it. Greedy selection is not
# monotone in its candidates (with a candidate per gap some plans get slower), so the search
# with persistent candidates makes its plans with one per storage and then the hybrid's with a
# candidate per gap, and keeps the best: never slower than with one per storage.
#
# Note: [The search with persistent candidates]
# The restricted problem's plans cannot go below its floor (``Problem.floor_bytes`` without the
# persistent candidates); reaching lower is what the persistent candidates are for. So on the
# full problem the hybrid, swap-only and per-gap hybrid grids are made for the grid's targets
# below the restricted problem's floor only (``below``; on problems that are not small, only
# those above the full problem's floor, Note [Deep targets on large problems]), and the
# recompute-only grid for every target. Above the restricted floor those grids cost the most
# (greedy selection takes many small wrap-around swaps, and switching re-simulates each) and won
# no cell measured. Which targets are planned depends on the problem alone, never on the
# budget, so the pick stays monotone in the budget (search Note [Monotone by construction];
# tests/test_planner_properties.py holds a generated problem where a budget-dependent choice was
# not).
#
# Note: [Deep targets on large problems]
# On problems that are not small (search Note [Search breadth]), each candidate (the hybrid,
# recompute-only and swap-only grids) plans for its deep targets (search Note [Deep targets])
# only when none of its other plans fits the budget; on small problems, where they cost little
# and win cells where other plans fit, always. On large problems the deep plans are the
# costliest to make, prune and switch (Algorithm 2 aiming below the floor evicts every candidate
# and replays long chains) and lost every cell measured where another plan fit; they stay for
# the budgets that need them, so the policy's reach is unchanged, and where they are taken only
# plans no faster than the others' lowest-peak plan are offered, which keeps the pick monotone
# (search Note [Monotone by construction]).
#
# Note: [Never worse than the baselines]
# The policy's pick (search Note [Best of variants]) includes the ``recompute`` policy's plan
# and, on problems of more than ``SEARCH_MAX_OPS`` ops, the ``dtr`` policy's (its decisions are
# recomputations the builder completes, a plan the runtime runs like any other), after
# capuchin's own plans: ties keep capuchin's, and neither is made when one of capuchin's fits at
# no cost. So capuchin is never slower under the simulator than recompute-only, nor than DTR
# where DTR takes part. Up to ``SEARCH_MAX_OPS`` ops the recompute policy picks from the grid
# capuchin's own recompute-only search made (cached: the candidate costs a pick), so the pick
# stays budget-independent (search Note [Monotone by construction]); there "never slower than
# DTR" rests on the cells measured (docs/planner.md), not on construction. Above, every policy
# plans for the budget itself (search Note [Op limits]) and DTR's plan is made for the budget by
# an online heuristic: neither is monotone in the budget, and with them the policy is not either
# (``figures["search"]["baselines"]`` records DTR's candidate).
#
# Note: [Plans that cannot fit]
# The restricted search, both baselines and the recompute-only grid of the search with
# persistent candidates plan decisions on evictable storages only (recomputations, and the
# on-demand swaps a replay without sources becomes), so none of their plans peaks below the
# floor of the problem without the persistent candidates (``Problem.floor_bytes``: everything
# stays but evictable storages inside their gaps). Below that floor only the other grids of the
# search with persistent candidates can fit, and the pick (improve Note [One selector]: a
# fitting plan before any that does not) could take none of the others: they are not made.
# Where state dominates memory that is most budgets (docs/planner.md, "A deep model of thin
# layers"). Whether they are made depends on the budget, but only where they cannot be picked,
# so the pick is the same and stays monotone (where no plan fits, the policy's plan fits neither
# way).
#
# Note: [The search, in the plan's provenance]
# ``figures["search"]`` (the plan's ``provenance.parameters``) records which plans the search
# made: ``persistent`` ("none": the search with persistent candidates was not made, the
# restricted plan fitting at no cost; "full": made), ``deep`` (the candidates, as "restricted
# hybrid", "full recompute", ..., whose deep targets were planned: offered only as search Note
# [Monotone by construction] allows), ``descend`` where the problem is too large for the grid
# (not monotone), ``baselines`` (["dtr"]) where DTR's plan was made as a candidate (Note [Never
# worse than the baselines]). Up to ``SEARCH_MAX_OPS`` ops a larger budget never gets a slower
# plan, whatever these say.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

import numpy as np

from ...errors import PlanError
from ..collector import gc_paused
from ..gaps import AccessGap
from ..lineage import EvictionWindows, finish_decisions
from ..msps import MspsQueue
from ..plan import Decision, Method
from ..problem import Problem
from ..registry import PolicyResult, register
from ..search import (
    SEARCH_MAX_OPS,
    AfterRound,
    Attempt,
    Switching,
    best_of,
    deep_needed,
    searched,
    small,
    timer_from,
)
from ..simulator import simulate
from ..swapping import SwapTimer, WrapEstimate, estimate_wrap, reserve_wrap, wrap_free_time

_max = np.maximum.reduce


@register("capuchin")
@gc_paused
def capuchin(
    problem: Problem,
    budget_bytes: int,
    *,
    max_rounds: int = 12,
    collective: bool = True,
    max_replay_ops: int = 200,
) -> PolicyResult:
    """Capuchin's hybrid policy: the best (search Note [Best of variants]) of the hybrid on the
    target grid with stalled-swap switching, the recompute-only and swap-only plans; with and
    without the persistent candidates. Problems above
    ``SEARCH_MAX_OPS`` ops get the hybrid alone, searched downwards from the budget.
    ``max_rounds``: simulate-and-extend rounds. ``collective``: keep what a replay regenerates
    when it is needed later and memory allows (§5.3). ``max_replay_ops``: longest replay.
    Output (registry Note [Policy contract]): at most one decision per evictable storage and
    per gap of a persistent one (Note [A candidate per gap of persistent storages]); swaps carry
    their in-trigger, recomputations their replay ops, sources and keeps."""
    hybrid = Capuchin("hybrid", max_rounds, collective, max_replay_ops)
    rec = Capuchin("recompute", max_rounds, collective, max_replay_ops)
    swap = Capuchin("swap", max_rounds, False, 0)
    planners = (hybrid, rec, swap, Switching(collective, max_replay_ops))
    # Note [The search, in the plan's provenance]
    made: dict = {"persistent": "none", "deep": []}
    result = lambda ds: PolicyResult(tuple(ds), figures={"search": made})  # noqa: E731
    if problem.n_ops == 0 or problem.peak_bytes <= budget_bytes:
        return result([])
    # search Note [Restricted first]: without the persistent candidates, then with them unless
    # that fits at no cost; the better under the simulator (ties: the former)
    base = problem.restricted()
    floor = base.floor_bytes()
    cannot = base is not problem and budget_bytes < floor  # Note [Plans that cannot fit]
    plans = []
    if not cannot:
        restricted = _plan(base, budget_bytes, planners, made, "restricted")
        plans.append(lambda: restricted)
    if base is not problem and (cannot or not _costs_nothing(problem, restricted, budget_bytes)):
        made["persistent"] = "full"
        # Note [The search with persistent candidates]: the restricted problem's floor
        full = _plan(problem, budget_bytes, planners, made, "full", below=floor)
        plans.append(lambda: full)
    # Note [Never worse than the baselines]: best_of makes them only when no plan before them
    # fits at no cost
    baselines = (
        []
        if cannot
        else _baselines(problem, budget_bytes, max_rounds, collective, max_replay_ops, made)
    )
    return result(best_of(problem, budget_bytes, plans + baselines))


def _baselines(
    problem: Problem,
    budget_bytes: int,
    max_rounds: int,
    collective: bool,
    max_replay_ops: int,
    made: dict,
) -> list:
    """Note [Never worse than the baselines]: the ``recompute`` policy's plan and, on problems
    of more than ``SEARCH_MAX_OPS`` ops, the ``dtr`` policy's (its lineage completed), as
    candidates for ``best_of``, made when called."""

    kw = {"max_rounds": max_rounds, "collective": collective, "max_replay_ops": max_replay_ops}

    def rec() -> list[Decision]:
        return list(recompute_only(problem, budget_bytes, **kw).decisions)

    def dtr() -> list[Decision]:
        from ..build import complete_decisions
        from ..registry import get_policy

        made["baselines"] = ["dtr"]  # Note [Never worse than the baselines]
        try:
            return complete_decisions(problem, get_policy("dtr")(problem, budget_bytes).decisions)
        except PlanError:  # lineage the builder cannot complete: no candidate (the empty plan)
            return []

    return [rec, dtr] if problem.n_ops > SEARCH_MAX_OPS else [rec]


def _costs_nothing(problem: Problem, decisions: list[Decision], budget_bytes: int) -> bool:
    """Whether ``decisions`` fit ``budget_bytes`` at no extra time (as simulated): no plan can
    beat them (False when they break an invariant)."""
    try:
        sim = simulate(problem, decisions)
    except PlanError:
        return False
    return sim.peak_bytes <= budget_bytes and sim.time_ns <= sim.baseline_time_ns


def _deep(p: Problem) -> bool | None:
    """Note [Deep targets on large problems]: always on small problems, else when needed."""
    return True if small(p) else None


def _plan(
    p: Problem,
    budget_bytes: int,
    planners: tuple,
    made: dict,
    name: str,
    below: int | None = None,
) -> list[Decision]:
    """The best (search Note [Best of variants]) of the hybrid on the target grid with
    stalled-swap switching, the recompute-only and swap-only plans, and on the full problem the
    hybrid with a candidate per gap; above ``SEARCH_MAX_OPS`` ops the hybrid alone, searched downwards. Records the deep targets
    planned and the descent in ``made``."""
    hybrid, rec, swap, sw = planners
    if p.n_ops > SEARCH_MAX_OPS:
        made["descend"] = True
        return searched(p, budget_bytes, hybrid)
    deep = _deep(p)

    def search(planner: Capuchin, switching: Switching | None = None, below=None):
        def run() -> list[Decision]:
            hiding = planner.mode != "swap"  # search Note [Hidden swaps, on the grid]
            # Note [The search with persistent candidates]: the floor as deep as the others'
            d = deep if below is None else deep is not None
            ds = searched(p, budget_bytes, planner, switching, d, hiding, below=below)
            if d is None and deep_needed(p, planner, budget_bytes, switching):
                made["deep"].append(f"{name} {planner.mode}")
            return ds

        return run

    def variants():  # a generator: best_of stops early at a plan that costs nothing
        yield search(hybrid, sw, below)
        if below is None or budget_bytes >= below:  # Note [Plans that cannot fit]
            yield search(rec)
        yield search(swap, None, below)
        if p is not p.restricted():  # Note [A candidate per gap of ...]
            yield search(replace(hybrid, per_gap=True), sw, below)

    return best_of(p, budget_bytes, variants())


@register("swap")
@gc_paused
def swap_only(problem: Problem, budget_bytes: int, *, max_rounds: int = 12) -> PolicyResult:
    """Capuchin restricted to swapping: zero-overhead swaps by free time, then the swaps with the
    smallest exposed wait, until the simulated peak fits; on the target grid."""
    swap = Capuchin("swap", max_rounds, False, 0)
    p = problem.restricted()
    return PolicyResult.of(searched(p, budget_bytes, swap))


@register("recompute")
@gc_paused
def recompute_only(
    problem: Problem,
    budget_bytes: int,
    *,
    max_rounds: int = 12,
    collective: bool = True,
    max_replay_ops: int = 200,
) -> PolicyResult:
    """Capuchin restricted to recomputation: Algorithm 2 (largest MSPS first, iterative update)
    until the simulated peak fits; on the target grid."""
    planner = Capuchin("recompute", max_rounds, collective, max_replay_ops)
    p = problem.restricted()
    # Note [Deep targets on large problems], as capuchin's own recompute-only grid
    ds = searched(p, budget_bytes, planner, deep=_deep(p))
    return PolicyResult.of(ds)


@dataclass(frozen=True)
class Capuchin:
    """Algorithm 1 for one target, in rounds of selection and simulation (Note [Required reduction,
    per op]); ``mode``: "hybrid", "swap" (swaps only) or "recompute" (Algorithm 2 only)."""

    mode: str = "hybrid"
    max_rounds: int = 12
    collective: bool = True
    max_replay_ops: int = 200
    per_gap: bool = False  # Note [A candidate per gap of persistent storages]

    def __call__(
        self,
        problem: Problem,
        target: int,
        after_round: AfterRound | None = None,
        max_extra_ns: int | None = None,
    ) -> Attempt:
        """The plan of the best round (the first that fits the target, else the lowest peak).
        ``after_round`` rewrites each round's plan before more is selected. ``max_extra_ns``:
        give up (``Attempt([], None)``) once the recomputations selected have Algorithm 2
        overheads adding up to more (search Note [Deep targets])."""
        excess = problem.live_bytes.astype(np.int64) - target
        chosen: dict = {}  # by candidate (Note [A candidate per gap of persistent storages])
        key = _key if self.per_gap else _storage_key
        timer = SwapTimer(problem, excess > 0)
        best = Attempt([], None)
        regen: frozenset = frozenset()
        spent = [0]  # Algorithm 2's overheads of the recomputations selected
        for i in range(self.max_rounds):
            # Note [The first swaps, shared]: the first round starts from the target alone
            first = ("swap-first", target, self.per_gap) if i == 0 else None
            added = self._select(problem, excess, chosen, timer, spent, first)
            if max_extra_ns is not None and spent[0] > max_extra_ns:
                return Attempt([], None)
            ds = list(chosen.values())
            decisions = finish_decisions(problem, ds, excess, self.collective, regen)
            try:
                sim = simulate(problem, decisions)
            except PlanError:
                if not self.collective:
                    raise
                # a keep that does not check out: plan without collective keeps
                decisions = finish_decisions(problem, ds, excess, False, regen)
                sim = simulate(problem, decisions)
            if after_round is not None:
                decisions, sim, regen = after_round(Attempt(decisions, sim, regen))
                chosen = {key(problem, d.storage_id, d.evict_op): d for d in decisions}
            if best.sim is None or sim.peak_bytes < best.sim.peak_bytes:
                best = Attempt(decisions, sim, regen)
            if sim.peak_bytes <= target or not added:
                break
            excess = sim.op_peak_bytes.astype(np.int64) - target
            timer = timer_from(problem, sim, excess > 0)
        return best

    def _select(
        self,
        problem: Problem,
        excess: np.ndarray,
        chosen: dict,
        timer: SwapTimer,
        spent: list[int] | None = None,
        first: tuple | None = None,
    ) -> int:
        """One pass of Algorithm 1; lowers ``excess`` in place and adds to ``chosen``. Returns
        the number of decisions added; adds the recomputations' Algorithm 2 overheads to
        ``spent[0]``."""
        sel = _Selection(problem, excess, chosen, timer, self.max_replay_ops, self.per_gap)
        sel.run(swapping=self.mode != "recompute", recomputing=self.mode != "swap", first=first)
        if spent is not None:
            spent[0] += sel.spent_ns
        return sel.added


class _Selection:
    """The state of one pass of Algorithm 1 (``Capuchin._select``): the per-op ``excess`` over
    the target (lowered in place), the decisions ``chosen`` so far (added to), the swap timer's
    channels, and Algorithm 2's queue once the hybrid phase starts.

    # Note: [Estimates between takes]
    # A swap's estimate is a function of its gap, the timer's channels and the excess (through
    # ``useful``); only taking a decision changes the last two. So estimates are remembered
    # until the next take: the hybrid phase's ranking re-estimates every pair the swap-first
    # phase estimated after its last take, and the heap's top is estimated again before it is
    # compared.
    #
    # Note: [Only gaps that can help]
    # The swap-first phase takes a pair only when its estimate has no overhead and covers an op
    # still over the target. Every option without overhead covers ops within
    # ``SwapTimer.hidden_span`` (from the first op after the swap-out to the last that ends by
    # the latest in-copy start still in time; None: no option is without overhead), and a
    # wrap-around swap covers ops of its gap (after the evicted-access to the end of the
    # iteration, from the start up to the back-access). So a pair whose span (a wrap's gap)
    # holds no such op is passed over without an estimate: the same pairs are taken, as the
    # estimate could not have helped (tests/test_channel.py checks the span against every
    # in-trigger).
    #
    # Note: [Candidates ranked once]
    # A pair's free time (Eq. 1) depends on the problem alone (op times and bandwidths, not the
    # channels' reservations), so the ranking of every access pair is made once per problem;
    # each round keeps, in that order, the pairs not chosen whose gap holds an op over the
    # target. The same list as ranking the kept pairs each round: the key (free time, storage,
    # evicted-access) is unique per pair.
    #
    # Note: [The first swaps, shared]
    # A plan's first round starts from the target alone: the excess over it, no decision, the
    # channels empty. Its swap-first phase reads nothing else (not the mode: the hybrid and the
    # swap-only planner run the same phase; the candidate key does, one per storage or per
    # gap), so the swaps it takes are remembered per problem under (target, per gap) and the
    # other planners of the grid take them again without estimating (the probes of the deep
    # targets, search Note [Deep targets], and the plans made after them too). The state they
    # leave is the one the phase leaves (estimates are made again when asked: a function of
    # that state, Note [Estimates between takes])."""

    def __init__(
        self,
        problem: Problem,
        excess: np.ndarray,
        chosen: dict,
        timer: SwapTimer,
        max_replay_ops: int,
        per_gap: bool = False,
    ):
        self.problem = problem
        self.key = _key if per_gap else _storage_key  # Note [A candidate per gap of ...]
        self.excess = excess
        self.chosen = chosen
        self.timer = timer
        self.max_replay_ops = max_replay_ops
        self.queue: MspsQueue | None = None  # Algorithm 2's candidates, in the hybrid phase
        self.added = 0  # decisions added
        self.spent_ns = 0  # Algorithm 2's overheads of the recomputations selected
        self._estimates: dict = {}  # Note [Estimates between takes]

    def useful(self, lo: int, hi: int) -> bool:
        """Whether covering ops lo..hi lowers an op still over the target."""
        # the ufunc's reduce: ndarray.any/max go through Python wrappers, and this runs for
        # every option of every estimate (DenseNet-121 at 60%: 480,000 calls)
        return hi >= lo and _max(self.excess[lo : hi + 1], initial=0) > 0

    def estimate(self, p: AccessGap):  # ChooseSwapIntrigger and SwapOverhead (lines 3-4)
        key = (p.storage_id, p.evict_op, p.back_op, p.wraps)
        e = self._estimates.get(key)
        if e is None:
            fn = estimate_wrap if p.wraps else SwapTimer.estimate
            e = self._estimates[key] = fn(
                self.timer, p.size_bytes, p.evict_op, p.back_op, self.useful
            )
        return e

    @staticmethod
    def covers(e) -> list[tuple[int, int]]:
        return list(e.cover) if isinstance(e, WrapEstimate) else [(e.cover_lo, e.cover_hi)]

    def helps(self, e) -> bool:
        return any(self.useful(lo, hi) for lo, hi in self.covers(e))

    def cost(self, p: AccessGap, e) -> int:  # SwapOverhead, with the chosen replays that read p
        return e.overhead_ns + (self.queue.swap_penalty(p) if self.queue is not None else 0)

    def take_swap(self, p: AccessGap, e) -> None:  # Swap(t), mem_saving -= t.mem (lines 7, 12)
        self._estimates.clear()  # the channels and the excess change
        self.chosen[self.key(self.problem, p.storage_id, p.evict_op)] = p.decision(
            Method.SWAP, trigger_op=e.trigger_op
        )
        (reserve_wrap if p.wraps else SwapTimer.reserve)(self.timer, e)
        for lo, hi in self.covers(e):
            self.excess[lo : hi + 1] -= p.size_bytes
        if self.queue is not None:
            self.queue.swapped(p)
        self.added += 1

    def take_recompute(self, r) -> None:  # Recompute(t) and Algorithm 2's update (line 10)
        self._estimates.clear()  # the excess changes
        g = self.queue.select(r.storage_id).gap
        self.chosen[g.storage_id] = g.decision(Method.RECOMPUTE)
        self.spent_ns += r.overhead_ns
        self.excess[g.evict_op + 1 : g.back_op] -= g.size_bytes
        self.excess[g.back_op] += r.temp_bytes
        self.added += 1

    def _swap_first(self, pairs: list) -> tuple[tuple, bool]:
        """The swap-first phase (§4.5; §1.8 step 3): the swaps taken, in order, and whether the
        target was met."""
        problem, excess, chosen, key = self.problem, self.excess, self.chosen, self.key
        taken = []
        n = problem.n_ops
        for ft, p in pairs:
            if key(problem, p.storage_id, p.evict_op) in chosen:
                continue
            if ft < 0:
                break  # ranked by free time: no later pair can hide either
            a, b = p.evict_op, p.back_op
            if p.wraps:
                if not (self.useful(a + 1, n - 1) or self.useful(0, b)):
                    continue  # Note [Only gaps that can help]
            else:
                span = self.timer.hidden_span(p.size_bytes, a, b)
                if span is None or not self.useful(*span):
                    continue  # Note [Only gaps that can help]: no hidden option can help
            e = self.estimate(p)
            if e.overhead_ns == 0 and self.helps(e):
                self.take_swap(p, e)
                taken.append((p, e))
                if _max(excess) <= 0:
                    return tuple(taken), True
        return tuple(taken), False

    def run(self, swapping: bool, recomputing: bool, first: tuple | None = None) -> None:
        """``first``: the key under which the swap-first phase's takes are remembered per
        problem (Note [The first swaps, shared])."""
        problem, excess, chosen = self.problem, self.excess, self.chosen
        pairs = _candidates(problem, excess > 0, chosen, self.timer)
        key = self.key
        if not pairs:
            return

        # -- swap first, while a swap costs nothing (§4.5; §1.8 step 3) --------------------------
        if swapping and first is not None:
            memo = problem.__dict__.get("_swap_first")
            if memo is None:
                memo = {}
                object.__setattr__(problem, "_swap_first", memo)
            got = memo.get(first)
            if got is None:
                got = memo[first] = self._swap_first(pairs)
            else:
                for p, e in got[0]:
                    self.take_swap(p, e)
            if got[1]:
                return
        elif swapping and self._swap_first(pairs)[1]:
            return

        # -- the hybrid phase: the cheaper of the best swap and the best recomputation -----------
        best_pair: dict = {}  # one pair per remaining candidate: longest FT
        for _, p in pairs:
            if (c := key(problem, p.storage_id, p.evict_op)) not in chosen:
                best_pair.setdefault(c, p)
        ranked = enumerate(best_pair.items()) if swapping else ()
        swaps = [(self.estimate(p).overhead_ns, i, sid) for i, (sid, p) in ranked]
        heapq.heapify(swaps)
        if recomputing:  # Algorithm 2's candidates; persistent storages are swapped only
            queue = MspsQueue(problem, EvictionWindows(chosen.values()), self.max_replay_ops)
            self.queue = queue
            for p in best_pair.values():
                if problem.storages[p.storage_id].evictable:
                    queue.add(p)

        def next_swap():  # UpdateCandidates: overheads re-estimated on the channels as filled
            while swaps:
                ov, i, sid = swaps[0]
                e = None if sid in chosen else self.estimate(best_pair[sid])
                if e is None or not self.helps(e):
                    heapq.heappop(swaps)
                elif e.overhead_ns > ov:
                    heapq.heapreplace(swaps, (e.overhead_ns, i, sid))
                else:
                    return best_pair[sid], e
            return None

        def rec_useful(c) -> bool:  # with swaps at hand, no replay whose temporaries overflow
            g = c.gap
            ok = g.storage_id not in chosen and self.useful(g.evict_op + 1, g.back_op - 1)
            return ok and (not swapping or excess[g.back_op] + c.temp_bytes <= 0)

        while _max(excess) > 0:  # lines 13-14: until the required reduction is met
            s = next_swap() if swapping else None
            r = self.queue.peek(rec_useful) if recomputing else None
            if s is None and r is None:
                break
            if s is not None:
                s_cost = self.cost(*s)
            if r is not None and swapping and (s is None or s_cost > r.overhead_ns):
                # lines 4-6 compare swapping and recomputing the *same* tensor: the tensor with
                # the best MSPS is swapped instead when that costs less than its recomputation
                rp = best_pair[r.storage_id]
                e = self.estimate(rp)
                if self.helps(e) and (c := self.cost(rp, e)) <= r.overhead_ns:
                    s, s_cost = (rp, e), c
            if r is None or (s is not None and s_cost <= r.overhead_ns):
                self.take_swap(*s)  # line 7
            else:
                self.take_recompute(r)


def _key(problem: Problem, sid: str, evict_op: int):
    """The candidate a decision on ``sid`` after op ``evict_op`` is (Note [A candidate per gap
    of persistent storages]): the storage when it is evictable, else the storage's gap."""
    return sid if problem.storages[sid].evictable else (sid, evict_op)


def _storage_key(problem: Problem, sid: str, evict_op: int) -> str:
    """One candidate per storage, the paper's (Note [A candidate per gap of persistent
    storages])."""
    return sid


def _candidates(
    problem: Problem, over: np.ndarray, chosen: dict, timer: SwapTimer
) -> list[tuple[int, AccessGap]]:
    """IdentifyAndSortCandidates (line 1): every access pair of a swappable storage not chosen
    yet whose gap holds an op over the target, ranked by free time (Eq. 1), longest first. The
    ranking is the problem's (Note [Candidates ranked once])."""
    ranked, a, b, wraps = _ranked_pairs(problem, timer)
    if not ranked:
        return []
    cnt = np.concatenate([[0], np.cumsum(over)])
    n = problem.n_ops
    # an over-target op strictly inside the gap (a wrap's: after a, or before b)
    inside = np.where(wraps, cnt[n] - cnt[a + 1] + cnt[b], cnt[b] - cnt[a + 1]) > 0
    storages = problem.storages
    pairs = []
    for i in np.flatnonzero(inside).tolist():
        ft, p = ranked[i]
        sid = p.storage_id
        if sid in chosen or (not storages[sid].evictable and (sid, p.evict_op) in chosen):
            continue  # Note [A candidate per gap of persistent storages]
        pairs.append(ranked[i])
    return pairs


def _ranked_pairs(problem: Problem, timer: SwapTimer):
    """Note [Candidates ranked once]: every access pair of a swappable storage with its free
    time, ranked (longest first, then by storage and evicted-access), with their evicted- and
    back-accesses and wrap flags as arrays; once per problem."""
    got = problem.__dict__.get("_ranked_pairs")
    if got is None:
        pairs = []
        for s in problem.storages.values():
            if not s.swappable:
                continue
            for a, b, wraps in problem.swap_gaps(s):
                ft = (wrap_free_time if wraps else SwapTimer.free_time)(timer, s.size_bytes, a, b)
                pairs.append((ft, AccessGap(s.storage_id, s.size_bytes, a, b, wraps=wraps)))
        pairs.sort(key=lambda x: (-x[0], x[1].storage_id, x[1].evict_op))
        got = (
            pairs,
            np.array([p.evict_op for _, p in pairs], dtype=np.int64),
            np.array([p.back_op for _, p in pairs], dtype=np.int64),
            np.array([p.wraps for _, p in pairs], dtype=bool),
        )
        object.__setattr__(problem, "_ranked_pairs", got)
    return got
