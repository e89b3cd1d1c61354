"""The CP-SAT model of the ``ilp`` policy (planner/policies/ilp.py) and its simulate-and-cut
solve. Registered nothing: the policy, its candidates, the sizing of the model to the time
limit and the warm start are in ilp.py.

The formulation (Jain et al., *Checkmate*, MLSys'20), written for the decisions a plan can express
(per storage and access gap: keep, or evict after the evicted-access and bring back before the
next access by swap or recomputation; planner/plan.py) and extended with POET/OffMate-style swap
variables. Stages ``t`` are op ranges (planner/coarsen.py), ``D_t`` a stage's baseline duration.

- Candidates ``v`` = (storage, gap ``(e_v, b_v)``) whose gap covers an op over the budget; a
  persistent storage's gaps are swap candidates, its wrap-around gap included (Note [Wrap-around
  gaps in the model]).
  ``drop_v`` (evict, recompute) and ``swap_v`` (evict, swap) are binaries, ``drop_v + swap_v <= 1``.
  Checkmate's checkpoint variable is ``S[t, v] = 1 - drop_v - a[v, t]`` in the gap, 1 elsewhere.
- ``R[b, j]`` (Checkmate's recompute variable): op ``j`` is replayed before op ``b``.
  ``R[b_v, j] >= drop_v - K_v`` for every op ``j`` of ``v``'s chain (producer and in-place writers,
  lineage.chain_ops), where ``K_v`` says ``v`` was already regenerated whole and kept by a replay
  inside its gap (collective recomputation; Checkmate's ``S[t+1] <= S[t] + R[t]``). Checkmate's
  dependency ``R[t, j] <= R[t, i] + S[t, i]``: for every input ``x`` of a replayed op ``j`` that
  is not resident and unchanged at ``b`` (lineage's source rule), ``R[b, j'] >= R[b, j]`` for
  the ops ``j'`` of ``x``'s chain; when ``x`` is resident unless dropped by candidate ``u``,
  ``R[b, j'] >= R[b, j] + drop_u - 1`` (a swapped-out source is restored on demand). And
  ``R[b, j] <= sum of what asks for it``: nothing is replayed that no drop needs.
- Swap (per stage, as POET): ``out[v, t]``/``in[v, t]`` are the ns of ``v``'s device->host and
  host->device copies done in stage ``t``; per channel and stage, copies fit in the stage's length
  ``D_t + rc_t + st_t`` (``rc_t = sum R[b, j] dur_j`` over back-accesses ``b`` in ``t``, ``st_t``
  the stall there, allowed only where something is restored); the in-copy follows the out-copy
  and starts no earlier than the in-trigger's stage; the part of the copies in ``b_v``'s own
  stage fits in that stage's replay and stall time.
- ``a[v, t]``: swapped ``v`` is off the device for the whole of stage ``t`` (out-copy done before
  ``t``'s ops run, in-copy not started before ``t`` ends). Only stages over the budget get one.
- Memory (Checkmate's ``U``, with ``FREE`` folded into the baseline curve): for every op ``k``
  over the budget, ``live_k - sum size_v drop_v [e_v < k < b_v] - sum size_v a[v, stage(k)]
  <= budget`` (identical rows merged).
- Objective: ``sum R[b, j] dur_j + sum st_t`` = the extra ns on the compute stream (ties broken
  towards fewer evictions).

# Note: [Wrap-around gaps in the model]
# A persistent storage's wrap-around gap (problem.py Note [Wrap-around gaps]: from its last
# access ``l`` to its first access ``f`` of the next iteration) is a swap candidate with
# ``wraps``: its window is the stages after ``l``'s to the end, then from the start up to
# ``f``'s (``window``), in that order, and its copy schedule runs along it as along any window
# (the out-copy first, the in-copy from the in-trigger's stage on, both done by ``f``). The
# channels' per-stage loads are those of the one iteration that repeats, so a copy in the
# window's first part and one in its second part share the channels of the same stages, as in
# the steady state the simulator models (Note [Steady state across iterations]). Its in-trigger
# is ``trigger_op``'s rule on the unrolled timeline (iteration i+1 from ``T`` on). Persistent
# storages are never recomputed: no drop variable.
#
# Note: [Where the ILP and the simulator differ]
# The simulator (planner/simulator.py) is the judge. At op granularity the ILP is a *relaxation*
# of it: for any set of candidate choices, its memory is never above the simulator's and its cost
# never above the simulated extra time. What it leaves out, all in its own favour:
#   - copies share a channel fractionally within a stage (the simulator runs them one at a time
#     in issue order); the in-copy starts in the in-trigger's stage or later (``trigger_op``);
#   - replay intermediates and storages kept by collective recomputation take no memory;
#   - an op replayed for two decisions before the same op is paid once; a swapped-out source of
#     a replay is restored on demand (lineage.replay_for) at no charge;
#   - op durations round up and copy times down to ticks of ``tick_ns`` (the copy schedule's
#     unit, 1/100000 of the iteration by default);
#   - memory is checked only where the baseline is over the budget.
# One difference goes the other way: where the simulator charges the runtime's host work on the
# compute stream (``Problem.host``, CPU traces: costs.py Note [Host work on the compute stream]),
# the stages are longer there than the model's, so the model may miss swaps the longer stages
# would hide (and its bound does not count that work: it stays a lower bound on the cost).
# Coarse stages break the relaxation the other way (a storage off the device for part of a stage
# counts as present), so coarse optima are optima of the stage model only.
# ``solve`` closes the gap by combinatorial Benders cuts: each assignment the ILP proposes is
# turned into decisions and simulated; an assignment over budget is excluded, otherwise
# ``objective >= simulated extra time`` is enforced at that assignment. The loop stops when the
# ILP's bound reaches the best simulated plan: at op granularity, that plan is the simulator's
# optimum over the same choices (what brute force finds; tests/test_ilp_bruteforce.py).
#
# Note: [A kept storage is a source]
# A dropped storage ``x`` regenerated whole and kept by a replay at op ``b2`` inside its gap is
# in state "in" up to its back-access (simulator ``_replay``): a replay at an op ``b >= b2``
# that reads it takes it as a resident source, and the plan need not replay ``x``'s chain
# there. So the dependency "``x``'s chain is replayed before op ``b`` when op ``j`` is and ``x``
# is dropped" is waived by ``x``'s ``kept`` literals up to ``b``: ``z >= R[b, j] + drop_x - 1 -
# sum kept_x[b2 <= b]``. Without it the model charged such a plan for a replay it does not run
# (a small trace: 2,100 ns for a plan the simulator runs in 1,100; tests/test_bound.py), and
# was no relaxation there.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...errors import CapuchinError
from ..coarsen import Stages
from ..gaps import AccessGap
from ..lineage import chain_ops
from ..problem import Problem


class Choice(str, enum.Enum):
    KEEP = "keep"
    RECOMPUTE = "recompute"
    SWAP = "swap"


Key = tuple[str, int]  # (storage_id, evict_op): one access gap of one storage


@dataclass(frozen=True)
class Candidate(AccessGap):
    """One access gap of an evictable storage. ``chain``: the ops regenerating it (None: not
    recomputable); ``out_ns``/``in_ns``: its copy times as the simulator computes them."""

    chain: tuple[int, ...] | None
    out_ns: int
    in_ns: int
    trigger: int | None = None  # a fixed in-trigger (the warm start's); None: ``trigger_op``'s rule
    # ``wraps`` (AccessGap): the wrap-around gap (Note [Wrap-around gaps in the model])


def window(stages: Stages, c: Candidate) -> list[int]:
    """The stages entirely inside ``c``'s gap, in time order: after the evicted-access's stage
    up to the back-access's, or for a wrap-around gap to the end and then from the start
    (Note [Wrap-around gaps in the model])."""
    lo, bs = stages.stage_of(c.evict_op) + 1, stages.stage_of(c.back_op)
    if not c.wraps:
        return list(range(lo, bs))
    return [*range(lo, len(stages)), *range(0, bs)]


@dataclass(frozen=True)
class IlpResult:
    """The outcome of ``solve``.

    ``choices``: candidate key -> Choice of the best plan found (simulated when an evaluator was
    given). ``best_ns``: its extra time (ns); ``bound_ns``: a proven lower bound on the extra time
    of every plan in the decision space (see Note [Where the ILP and the simulator differ]);
    ``objective_ns``: the ILP's own objective at its last solution. ``status``: "OPTIMAL"
    (best == bound), "FEASIBLE", "INFEASIBLE" (no choice fits the budget) or "UNKNOWN"."""

    choices: dict[Key, Choice]
    status: str
    objective_ns: int | None
    bound_ns: int
    best_ns: int | None
    solve_time_s: float
    rounds: int
    variables: int
    constraints: int
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def optimality_gap(self) -> float | None:
        """(best - bound) / best: 0.0 when proven optimal; None without a plan."""
        if self.best_ns is None:
            return None
        if self.best_ns <= 0:
            return 0.0
        return max(0.0, (self.best_ns - self.bound_ns) / self.best_ns)


def _import_cp_model():
    try:
        from ortools.sat.python import cp_model
    except ImportError:  # pragma: no cover - depends on the environment
        raise CapuchinError("the ilp policy needs OR-Tools: pip install capuchin[ilp]") from None
    return cp_model


def copy_ns(size_bytes: int, bytes_per_s: float) -> int:
    """Copy time as the simulator computes it (ns)."""
    return int(round(size_bytes / bytes_per_s * 1e9))


PREFIX_TERMS_MAX = 2_000_000  # above this, prefix-sum variables (see _Model)


def kept_ops(b: int, back: int) -> range:
    """The ops at which a storage kept by a replay before op ``b`` is resident, up to its
    back-access ``back`` (``kept_resident``; bound.py Note [Replays take memory])."""
    return range(b, back)


def tightened(terms: list, need: int) -> list:
    """A memory row ``sum size * literal >= need`` (``terms``: (name, size, literal); a negative
    size is a kept storage's bytes back on the device) with each positive size capped at
    ``need`` plus the negative sizes' magnitudes: the same 0/1 points satisfy it (a literal at
    1 whose size reaches the cap satisfies both; without one no cap applies), but a fraction of
    a storage larger than the excess covers less of it (bound.py Note [Replays take memory],
    ``tight_memory``)."""
    cap = need - sum(size for _n, size, _v in terms if size < 0)
    return [(n, min(size, cap), v) for n, size, v in terms]


class _OutOfTime(Exception):
    """Model building ran past its deadline (caught by the policy, which builds a smaller one)."""


class _Model:
    """The CP-SAT model (built once, then cut by the Benders loop)."""

    def __init__(
        self,
        problem: Problem,
        stages: Stages,
        budget_bytes: int,
        cands: list[Candidate],
        tick_ns: int = 1,
        deadline: float | None = None,
        kept_resident: bool = False,
        tighten_memory: bool = False,
    ):
        """``kept_resident``: a storage kept by a replay inside its gap counts as resident in
        the memory rows from that replay to its back-access; ``tighten_memory``: each memory
        row's sizes capped (``tightened``). Both from bound.py Note [Replays take memory], off
        for the ``ilp`` policy, which stays the model described above."""
        t_build = time.perf_counter()
        self.deadline = deadline
        cp_model = _import_cp_model()
        self.cp_model = cp_model
        lsum = cp_model.LinearExpr.sum  # one node per sum (Python's sum nests one per term)
        self.problem = problem
        self.stages, self.budget_bytes = stages, budget_bytes
        m = self.m = cp_model.CpModel()
        st = stages
        n_st = len(st)
        self.drop: dict[Key, Any] = {}
        self.swap: dict[Key, Any] = {}
        self.R: dict[tuple[int, int], Any] = {}  # (back op, replayed op) -> bool
        self._needs: list = []  # (z, R[b, j], x, b): a dropped source's need (_replay)
        self.why: dict[tuple[int, int], list] = {}  # what asks for R[b, j] (the simulator
        # replays nothing else, so R[b, j] <= sum of them: no replay just to win time)
        self.cands: dict[Key, Candidate] = {}
        self.by_storage: dict[str, list[Candidate]] = {}
        windows: dict[Key, list[int]] = {}  # stages entirely inside the gap, in time order
        # Copy schedules are in ticks of ``q`` ns (small domains solve much faster); durations
        # round up and copy times down, so the ticked model stays a relaxation.
        q = self.q = max(1, int(tick_ns))
        horizon = (
            4 * (problem.time_ns + sum(max(c.out_ns, 0) + max(c.in_ns, 0) for c in cands)) // q + 1
        )
        for c in cands:
            win = window(st, c)
            k = c.key
            if c.chain is not None and not c.wraps:  # a drop frees ops e+1..b-1 exactly
                self.drop[k] = m.new_bool_var(f"drop{k}")
            if c.out_ns >= 0 and win:  # a swap needs whole stages to hide its copies in
                self.swap[k] = m.new_bool_var(f"swap{k}")
            if k in self.drop and k in self.swap:
                m.add(self.drop[k] + self.swap[k] <= 1)
            if k in self.drop or k in self.swap:
                windows[k] = win
                self.cands[k] = c
                self.by_storage.setdefault(c.storage_id, []).append(c)

        # -- recomputation: Checkmate's R and its dependency constraints --------------------------
        for k in self.drop:
            c = self.cands[k]
            self._check_clock()
            for j in c.chain:
                self._replay(c.back_op, j)
                self.why[(c.back_op, j)].append(self.drop[k])
        self._check_clock()
        import bisect

        r_backs = sorted({b for (b, _j) in self.R})
        self.kept: dict[Key, list[tuple[int, Any]]] = {}  # (replay's back op, K_v's term)
        for k, d in self.drop.items():
            c = self.cands[k]
            self._check_clock()
            kept = []  # regenerated whole (and kept) by a replay before an op inside the gap
            for b in r_backs[
                bisect.bisect_right(r_backs, c.evict_op) : bisect.bisect_left(r_backs, c.back_op)
            ]:
                if all((b, j) in self.R for j in c.chain):
                    kv = m.new_bool_var(f"kept{k}@{b}")
                    for j in c.chain:
                        m.add(kv <= self.R[(b, j)])
                    kept.append(kv)
                    self.kept.setdefault(k, []).append((b, kv))
            for j in c.chain:
                m.add(self.R[(c.back_op, j)] + lsum(kept) >= d)
        for z, r, x, b in self._needs:  # Note [A kept storage is a source]
            keys = [
                c.key
                for c in self.by_storage.get(x, ())
                if c.evict_op < b <= c.back_op and c.key in self.drop
            ]
            kept_x = [kv for k in keys for b2, kv in self.kept.get(k, ()) if b2 <= b]
            m.add(z >= r + lsum([self.drop[k] for k in keys]) - 1 - lsum(kept_x))
        for key, r in self.R.items():
            m.add(r <= lsum(self.why[key]))
        rc = [[] for _ in range(n_st)]  # replay terms per stage
        for (b, j), r in self.R.items():
            rc[st.stage_of(b)].append(-(-problem.ops[j].duration_ns // q) * r)

        # -- swapping: per-stage copy time on each channel (POET) ---------------------------------
        stall_stages = sorted(
            {st.stage_of(c.back_op) for k, c in self.cands.items() if k in self.swap}
            | {st.stage_of(b) for (b, _j) in self.R}
        )
        self.stall = {t: m.new_int_var(0, horizon, f"st{t}") for t in stall_stages}
        # compute only waits for a restore (a swap due back, or a swapped source of a replay):
        # no stall where nothing is restored (the simulator never waits for memory)
        why: dict[int, list] = {t: [] for t in stall_stages}
        for k, w in self.swap.items():
            why[st.stage_of(self.cands[k].back_op)].append(w)
        for (b, _j), r in self.R.items():
            why[st.stage_of(b)].append(r)
        for t, lits in why.items():
            m.add(self.stall[t] <= horizon * lsum(lits))
        pre = [lsum(rc[t]) + self.stall.get(t, 0) for t in range(n_st)]
        length = [-(-st.duration_ns[t] // q) + pre[t] for t in range(n_st)]
        has_pre = [bool(rc[t]) or t in self.stall for t in range(n_st)]
        self.pre, self.length = pre, length  # ticks before stage t's ops; its whole length
        out_load = [[] for _ in range(n_st)]
        out_pre = [[] for _ in range(n_st)]  # out-copies of storages due back in stage t
        out_abs = [[] for _ in range(n_st)]  # out-copy parts ending before stage t's ops
        in_load = [[] for _ in range(n_st)]
        in_pre = [[] for _ in range(n_st)]
        self.absent: dict[tuple[Key, int], Any] = {}
        # per swap candidate: ns of its out- and in-copy done by the end of each stage of its
        # window and its back-access's (``co``, ``ci`` below)
        self.copy_done: dict[Key, tuple[dict, dict]] = {}
        over = {t for t in range(n_st) if st.peak_bytes[t] > budget_bytes}
        # Prefix sums spelled out have w²/2 terms for a window of w stages: fine for small
        # models (and CP-SAT searches them better: the bundled transformer at 50%), too slow to
        # build for big ones, which get prefix-sum variables (O(1) terms per constraint).
        prefix_vars = sum((len(windows[k]) + 1) ** 2 for k in self.swap) > PREFIX_TERMS_MAX
        for k, w in self.swap.items():
            c = self.cands[k]
            self._check_clock()
            win = windows[k]
            bs = st.stage_of(c.back_op)
            seq = [*win, bs]  # the window's stages in time order, then the back-access's
            c_out, c_in = c.out_ns // q, c.in_ns // q
            # the out-copy may run into the back-access's stall (the restore waits for it)
            # the in-copy starts at the in-trigger at the earliest (the simulator waits further
            # for the channel and the out-copy); before it, the in-copy variables are fixed to 0
            trig = trigger_op(problem, c, budget_bytes)
            ts = st.stage_of(trig)
            # (a wrap-around swap's trigger after ``evict_op`` lies in its window's first part)
            late = c.wraps and trig > c.evict_op
            first_in = seq.index(ts) if ts in seq and not late else 0
            out_v = {t: m.new_int_var(0, c_out, f"out{k}{t}") for t in seq}
            in_v = {
                t: m.new_int_var(0, c_in if i >= first_in else 0, f"in{k}{t}")
                for i, t in enumerate(seq)
            }
            # ``co[t]``: ns of the out-copy done by the end of stage t; ``ci`` the in-copy's
            co, ci = {seq[0]: out_v[seq[0]]}, {seq[0]: in_v[seq[0]]}
            if prefix_vars:
                for i in range(1, len(seq)):
                    t, u = seq[i], seq[i - 1]
                    co[t] = m.new_int_var(0, c_out, f"co{k}{t}")
                    ci[t] = m.new_int_var(0, c_in if i >= first_in else 0, f"ci{k}{t}")
                    m.add(co[t] == co[u] + out_v[t])
                    m.add(ci[t] == ci[u] + in_v[t])
            else:
                outs = [out_v[t] for t in seq]
                ins = [in_v[t] for t in seq]
                for i in range(1, len(seq)):
                    co[seq[i]] = lsum(outs[: i + 1])
                    ci[seq[i]] = lsum(ins[: i + 1])
            m.add(co[bs] == c_out * w)
            m.add(ci[bs] == c_in * w)
            self.copy_done[k] = (co, ci)
            for t in win:
                out_load[t].append(out_v[t])
                in_load[t].append(in_v[t])
            out_pre[bs].append(out_v[bs])
            in_pre[bs].append(in_v[bs])
            for t in seq:  # the in-copy follows the out-copy (fractionally)
                m.add(c_out * ci[t] <= c_in * co[t])
            for i, t in enumerate(win):
                if t not in over:
                    continue
                a = m.new_bool_var(f"a{k}{t}")
                self.absent[(k, t)] = a
                m.add(a <= w)
                done = co[win[i - 1]] if i > 0 else 0
                if has_pre[t]:  # the copy may end during t's replays and stall, before its ops
                    p = m.new_int_var(0, c_out, f"outpre{k}{t}")
                    m.add(p <= out_v[t])
                    out_abs[t].append(p)
                    done = done + p
                m.add(done >= c_out * a)
                m.add(ci[t] <= c_in * (1 - a))
        for t in range(n_st):
            if out_load[t] or out_pre[t]:
                m.add(lsum(out_load[t] + out_pre[t]) <= length[t])
            if out_abs[t] or (out_pre[t] and st.first_op[t] == st.last_op[t]):
                m.add(lsum(out_abs[t] + out_pre[t]) <= pre[t])
            if in_load[t] or in_pre[t]:
                m.add(lsum(in_load[t] + in_pre[t]) <= length[t])
            if in_pre[t] and st.first_op[t] == st.last_op[t]:
                m.add(lsum(in_pre[t]) <= pre[t])  # before the op: only its replays and stall

        # -- memory: one constraint per op over the budget (identical ones merged) ---------------
        # a dropped storage is off the device for ops e+1..b-1; a swapped one for the stages its
        # ``a`` variable covers
        self.hopeless = []
        live = problem.live_bytes
        rows: dict[frozenset, tuple[int, list]] = {}
        drops = sorted((self.cands[k].evict_op, self.cands[k].back_op, k) for k in self.drop)
        absent_at: dict[int, list] = {}
        for (k, t), a in self.absent.items():
            absent_at.setdefault(t, []).append((("a", k, t), self.cands[k].size_bytes, a))
        kept_at: dict[int, list] = {}  # op -> kept terms (negative: bytes back on the device)
        for k, kvs in self.kept.items() if kept_resident else ():
            c = self.cands[k]
            for b, kv in kvs:
                for op in kept_ops(b, c.back_op):
                    kept_at.setdefault(op, []).append((("k", k, b), -c.size_bytes, kv))
        active: dict[Key, tuple] = {}  # drops whose gap covers the current op (a sweep)
        i_drop = 0
        for op in (int(x) for x in (live > budget_bytes).nonzero()[0]):
            self._check_clock()
            while i_drop < len(drops) and drops[i_drop][0] < op:
                e, b, k = drops[i_drop]
                active[k] = (("d", k), self.cands[k].size_bytes, self.drop[k], b)
                i_drop += 1
            for k in [k for k, x in active.items() if x[3] <= op]:
                del active[k]
            t = st.stage_of(op)
            terms = [x[:3] for x in active.values()] + absent_at.get(t, []) + kept_at.get(op, [])
            need = int(live[op]) - budget_bytes
            key = frozenset(x[0] for x in terms)
            if key not in rows or rows[key][0] < need:
                rows[key] = (need, terms)
        for need, terms in rows.values():
            versions = [terms]
            if tighten_memory and any(size < 0 for _n, size, _v in terms):
                # the row without its kept terms holds too (kept storages counted off), and its
                # cap is lower: both, so that the kept terms never loosen the relaxation
                versions.append([x for x in terms if x[1] > 0])
            for terms in versions:
                if terms and tighten_memory:
                    terms = tightened(terms, need)
                if terms:
                    m.add(
                        cp_model.LinearExpr.weighted_sum(
                            [v for _n, _s, v in terms], [size for _n, size, _v in terms]
                        )
                        >= need
                    )
                else:
                    self.hopeless.append(need)
        self.objective = cp_model.LinearExpr.weighted_sum(
            list(self.R.values()), [problem.ops[j].duration_ns for (_b, j) in self.R]
        ) + q * lsum(list(self.stall.values()))
        # ties broken towards fewer evictions (lexicographic: time first), so that the Benders
        # loop does not spend rounds on plans with superfluous free-looking swaps
        self.scale = len(self.drop) + len(self.swap) + 1
        m.minimize(
            self.scale * self.objective
            + lsum(list(self.drop.values()))
            + lsum(list(self.swap.values()))
        )
        self.build_s = time.perf_counter() - t_build

    def _check_clock(self) -> None:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise _OutOfTime()

    def _droppers(self, x: str, b: int) -> list:
        """drop variables of the candidates that would keep ``x`` out when op ``b``'s
        before-actions run (lineage.EvictionWindows.out_at: ``e < b <= back``). A swapped-out source
        is restored on demand (lineage.replay_for), so swaps do not force a replay."""
        return [
            self.drop[c.key]
            for c in self.by_storage.get(x, ())
            if c.evict_op < b <= c.back_op and c.key in self.drop
        ]

    def _replay(self, b: int, j: int):
        """Checkmate's R[b, j] with its dependency constraints (lineage.replay_for's rule)."""
        if (b, j) in self.R:
            return self.R[(b, j)]
        self._check_clock()
        m, p = self.m, self.problem
        r = m.new_bool_var(f"R{b},{j}")
        self.R[(b, j)] = r
        self.why[(b, j)] = []
        op = p.ops[j]
        for x in op.inputs:
            if x in op.writes:
                continue  # the chain being replayed: its earlier ops come first
            xs = p.storages[x]
            base_ok = xs.source_at(j, b)
            ev = self._droppers(x, b) if base_ok else []
            if base_ok and not ev:
                continue
            chain = chain_ops(p, x, j - 1)
            if chain is None:  # x cannot be regenerated (and cannot be dropped either)
                m.add(r == 0)  # op j cannot be replayed before op b
                continue
            if ev:  # needed only if op j is replayed *and* x is dropped (and not kept)
                z = m.new_bool_var(f"need{b},{j},{x}")
                m.add(z <= r)
                m.add(z <= sum(ev))
                # z >= r + drop - 1 - (x kept by a replay up to op b): once the kept literals
                # exist (Note [A kept storage is a source])
                self._needs.append((z, r, x, b))
            else:
                z = r
            for jj in chain:
                child = self._replay(b, jj)
                m.add(child >= z)
                self.why[(b, jj)].append(z)
        return r

    # -- Benders loop helpers -----------------------------------------------------------------------
    def literals(self, choices: Mapping[Key, Choice]) -> list:
        """Literals all true exactly at ``choices``."""
        lits = []
        for k in self.cands:
            ch = choices.get(k, Choice.KEEP)
            d, w = self.drop.get(k), self.swap.get(k)
            if ch == Choice.RECOMPUTE and d is not None:
                lits.append(d)
            elif ch == Choice.SWAP and w is not None:
                lits.append(w)
            else:
                lits.extend(x.Not() for x in (d, w) if x is not None)
        return lits

    def read(self, solver) -> dict[Key, Choice]:
        out = {}
        for k in self.cands:
            if k in self.drop and solver.value(self.drop[k]):
                out[k] = Choice.RECOMPUTE
            elif k in self.swap and solver.value(self.swap[k]):
                out[k] = Choice.SWAP
            else:
                out[k] = Choice.KEEP
        return out

    def hint(self, choices: Mapping[Key, Choice]) -> None:
        self.m.clear_hints()
        for k, d in self.drop.items():
            self.m.add_hint(d, choices.get(k) == Choice.RECOMPUTE)
        for k, w in self.swap.items():
            self.m.add_hint(w, choices.get(k) == Choice.SWAP)


Evaluator = Callable[[Mapping[Key, Choice]], "int | None"]


def solve(
    problem: Problem,
    budget_bytes: int,
    stages: Stages,
    cands: list[Candidate],
    *,
    time_limit_s: float = 30.0,
    evaluate: Evaluator | None = None,
    warm_start: Mapping[Key, Choice] | None = None,
    workers: int = 1,
    seed: int = 0,
    max_rounds: int = 10_000,
    tick_ns: int = 1,
    build_deadline: float | None = None,
    seen: dict | None = None,
) -> IlpResult:
    """Solve the ILP within ``time_limit_s`` seconds (wall clock, the whole loop).

    ``evaluate(choices)`` simulates the plan made of ``choices`` and returns its extra time in ns
    (None: over budget); with it the Benders loop of Note [Where the ILP and the simulator
    differ] runs until the bound meets the best simulated plan, without it one solve is made.
    ``warm_start``: a known plan's choices (e.g. the capuchin hybrid's), given to CP-SAT as a
    solution hint and, when ``evaluate`` accepts it, taken as the first incumbent.
    ``build_deadline``: a ``time.perf_counter()`` instant; building the model past it raises
    ``_OutOfTime``. ``seen``: a cache of ``evaluate``'s results (by the assignment's non-keep
    choices), shared by the caller's calls.
    """
    t0 = time.perf_counter()
    model = _Model(problem, stages, budget_bytes, cands, tick_ns, deadline=build_deadline)
    cp_model = model.cp_model
    proto = model.m.proto
    n_vars, n_cons = len(proto.variables), len(proto.constraints)
    notes: list[str] = []
    best: dict[Key, Choice] | None = None
    best_ns: int | None = None
    seen = {} if seen is None else seen

    def consider(ch: Mapping[Key, Choice]) -> int | None:
        nonlocal best, best_ns
        sig = _signature(ch)
        if sig not in seen:
            seen[sig] = evaluate(ch)
        v = seen[sig]
        if v is not None and (best_ns is None or v < best_ns):
            best, best_ns = dict(ch), v
        return v

    if model.hopeless:
        notes.append("an op over the budget has nothing evictable around it")
        return IlpResult(
            {},
            "INFEASIBLE",
            None,
            0,
            None,
            time.perf_counter() - t0,
            0,
            n_vars,
            n_cons,
            tuple(notes),
        )
    if warm_start is not None:
        ws = {k: warm_start.get(k, Choice.KEEP) for k in model.cands}
        model.hint(ws)
        whole = sum(c != Choice.KEEP for c in ws.values()) == sum(
            c != Choice.KEEP for c in warm_start.values()
        )
        if evaluate is not None and consider(ws) is None and whole:
            notes.append("the warm start is over budget in the simulator")
    bound, objective, status, rounds = 0, None, "UNKNOWN", 0
    while rounds < max_rounds:
        left = time_limit_s - (time.perf_counter() - t0)
        if left <= 0:
            notes.append("time limit reached")
            break
        rounds += 1
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(left, 0.05)
        solver.parameters.num_workers = workers
        solver.parameters.random_seed = seed
        solver.parameters.linearization_level = 2  # the copy schedule is an LP: let CP-SAT see it
        code = solver.solve(model.m)
        if code == cp_model.INFEASIBLE:
            # every assignment left is over budget: the best simulated one (if any) is optimal
            status = "OPTIMAL" if best_ns is not None else "INFEASIBLE"
            bound = best_ns if best_ns is not None else bound
            break
        if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            notes.append(f"CP-SAT stopped without a solution ({solver.status_name(code)})")
            break
        ch = model.read(solver)
        objective = int(round(solver.objective_value)) // model.scale
        # a round's bound holds for the whole space: cuts only remove simulated assignments
        bound = max(bound, int(solver.best_objective_bound + 1e-6) // model.scale)
        if evaluate is None:
            best, best_ns = ch, objective
            status = "OPTIMAL" if code == cp_model.OPTIMAL else "FEASIBLE"
            break
        v = consider(ch)
        lits = model.literals(ch)
        if v is None:  # over budget in the simulator: exclude this assignment
            model.m.add_bool_or([x.Not() for x in lits])
        elif v > objective:  # the ILP was optimistic here: tell it the simulated cost
            model.m.add(model.objective >= v).only_enforce_if(lits)
        if best_ns is not None and bound >= best_ns:
            status = "OPTIMAL"
            break
        if code != cp_model.OPTIMAL:
            status = "FEASIBLE"
            notes.append("time limit reached inside CP-SAT")
            break
        if best is not None:
            model.hint(best)
    if best_ns is not None:
        bound = min(bound, best_ns)
        if status in ("UNKNOWN", "INFEASIBLE"):
            status = "OPTIMAL" if bound >= best_ns else "FEASIBLE"
    return IlpResult(
        dict(best) if best is not None else {},
        status,
        objective,
        int(bound),
        best_ns,
        time.perf_counter() - t0,
        rounds,
        n_vars,
        n_cons,
        tuple(notes),
    )


def _signature(ch: Mapping[Key, Choice]) -> tuple:
    return tuple(sorted((k, c.value) for k, c in ch.items() if c != Choice.KEEP))


def trigger_op(problem: Problem, c: Candidate, budget_bytes: int) -> int:
    """The in-trigger of a swap (paper §4.4): the latest op in ``(evict, back]`` starting, on the
    baseline timeline, early enough for the copy to end by the back-access (``evict + 1`` when
    none is), moved after the last op of the gap whose baseline memory is over the budget (rule
    3: never prefetch inside the peak; the copy's lateness becomes a stall instead)."""
    if c.wraps:
        return _wrap_trigger_op(problem, c, budget_bytes)
    if c.trigger is not None and c.evict_op < c.trigger <= c.back_op:
        return c.trigger
    start = problem.start_ns
    latest = int(start[c.back_op]) - c.in_ns
    k = c.back_op
    while k > c.evict_op + 1 and int(start[k]) > latest:
        k -= 1
    live = problem.live_bytes
    for j in range(c.back_op - 1, k - 1, -1):
        if live[j] > budget_bytes:
            return j + 1
    return k


def _wrap_trigger_op(problem: Problem, c: Candidate, budget_bytes: int) -> int:
    """``trigger_op``'s rule for a wrap-around gap, on the unrolled timeline (the ops after the
    evicted-access, then those of the next iteration up to the back-access, which start ``T``
    later): an op of iteration i (after ``evict_op``) or of iteration i+1 (up to ``back_op``)."""
    n = problem.n_ops
    if c.trigger is not None and 0 <= c.trigger < n and not c.back_op < c.trigger <= c.evict_op:
        return c.trigger
    seq = [*range(c.evict_op + 1, n), *range(0, c.back_op + 1)]
    period = problem.time_ns
    start = [
        int(problem.start_ns[j]) + (period if i >= n - 1 - c.evict_op else 0)
        for i, j in enumerate(seq)
    ]
    latest = start[-1] - c.in_ns
    i = len(seq) - 1
    while i > 0 and start[i] > latest:
        i -= 1
    live = problem.live_bytes
    for p in range(len(seq) - 2, i - 1, -1):
        if live[seq[p]] > budget_bytes:
            return seq[p + 1]
    return seq[i]
