"""Stage coarsening for the optimal ILP: fuse runs of cheap consecutive ops into stages.

Checkmate's MILP has one stage per op and O(T²) variables; a training iteration has thousands of
ops. The ILP (``planner/policies/ilp.py``) therefore works on *stages*: contiguous op ranges. A
stage's duration is the sum of its ops' durations and its memory is the *largest* live-bytes value
of its ops (the stage is judged by its worst moment). An evicted storage counts as absent from a
stage only when it is absent for the whole stage, so a coarse stage can only make the ILP more
conservative about memory than the op-level model, never optimistic.

# Note: [Coarsening keeps the expensive and the important ops alone]
# Stages are grown by repeatedly merging the adjacent pair with the smallest combined duration
# (a chain of cheap ops collapses first; an expensive convolution stays a stage of its own), and
# never across a *pinned boundary*: the caller pins the boundaries that decide what the ILP can
# express (after an evicted-access, before a back-access) in priority order, and only the lowest
# priority ones are given up once ``max_stages`` cannot be met otherwise. With
# ``max_stages >= number of ops`` nothing is merged and the ILP is exact at op granularity.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Stages:
    """A partition of ops ``0..n-1`` into contiguous stages.

    ``first_op[s]``/``last_op[s]``: the op range of stage ``s`` (inclusive). ``duration_ns[s]``:
    the stage's summed op durations. ``peak_bytes[s]``: the maximum live bytes over its ops.
    """

    first_op: tuple[int, ...]
    last_op: tuple[int, ...]
    duration_ns: tuple[int, ...]
    peak_bytes: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.first_op)

    def stage_of(self, op: int) -> int:
        """The stage holding op index ``op`` (binary search)."""
        lo, hi = 0, len(self.first_op) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.first_op[mid] <= op:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @property
    def is_op_level(self) -> bool:
        return all(a == b for a, b in zip(self.first_op, self.last_op, strict=True))


def coarsen(
    duration_ns: Sequence[int],
    live_bytes: Sequence[int],
    *,
    max_stages: int,
    pinned: dict[int, int] | None = None,
) -> Stages:
    """Partition ops into at most ``max_stages`` stages (more only if pins forbid fewer).

    ``duration_ns[k]``/``live_bytes[k]``: op ``k``'s duration (ns) and memory while it runs
    (bytes). ``pinned``: boundary ``k`` (between op ``k-1`` and op ``k``) -> priority; a pinned
    boundary is kept unless ``max_stages`` cannot be met with the boundaries of higher priority.
    See Note [Coarsening keeps the expensive and the important ops alone].
    """
    n = len(duration_ns)
    if len(live_bytes) != n:
        raise ValueError("duration_ns and live_bytes differ in length")
    if n == 0:
        return Stages((), (), (), ())
    max_stages = max(1, int(max_stages))
    pinned = dict(pinned or {})
    # The highest-priority pinned boundaries, at most max_stages - 1 of them, are hard.
    ranked = sorted((b for b in pinned if 0 < b < n), key=lambda b: (-pinned[b], b))
    hard = set(ranked[: max_stages - 1])

    # Doubly linked list of stages, merged greedily by smallest combined duration.
    first = list(range(n))
    last = list(range(n))
    dur = [int(d) for d in duration_ns]
    peak = [int(x) for x in live_bytes]
    nxt = list(range(1, n + 1))
    prv = list(range(-1, n - 1))
    alive = [True] * n
    count = n
    heap = [(dur[i] + dur[i + 1], i, i + 1) for i in range(n - 1) if (i + 1) not in hard]
    heapq.heapify(heap)
    while count > max_stages and heap:
        cost, a, b = heapq.heappop(heap)
        if not (alive[a] and alive[b]) or nxt[a] != b or cost != dur[a] + dur[b]:
            continue  # stale entry
        # merge b into a
        last[a] = last[b]
        dur[a] += dur[b]
        peak[a] = max(peak[a], peak[b])
        alive[b] = False
        nxt[a] = nxt[b]
        if nxt[b] < n:
            prv[nxt[b]] = a
        count -= 1
        if prv[a] >= 0 and first[a] not in hard:
            p = prv[a]
            heapq.heappush(heap, (dur[p] + dur[a], p, a))
        if nxt[a] < n and first[nxt[a]] not in hard:
            heapq.heappush(heap, (dur[a] + dur[nxt[a]], a, nxt[a]))
    idx = [i for i in range(n) if alive[i]]
    return Stages(
        tuple(first[i] for i in idx),
        tuple(last[i] for i in idx),
        tuple(dur[i] for i in idx),
        tuple(peak[i] for i in idx),
    )
