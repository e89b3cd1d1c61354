"""Dead storages: evicted after their last access, never brought back by the plan. No torch.

# Note: [Dead storages]
# A transient storage that the script keeps referenced after its last read occupies memory from
# its last access to the op after which the script frees it (``StorageInfo.dead_gap``): foreach
# AdamW's ``exp_avg_sq_sqrt`` list (one parameters-sized temporary) lives until ``step``
# returns, long after each element's last read by ``_foreach_addcdiv_``. No other decision can
# take it out there: swaps and recomputes need a back-access, wrap-around swaps are for state
# that lives across the iteration boundary.
#
# A *dead* decision (``Decision.dead``, method swap) evicts it after its last access
# (``evict_op``) and names as ``back_op`` the op after which the script frees it. The plan never
# brings it back: no prefetch, no restore (``build.action_table``). The simulator frees its bytes
# when the swap-out's copy completes; at ``back_op`` the op's own free of the storage finds it
# out already (an event that gives the bytes back to the curve), and compute waits there for a
# copy still running (the runtime discards a storage that dies while evicted after its copy is
# done, ``SwapEngine.discard``). A swap, not a drop: if anything reads it after all (a read the
# trace did not see), the runtime restores it on demand from the host copy, as any evicted
# storage; a dead storage is never a source of a replay after its last access (checked by the
# simulator). When the script frees it, the runtime drops its host copy (``died`` in
# runtime/tracker.py). The runtime needs no new action.
#
# Which: ``choose`` picks, before the policy runs, every dead gap that overlaps an op where the
# floor without dead decisions (``Problem.floor_curve``: what no swap or recompute can move) is
# over the budget. Elsewhere the other decisions can make room, and a dead eviction, whose gap is
# often one op long (an activation the script's reference holds until the next op), would cost
# its copy and host time, and a wait for the copy when the script frees it, for nothing.
# The policy then plans on ``freed_early``: the problem with those storages freed right after
# their last access, where their gaps between accesses stay candidates (foreach AdamW's
# ``exp_avg_sq_sqrt`` element waits a whole sweep of the list between two of its accesses), and
# its recompute lineage is resolved there, so no replay reads them after their last access. The
# dead decisions join the policy's: a storage may so have a dead decision and others, whose
# windows do not overlap (plan.py Note [Several windows per storage]: the others' back-accesses
# are at or before the dead one's evicted-access); the runtime keys decisions by storage and
# window (the dead one needs only its EVICT_SWAP action). While the simulated plan is still over the budget,
# the dead gaps overlapping the ops over it join as well and the policy plans again
# (``build.with_dead``). The simulator judges the whole plan on the problem as traced, copy times
# included. ``Problem.dead_evictions = False`` plans none. Only the ``capuchin`` policies plan
# with them (``build.DEAD_POLICIES``): the others are comparison baselines that plan as published,
# or the ILP, whose model does not hold them.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import numpy as np

from .plan import Decision, Method, new_decision
from .problem import Problem


def candidates(problem: Problem) -> list[tuple[str, int, int, int]]:
    """(storage, last access, free op, bytes) of every storage with a dead gap, by storage id."""
    if not problem.dead_evictions:
        return []
    out = []
    for sid in sorted(problem.storages):
        s = problem.storages[sid]
        g = s.dead_gap
        if g is not None:
            out.append((sid, g[0], g[1], s.size_bytes))
    return out


def choose(problem: Problem, budget_bytes: int) -> list[Decision]:
    """The dead decisions worth making under ``budget_bytes``: every dead gap that overlaps an
    op where no other decision can bring memory within the budget (Note [Dead storages])."""
    cands = candidates(problem)
    if not cands:
        return []
    floor = problem.floor_curve()[0]  # without dead gaps
    out = []
    for sid, last, free, size in cands:
        if int(np.max(floor[last + 1 : free + 1])) > budget_bytes:
            out.append(new_decision(sid, Method.SWAP, size, last, free, dead=True))
    return out


_FREED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def freed_early(problem: Problem, dead: list[Decision]) -> Problem:
    """``problem`` with the storages of ``dead`` freed right after their last access (Note
    [Dead storages]). Cached per set."""
    key = frozenset(d.storage_id for d in dead)
    memo = _FREED.setdefault(problem, {})
    got = memo.get(key)
    if got is not None:
        return got
    storages = dict(problem.storages)
    frees: dict[int, list[str]] = {}
    drop: dict[int, set[str]] = {}
    live = problem.live_bytes.copy()
    for d in dead:
        s = storages[d.storage_id]
        storages[d.storage_id] = replace(s, free_op=d.evict_op)
        frees.setdefault(d.evict_op, []).append(d.storage_id)
        drop.setdefault(d.back_op, set()).add(d.storage_id)
        live[d.evict_op + 1 : d.back_op + 1] -= s.size_bytes
    ops = list(problem.ops)
    for k in {*frees, *drop}:
        op = ops[k]
        kept = tuple(x for x in op.frees if x not in drop.get(k, ()))
        ops[k] = replace(op, frees=kept + tuple(frees.get(k, ())))
    got = memo[key] = replace(problem, ops=tuple(ops), storages=storages, live_bytes=live)
    return got
