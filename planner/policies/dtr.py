"""The ``dtr`` policy: DTR's online eviction (Kirisame et al., ICLR'21) simulated on the trace.

DTR decides at run time, with no profile: whenever an allocation would exceed the budget it
evicts the resident tensor with the smallest heuristic score and recomputes evicted tensors when
an op needs them. Here the same online procedure runs over the planned iteration (op by op, on
the baseline timeline plus the recomputation it causes), and the evictions it makes become the
plan: each evicted storage leaves after its last access before DTR evicted it and comes back by
recomputation at its next access.

# Note: [DTR's heuristic as implemented here]
# The score and its union-find are DTR's, shared with the runtime's dynamic mode (Note [DTR's
# score] in dtr_score.py): h(s) = (C(s) + e*(s)) / (M(s) * L(s)), the smallest evicted first.
# Here ``C(s)`` is the time to replay ``s`` for its next access with everything alive resident
# (its producer, the in-place writes applied since, and any source the baseline has already
# freed, regenerated on the way: DTR keeps such tensors as recomputable thunks and would pay for
# them too), ns; ``L(s)``: ns since its last access on the simulated clock. The value a storage
# adds to its evicted set is c(s), its own producer and writes.
# Optimizations from the DTR slides: only a random sample of ``ceil(sqrt(n))`` of the ``n``
# candidates is scored (fixed seed, so a plan is reproducible), and storages smaller than 0.01 x
# the mean evictable size are never evicted.
#
# Differences from DTR proper, forced by the plan format (planner/plan.py): an eviction becomes a
# decision on the storage's access gap (evicted right after the last access before DTR chose it, so
# the memory is free earlier than in DTR, never later; back at the next access); a storage is
# evicted at most once per iteration (the plan has one decision per storage; once back it stays);
# only storages the problem marks evictable and that the builder can regenerate for that access
# (planner/lineage.py) are candidates; rematerialization replays what the builder will replay (dead
# sources regenerated on the way, dropped ones kept: collective recomputation), so DTR's own
# bookkeeping and the simulator agree closely, though not exactly (the simulator is the judge of
# the plan; see Note [DTR calibration]). What a plan cannot say: that a tensor the baseline freed,
# regenerated as a source, stays for later replays; so a chain through freed tensors is replayed
# again at each access that needs it, where DTR would keep the regenerated tensors. At low budgets
# this makes this DTR much slower than the real one.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from dataclasses import dataclass, field

from ...dtr_score import Node, neighbourhood, score, union
from ..collector import gc_paused
from ..lineage import chain_ops, replay_for
from ..plan import Decision, Method
from ..problem import Problem
from ..registry import PolicyResult, register

SMALL_TENSOR_FRACTION = 0.01  # DTR: ignore storages below 1% of the mean size
DEFAULT_SEED = 0
DEFAULT_CALIBRATION_ROUNDS = 3
MAX_REPLAY = 200  # longest replay DTR considers (ops); longer chains are not candidates


@dataclass(frozen=True)
class DtrEviction:
    """One eviction made by the simulated DTR run.

    ``storage_id`` left memory before op ``evicted_before_op``; its last access before that was op
    ``last_access_op``; it was rematerialized before op ``remat_op`` (None: never needed again)
    and its next access after ``last_access_op`` is ``back_op``.
    """

    storage_id: str
    last_access_op: int
    evicted_before_op: int
    back_op: int
    remat_op: int | None


@dataclass(frozen=True)
class DtrRun:
    """The outcome of one simulated DTR run (all times in ns, sizes in bytes)."""

    evictions: tuple[DtrEviction, ...]
    peak_bytes: int  # highest memory in use during the run
    recompute_ns: int  # total replay time DTR spent
    remats: int  # replayed storages (including intermediates)
    oom_ops: tuple[int, ...] = ()  # ops where nothing could be evicted and the budget was exceeded
    parameters: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return not self.oom_ops


class _Dtr:
    def __init__(
        self, problem: Problem, budget_bytes: int, seed: int, sample: bool, small_fraction: float
    ):
        self.p = problem
        self.budget = budget_bytes
        self.rng = random.Random(seed)
        self.sample = sample
        st = problem.storages
        sizes = [s.size_bytes for s in st.values() if s.evictable]
        mean = (sum(sizes) / len(sizes)) if sizes else 0.0
        self.min_bytes = small_fraction * mean
        # DTR's neighbours: the storages a storage's replay reads, and those whose replay reads it
        self.parents: dict[str, set[str]] = {}
        self.children: dict[str, set[str]] = {}
        self.chain_ns: dict[str, int] = {}
        for sid, s in st.items():
            if s.alloc_op is None:
                continue
            par = set()
            for k in (s.alloc_op, *s.writers):
                par.update(u for u in problem.ops[k].inputs if u != sid)
            self.parents[sid] = par
            for u in par:
                self.children.setdefault(u, set()).add(sid)
        # both neighbour kinds in one tuple, in the order _score has always summed them
        self.nbrs: dict[str, tuple[str, ...]] = {
            sid: (*self.parents.get(sid, ()), *self.children.get(sid, ()))
            for sid in set(self.parents) | set(self.children)
        }
        self.resident: set[str] = set()
        self.evicted: dict[str, tuple[int, int]] = {}  # storage -> (evict_op, back_op)
        self.ever: set[str] = set()  # evicted once already: never again this iteration
        self.cand: list[str] = []  # resident candidates (swap-remove list)
        self.cand_pos: dict[str, int] = {}
        self.used = 0
        self.peak = 0
        self.clock = 0
        self.last_access: dict[str, int] = {}
        self.node: dict[str, Node] = {}  # union-find nodes of the storages ever evicted
        self.uf_cost: dict[str, float] = {}  # what each evicted storage added to its set
        self.evictions: dict[tuple[str, int], list] = {}  # (storage, evict_op) -> record
        self.replayable: dict[tuple[str, int, int], int | None] = {}
        # storage -> (gap start, gap end, replay cost or None, size term), for ``_best``
        self.gaps: dict[str, tuple[int, int, float | None, int]] = {}
        self.recompute_ns = 0
        self.remats = 0
        self.oom: list[int] = []
        self.op = 0
        self.exhausted = False  # a full scan found no candidate (cleared by _add_cand / next op)

    # -- candidate bookkeeping ------------------------------------------------------------------
    def _add_cand(self, sid: str) -> None:
        self.exhausted = False
        s = self.p.storages[sid]
        if (
            s.evictable
            and sid in self.parents
            and s.size_bytes >= self.min_bytes
            and sid not in self.cand_pos
            and sid not in self.ever
        ):
            self.cand_pos[sid] = len(self.cand)
            self.cand.append(sid)

    def _drop_cand(self, sid: str) -> None:
        i = self.cand_pos.pop(sid, None)
        if i is None:
            return
        last = self.cand.pop()
        if last != sid:
            self.cand[i] = last
            self.cand_pos[last] = i

    def _gap(self, sid: str) -> tuple[int, int] | None:
        """(last access before the current op, next access at or after it), or None."""
        s = self.p.storages[sid]
        back = s.next_access(self.op - 1)
        if back is None or back == self.op:
            return None
        i = bisect_left(s.accesses, self.op) - 1
        return (s.accesses[i], back) if i >= 0 else None

    def _cost(self, sid: str, upto: int) -> int:
        ops = chain_ops(self.p, sid, upto) or ()
        return sum(self.p.ops[k].duration_ns for k in ops)

    def _replay_cost(self, sid: str, e: int, b: int) -> int | None:
        """ns to regenerate ``sid`` for op ``b`` if every alive storage stayed resident (dead
        sources regenerated on the way count: DTR would pay for them too); None: impossible."""
        key = (sid, e, b)
        if key not in self.replayable:
            r = replay_for(self.p, sid, e, b, max_ops=MAX_REPLAY)
            self.replayable[key] = (
                None if r is None else sum(self.p.ops[j].duration_ns for j in r[0])
            )
        return self.replayable[key]

    def _score(self, sid: str, e: int, b: int) -> float:
        s = self.p.storages[sid]
        cost = float(self._replay_cost(sid, e, b) or 0)
        cost += neighbourhood(self.node[n] for n in self.nbrs.get(sid, ()) if n in self.evicted)
        return score(cost, s.size_bytes, self.clock - self.last_access.get(sid, 0))

    # -- memory -----------------------------------------------------------------------------------
    def _pick(self, pinned: set[str]) -> tuple[str, int, int] | None:
        n = len(self.cand)
        if n == 0:
            return None
        if self.exhausted:
            return None
        if self.sample:
            pool = self.rng.sample(self.cand, min(n, max(1, math.ceil(math.sqrt(n)))))
            best = self._best(pool, pinned)
            if best is not None:
                return best
        best = self._best(list(self.cand), pinned)  # the sample held nothing evictable
        self.exhausted = best is None  # until a candidate is added or the op changes
        return best

    # Note: [Scores bounded before the neighbourhood]
    # A candidate's score is (replay cost + e*) / denominator, and e* (``neighbourhood``) is a
    # sum of non-negative values: every cost here is a whole number of ns held in a float, so
    # the union-find's sums and differences are exact and never below zero. So the replay cost
    # alone bounds the score from below (IEEE division is monotone), and a candidate whose bound
    # is not below the best score so far cannot be picked: its neighbourhood is not walked. The
    # picks are those of scoring every candidate in full.
    def _best(self, pool: list[str], pinned: set[str]) -> tuple[str, int, int] | None:
        """The candidate of ``pool`` with the smallest score (the first of equal ones): ``_gap``,
        ``_replay_cost`` and ``_score`` inlined, the candidate loop being most of this policy's
        time on long traces (the same picks, the same arithmetic). A candidate's gap, replay
        cost and size term are remembered while the current op stays inside that gap."""
        best, best_h = None, math.inf
        op, clock = self.op, self.clock
        storages, ever, evicted, gaps = self.p.storages, self.ever, self.evicted, self.gaps
        node, nbrs, last_access = self.node, self.nbrs, self.last_access
        for sid in pool:
            if sid in pinned or sid in ever:  # ever: one decision per storage (plan format)
                continue
            g = gaps.get(sid)
            if g is None or not g[0] < op < g[1]:
                acc = storages[sid].accesses
                i = bisect_left(acc, op)  # the next access at or after op (_gap)
                if i == 0 or i == len(acc) or acc[i] == op:
                    continue
                e, b = acc[i - 1], acc[i]
                rc = self._replay_cost(sid, e, b)
                nbytes = storages[sid].size_bytes
                g = gaps[sid] = (e, b, None if rc is None else float(rc), max(nbytes, 1))
            cost = g[2]
            if cost is None:
                continue
            stale = clock - last_access.get(sid, 0)
            denom = g[3] * (stale if stale > 1 else 1)  # score's
            if cost / denom >= best_h:  # Note [Scores bounded before the neighbourhood]
                continue
            ns = nbrs.get(sid)
            if ns:
                cost += neighbourhood(node[n] for n in ns if n in evicted)
            h = cost / denom
            if h < best_h:
                best, best_h = (sid, g[0], g[1]), h
        return best

    def _reserve(self, need: int, pinned: set[str]) -> None:
        while self.used + need > self.budget:
            victim = self._pick(pinned)
            if victim is None:
                if not self.oom or self.oom[-1] != self.op:
                    self.oom.append(self.op)
                return
            self._evict(*victim)

    def _evict(self, sid: str, e: int, b: int) -> None:
        s = self.p.storages[sid]
        self.resident.discard(sid)
        self._drop_cand(sid)
        self.evicted[sid] = (e, b)
        self.used -= s.size_bytes
        self.evictions[(sid, e)] = [e, self.op, b, None]
        self.ever.add(sid)
        self.uf_cost[sid] = float(self._cost(sid, e))
        node = self.node[sid] = Node(self.uf_cost[sid])
        for n in (*self.parents.get(sid, ()), *self.children.get(sid, ())):
            if n in self.evicted:
                union(node, self.node[n])

    def _back(self, sid: str) -> None:
        """``sid`` is resident again (its own replay, or kept from another's)."""
        e, _ = self.evicted.pop(sid)
        self.resident.add(sid)
        self.used += self.p.storages[sid].size_bytes
        self.node[sid].root().value -= self.uf_cost.pop(sid, 0.0)
        self.evictions[(sid, e)][3] = self.op
        self.last_access[sid] = self.clock
        self._add_cand(sid)

    def _remat(self, sid: str, pinned: set[str]) -> None:
        """Replay ``sid`` as the builder will (planner/lineage.py), on the simulated clock."""
        p = self.p
        e, b = self.evicted[sid]

        def resident(x: str, j: int) -> bool:
            xs = p.storages[x]
            return x in self.resident and xs.alive_at(b) and not xs.written_between(j, b)

        r = replay_for(p, sid, e, b, resident=resident, max_ops=MAX_REPLAY)
        ops = r[0] if r is not None else (chain_ops(p, sid, e) or [])
        srcs = set(r[1]) if r is not None else set()
        made = [x for j in ops for x in p.ops[j].allocs]
        kept = [
            x
            for x in made
            if x != sid
            and x in self.evicted
            and set(chain_ops(p, x, self.evicted[x][0]) or [-1]) <= set(ops)
        ]
        stay = p.storages[sid].size_bytes + sum(p.storages[x].size_bytes for x in kept)
        pins = set(pinned) | srcs | {sid}
        # the target and the kept intermediates stay; the dead ones regenerated on the way live
        # until their last use in the replay (as the simulator frees them)
        self._reserve(stay + _transient_bytes(p, ops, {sid, *kept}), pins)
        self.peak = max(self.peak, self.used + stay + _transient_bytes(p, ops, {sid, *kept}))
        cost = sum(p.ops[j].duration_ns for j in ops)
        self.clock += cost
        self.recompute_ns += cost
        self.remats += 1 + len(kept)
        for x in (sid, *kept):
            self._back(x)

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> DtrRun:
        p = self.p
        for sid, s in p.storages.items():
            if s.alloc_op is None:
                self.resident.add(sid)
                self.used += s.size_bytes
        self.peak = self.used
        for k, op in enumerate(p.ops):
            self.op = k
            self.exhausted = False
            pinned = set(op.accessed)
            for u in op.accessed:
                if u in self.evicted:
                    self._remat(u, pinned)
            need = sum(p.storages[a].size_bytes for a in op.allocs)
            self._reserve(need, pinned)
            for a in op.allocs:
                self.resident.add(a)
            self.used += need
            self.peak = max(self.peak, self.used)
            for u in op.accessed:
                self.last_access[u] = self.clock
                if u in self.resident:
                    self._add_cand(u)
            self.clock += op.duration_ns
            for f in op.frees:
                if f in self.resident:
                    self.resident.discard(f)
                    self.used -= p.storages[f].size_bytes
                self.evicted.pop(f, None)
                self._drop_cand(f)
        evs = tuple(
            DtrEviction(sid, last, before, back, remat)
            for (sid, _), (last, before, back, remat) in self.evictions.items()
        )
        return DtrRun(evs, int(self.peak), int(self.recompute_ns), self.remats, tuple(self.oom))


def _transient_bytes(p: Problem, ops: list[int], staying: set[str]) -> int:
    """Peak bytes of the replay's temporaries (freed after their last use in the replay)."""
    last: dict[str, int] = {}
    for pos, j in enumerate(ops):
        for x in p.ops[j].inputs:
            last[x] = pos
    live = peak = 0
    temps: dict[str, int] = {}
    for pos, j in enumerate(ops):
        for x in p.ops[j].allocs:
            if x not in staying:
                temps[x] = p.storages[x].size_bytes
                live += temps[x]
        peak = max(peak, live)
        for x in [x for x in temps if last.get(x, -1) <= pos]:
            live -= temps.pop(x)
    return peak


def simulate_dtr(
    problem: Problem,
    budget_bytes: int,
    *,
    seed: int = DEFAULT_SEED,
    sample: bool = True,
    small_fraction: float = SMALL_TENSOR_FRACTION,
) -> DtrRun:
    """Run DTR's online eviction over ``problem`` under ``budget_bytes``.

    ``seed``: the sampling seed (DTR samples ``ceil(sqrt(n))`` candidates per eviction);
    ``sample=False`` scores every candidate. ``small_fraction``: storages smaller than this
    fraction of the mean evictable size are never evicted. See Note [DTR's heuristic as
    implemented here].
    """
    return _Dtr(problem, int(budget_bytes), seed, sample, small_fraction).run()


def decisions_from_run(problem: Problem, run: DtrRun) -> list[Decision]:
    """One recompute decision per storage DTR evicted (in the gap it evicted it in); lineage left
    to the builder."""
    out = []
    for ev in run.evictions:
        s = problem.storages[ev.storage_id]
        out.append(
            Decision(ev.storage_id, Method.RECOMPUTE, s.size_bytes, ev.last_access_op, ev.back_op)
        )
    return sorted(out, key=lambda d: (d.evict_op, d.storage_id))


@register("dtr")
@gc_paused
def dtr(
    problem: Problem,
    budget_bytes: int,
    *,
    seed: int = DEFAULT_SEED,
    sample: bool = True,
    small_fraction: float = SMALL_TENSOR_FRACTION,
    calibration_rounds: int = DEFAULT_CALIBRATION_ROUNDS,
) -> PolicyResult:
    """DTR's online eviction on the trace, as recompute decisions.

    Contract (Note [Policy contract] in planner/registry.py): recompute decisions only, at most
    one per storage (the gap DTR evicted it in), ``evict_op``/``back_op`` the storage's accesses
    around the moment DTR evicted it; lineage is resolved by the builder. Nothing is evicted when
    the baseline peak fits. When DTR runs out of candidates the decisions are still returned (the
    simulated peak then exceeds the budget and the plan is marked infeasible).

    Parameters: ``seed`` (sampling), ``sample`` (score a sqrt(n) sample, DTR's default, or every
    candidate), ``small_fraction`` (never evict storages below this fraction of the mean size),
    ``calibration_rounds``: see Note [DTR calibration].
    """
    if problem.peak_bytes <= budget_bytes:
        return PolicyResult()
    target = int(budget_bytes)
    best: tuple[tuple, list[Decision]] | None = None
    for _ in range(1 + max(0, calibration_rounds)):
        run = simulate_dtr(problem, target, seed=seed, sample=sample, small_fraction=small_fraction)
        ds = decisions_from_run(problem, run)
        if calibration_rounds <= 0:
            return PolicyResult.of(ds)
        peak, extra = _judge(problem, ds)
        score = (peak > budget_bytes, extra if peak <= budget_bytes else peak)
        if best is None or score < best[0]:
            best = (score, ds)
        if peak <= budget_bytes or peak < 0:
            break
        # Note: [DTR calibration]
        # DTR measures real memory as it runs; here its bookkeeping differs a little from the
        # simulator's (the plan evicts right after the last access, a replay regenerates what is
        # out at that point). When the simulator finds the plan over budget, DTR runs again with
        # its budget lowered by the overshoot, a few times, and the best plan is kept (feasible
        # with the least overhead, else the lowest peak). ``calibration_rounds=0`` turns it off.
        target -= peak - budget_bytes
        if target <= 0:
            break
    return PolicyResult.of(best[1] if best is not None else [])


def _judge(problem: Problem, ds: list[Decision]) -> tuple[int, int]:
    """(simulated peak, simulated extra ns) of ``ds``; (-1, 0) when they do not form a plan."""
    from ...errors import PlanError
    from ..build import complete_decisions
    from ..simulator import simulate

    try:
        sim = simulate(problem, complete_decisions(problem, ds))
    except PlanError:
        return -1, 0
    return sim.peak_bytes, sim.time_ns - problem.time_ns
