"""Lineage: which ops to replay to regenerate a storage, and which resident storages they read.

``resolve_recompute(problem, decisions)`` completes every recompute decision of a plan (its
``replay_ops``, ``sources`` and ``keep``) against the residency the plan itself implies, so that
policies only say *what* to drop and *when*; the shared plan builder calls it.

# Note: [Replay chains]
# To regenerate storage T for its back-access b, replay T's producer and every op that wrote T in
# place up to its evicted-access (runtime rule R1). Each replayed op j reads storages; a storage x
# is a *source* (read from memory as it is) when it is alive at b in the baseline, not dropped by
# the plan at b (a swapped-out one is restored on demand), and not written in place between j
# and b (else the runtime refuses, rule R2).
# Otherwise x is regenerated too: its producer and its in-place writes before j join the replay.
# Replayed ops run in their original order, so every reader sees the version it saw originally.
# A storage dropped by another recompute decision and regenerated whole along the way can be
# kept (collective recomputation, paper §5.3): it is listed in ``keep``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import replace

from ..errors import PlanError
from .plan import Decision, Method
from .problem import Problem

MAX_REPLAY_OPS = 5000


class Residency:
    """Which storages a set of decisions keeps out of memory, and when."""

    def __init__(self, decisions: Sequence[Decision]):
        self._iv: dict[str, list[tuple[int, int, Method]]] = {}
        for d in decisions:
            self._iv.setdefault(d.storage_id, []).append((d.evict_op, d.back_op, d.method))
        for v in self._iv.values():
            v.sort()

    def out_at(self, sid: str, op: int) -> Method | None:
        """How ``sid`` is out when op ``op``'s before-actions run (None: not evicted then)."""
        for e, b, m in self._iv.get(sid, ()):
            if e < op <= b:
                return m
        return None

    def evicted(self, sid: str) -> bool:
        return sid in self._iv


def chain_ops(problem: Problem, sid: str, upto: int) -> list[int] | None:
    """The producer of ``sid`` and its in-place writers with index <= ``upto``; None when the
    storage has no producer in the iteration (it cannot be recomputed)."""
    s = problem.storages[sid]
    if s.alloc_op is None or s.alloc_op > upto:
        return None
    w = s.writers
    return [s.alloc_op, *(x for x in w[: bisect_right(w, upto)] if x > s.alloc_op)]


def replay_for(problem: Problem, sid: str, evict_op: int, back_op: int,
               residency: Residency | None = None, resident=None,
               max_ops: int = MAX_REPLAY_OPS) -> tuple[list[int], list[str]] | None:
    """``(replay_ops, sources)`` to regenerate ``sid`` (as of ``evict_op``) before op
    ``back_op``; see Note [Replay chains]. ``resident(x, j)`` may override the source test
    (the Capuchin policy assumes candidates resident); None when it cannot be recomputed."""
    st = problem.storages
    ops = problem.ops
    first = chain_ops(problem, sid, evict_op)
    if first is None:
        return None
    replay: set[int] = set(first)
    regen: dict[str, int] = {sid: evict_op}  # storage -> latest version needed (op bound)
    todo = list(first)
    sources: dict[str, None] = {}
    while todo:
        j = todo.pop()
        for x in ops[j].inputs:
            if x in regen:
                if j - 1 > regen[x] and x != sid:
                    more = chain_ops(problem, x, j - 1) or []
                    new = [o for o in more if o not in replay]
                    replay.update(new)
                    todo.extend(new)
                    regen[x] = j - 1
                continue
            xs = st[x]
            if resident is not None:
                ok = resident(x, j)
            else:
                # a swapped-out source is restored on demand (a bounded wait) rather than
                # regenerated through its whole lineage
                ok = (xs.alive_at(back_op) and not xs.written_between(j, back_op)
                      and (residency is None
                           or residency.out_at(x, back_op) in (None, Method.SWAP)))
            if ok:
                sources[x] = None
                continue
            more = chain_ops(problem, x, j - 1)
            if more is None:
                return None
            regen[x] = j - 1
            new = [o for o in more if o not in replay]
            replay.update(new)
            todo.extend(new)
            if len(replay) > max_ops:
                return None
    ordered = sorted(replay)
    # sources are what the ordered replay reads before producing it
    made: set[str] = set()
    need: dict[str, None] = {}
    for j in ordered:
        for x in ops[j].inputs:
            if x not in made:
                need[x] = None
        made.update(ops[j].allocs)
    return ordered, list(need)


def resolve_recompute(problem: Problem, decisions: Sequence[Decision]) -> list[Decision]:
    """Fill ``replay_ops``, ``sources`` and ``keep`` of recompute decisions that lack replay ops.

    Raises ``PlanError`` when a storage cannot be regenerated (no producer in the iteration, or
    a replay longer than ``MAX_REPLAY_OPS``).
    """
    res = Residency(decisions)
    out = []
    for d in decisions:
        if d.method == Method.RECOMPUTE and not d.replay_ops:
            r = replay_for(problem, d.storage_id, d.evict_op, d.back_op, res)
            if r is None:
                raise PlanError(f"decision {d.storage_id}: cannot be recomputed for op "
                                f"{d.back_op} (no producer, or its sources are gone)")
            ops, srcs = r
            d = replace(d, replay_ops=tuple(ops), sources=tuple(srcs),
                        keep=tuple(keepable(problem, d, ops, res)))
        out.append(d)
    return out


def keepable(problem: Problem, d: Decision, replay_ops: Sequence[int], res: Residency) -> list[str]:
    """Storages dropped by other recompute decisions that ``replay_ops`` regenerate whole (every
    in-place write up to their own evicted-access included): collective recomputation."""
    rs = set(replay_ops)
    out = []
    for j in replay_ops:
        for x in problem.ops[j].allocs:
            if x == d.storage_id or res.out_at(x, d.back_op) != Method.RECOMPUTE:
                continue
            for e, b, m in res._iv.get(x, ()):
                if m == Method.RECOMPUTE and e < d.back_op <= b:
                    chain = chain_ops(problem, x, e)
                    if chain and all(o in rs for o in chain):
                        out.append(x)
    return out
