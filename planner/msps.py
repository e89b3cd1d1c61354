"""Algorithm 2 of the paper: recomputation candidates ranked by MSPS, with its iterative update.

``MspsQueue`` holds the recomputation candidates (one access pair each), their sources and
recompute time, and returns the one with the largest ``MSPS = size / (rp_time + ext_time)``
(paper Eq. 2; §1.7 of reference/capuchin.md). Selecting one updates the others exactly as
Algorithm 2 lines 6-34 say, through reverse indexes (storage -> candidates that use it as a
source), so an update costs the number of affected candidates, never a scan of all of them: the
loop stays O(selections * affected * log n) instead of cubic.

# Note: [Sources in Algorithm 2]
# Initial sources follow the lineage rule of §4.3: walking back from the target's producer, a
# tensor is a source when it is alive at the back-access (not freed, not evicted by a decision
# taken so far, not written since), and every undecided candidate is *assumed resident* (it is
# only a candidate). When a candidate t is then chosen for recomputation, every candidate whose
# back-access falls in t's eviction interval and that used t as a source now starts from t's
# sources instead and pays t's recompute time too (lines 17-21); repeated recomputations are
# charged through ``ext_time`` (lines 23-32).
#
# Note: [Temporaries, capped]
# A candidate's ``temp_bytes`` (what its replay allocates besides its target) is an upper bound
# kept incrementally: a substituted source adds its bytes and its own ``temp_bytes``, so along a
# chain of substitutions it can double per link (a 48-layer GPT-2 went past 2^63 and overflowed
# the int64 excess it is added to). It is capped at ``temp_cap``, twice the bytes of every
# storage and the largest scratch, plus one. The policy reads it in two places, and the cap changes
# neither: a replay whose temporaries need ``excess[b] + temp <= 0`` holds for no value above a
# target (below the peak, so below the cap); and ``excess[b] += temp`` keeps op ``b`` over any
# target through every later decision (at most every storage's bytes come off it).
"""

from __future__ import annotations

import heapq
import weakref
from dataclasses import dataclass, field

from .gaps import AccessGap
from .lineage import EvictionWindows, replay_for
from .problem import Problem


def temp_cap(problem: Problem) -> int:
    """Note [Temporaries, capped]: twice the bytes of every storage and the largest scratch,
    plus one. Cached on the problem."""
    cap = problem.__dict__.get("_msps_temp_cap")
    if cap is None:
        cap = sum(s.size_bytes for s in problem.storages.values())
        cap = 2 * (cap + max((o.scratch_bytes for o in problem.ops), default=0)) + 1
        object.__setattr__(problem, "_msps_temp_cap", cap)
    return cap


@dataclass
class RecomputeCandidate:
    """An access gap as Algorithm 2 sees it: its sources, replay time and ``ext_time``."""

    gap: AccessGap
    srcs: set[str]
    rp_time_ns: int
    ext_time_ns: int = 0
    version: int = 0
    replay_ops: set[int] = field(default_factory=set)
    temp_bytes: int = 0  # replay temporaries on top of the target at the back-access

    @property
    def storage_id(self) -> str:
        return self.gap.storage_id

    @property
    def overhead_ns(self) -> int:
        """RecomputeOverhead = rp_time + ext_time [inferred in the reference]."""
        return self.rp_time_ns + self.ext_time_ns

    @property
    def msps(self) -> float:
        return self.gap.size_bytes / max(1, self.overhead_ns)


# Note: [Replay costs per problem]
# A candidate's replay time and temporaries are functions of the problem, its storage and its
# replay's ops alone; the queue is made again every round of selection (the residency changes)
# and adds every candidate, mostly with the replays it had before (the replay memo, lineage
# Note [Replay memo]), so both are remembered per problem under (storage, replay ops).
_REPLAY_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class MspsQueue:
    """Candidates for recomputation with Algorithm 2's selection and update."""

    def __init__(self, problem: Problem, residency: EvictionWindows, max_replay_ops: int = 200):
        self.p = problem
        self.res = residency
        self.max_replay_ops = max_replay_ops
        self.cands: dict[str, RecomputeCandidate] = {}
        self.recomps: dict[str, RecomputeCandidate] = {}
        self.users: dict[str, set[str]] = {}  # storage -> candidates/recomps with it in srcs
        self._heap: list[tuple[float, int, str, int]] = []
        self._tick = 0
        self._temp_cap = temp_cap(problem)

    # -- InitMSPS -------------------------------------------------------------------------------
    def add(self, gap: AccessGap) -> RecomputeCandidate | None:
        """Add a candidate (its sources from the lineage rule); None if it cannot be replayed."""
        sid = gap.storage_id
        r = replay_for(
            self.p, sid, gap.evict_op, gap.back_op, self.res, max_ops=self.max_replay_ops
        )
        if r is None:
            return None
        ops, srcs = r
        costs = _REPLAY_COSTS.get(self.p)
        if costs is None:
            costs = _REPLAY_COSTS[self.p] = {}
        key = (sid, tuple(ops))  # Note [Replay costs per problem]
        got = costs.get(key)
        c = RecomputeCandidate(gap, set(srcs), 0, replay_ops=set(ops))
        if got is None:
            durs = self.p.ops
            got = costs[key] = (sum(durs[j].duration_ns for j in ops), self._temp_bytes(c))
        c.rp_time_ns, c.temp_bytes = got
        self.cands[sid] = c
        for x in c.srcs:
            self.users.setdefault(x, set()).add(sid)
        self._push(c)
        return c

    def _temp_bytes(self, c: RecomputeCandidate) -> int:
        ops = self.p.ops
        st = self.p.storages
        made = sum(
            st[x].size_bytes for j in c.replay_ops for x in ops[j].allocs if x != c.storage_id
        )
        return made + max((ops[j].scratch_bytes for j in c.replay_ops), default=0)

    def _substitute(self, t: RecomputeCandidate, cand: RecomputeCandidate) -> None:
        """``cand`` used ``t`` as a source but ``t`` is out at cand's back-access: start from
        t's sources and pay t's recompute too (Algorithm 2, lines 18-21)."""
        sid = t.storage_id
        cand.srcs.discard(sid)
        self.users[sid].discard(cand.storage_id)
        for x in t.srcs:
            if x not in cand.srcs:
                cand.srcs.add(x)
                self.users.setdefault(x, set()).add(cand.storage_id)
        cand.rp_time_ns += t.rp_time_ns
        cand.replay_ops |= t.replay_ops
        # t is now regenerated on the way: its bytes and its own temporaries join cand's (an
        # upper bound, kept incremental so long chains do not make the update quadratic; it can
        # double per link, hence the cap of Note [Temporaries, capped])
        cand.temp_bytes = min(cand.temp_bytes + t.gap.size_bytes + t.temp_bytes, self._temp_cap)

    def swapped(self, gap: AccessGap) -> None:
        """``gap`` was chosen for swapping: candidates whose replay read its storage while it is
        out now regenerate it instead, as with a recomputed source."""
        t = self.cands.pop(gap.storage_id, None)
        if t is None:
            return
        t.gap = gap
        for cid in list(self.users.get(gap.storage_id, ())):
            cand = self.cands.get(cid)
            if cand is not None and self._out_at(t, cand.gap.back_op):
                self._substitute(t, cand)
                self._push(cand)

    def swap_penalty(self, gap: AccessGap) -> int:
        """Extra replay time that swapping over ``gap`` would cause to recomputations already
        chosen that read its storage (ns); 0 when the storage cannot be replayed."""
        c = self.cands.get(gap.storage_id)
        if c is None:
            return 0
        n = sum(
            1
            for r in self.users.get(gap.storage_id, ())
            if r in self.recomps and gap.evict_op < self.recomps[r].gap.back_op <= gap.back_op
        )
        return n * c.rp_time_ns

    def _push(self, c: RecomputeCandidate) -> None:
        c.version += 1
        self._tick += 1
        heapq.heappush(self._heap, (-c.msps, self._tick, c.storage_id, c.version))

    def discard(self, sid: str) -> None:
        """Remove a candidate (taken for swap, or no longer useful)."""
        c = self.cands.pop(sid, None)
        if c is not None:
            for x in c.srcs:
                self.users.get(x, set()).discard(sid)

    def peek(self, useful) -> RecomputeCandidate | None:
        """The candidate with the largest MSPS for which ``useful(c)`` holds (others dropped)."""
        while self._heap:
            _, _, sid, ver = self._heap[0]
            c = self.cands.get(sid)
            if c is None or c.version != ver:
                heapq.heappop(self._heap)
                continue
            if not useful(c):
                heapq.heappop(self._heap)
                self.discard(sid)
                continue
            return c
        return None

    # -- select t and update (Algorithm 2, lines 5-34) -------------------------------------------
    def select(self, sid: str) -> RecomputeCandidate:
        t = self.cands.pop(sid)
        ext_ct = 1
        for rp_id in list(self.users.get(sid, ())):  # lines 6-12
            rp = self.recomps.get(rp_id)
            if rp is not None and self._out_at(t, rp.gap.back_op):
                rp.srcs.discard(sid)
                rp.srcs |= t.srcs
                ext_ct += 1
        self.recomps[sid] = t  # lines 13-15
        for x in t.srcs:
            self.users.setdefault(x, set()).add(sid)
        for cid in list(self.users.get(sid, ())):  # lines 17-29
            cand = self.cands.get(cid)
            if cand is None or not self._out_at(t, cand.gap.back_op):
                continue
            self._substitute(t, cand)
            n_users = sum(1 for r in self.users.get(cid, ()) if r in self.recomps)
            cand.ext_time_ns = n_users * cand.rp_time_ns
            self._push(cand)
        for cid in t.srcs:  # lines 30-33
            cand = self.cands.get(cid)
            if cand is not None:
                cand.ext_time_ns = ext_ct * cand.rp_time_ns
                self._push(cand)
        return t

    def _out_at(self, t: RecomputeCandidate, op: int) -> bool:
        return t.gap.evict_op < op <= t.gap.back_op
