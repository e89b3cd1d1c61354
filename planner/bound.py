"""A proven lower bound on the extra time of every plan for a budget; with an upper bound (the
best plan ``improve.search_plans`` finds), the optimum lies between them. No torch; needs
OR-Tools (MathOpt's HiGHS or GLOP, and CP-SAT).

``lower_bound(problem, budget)`` builds the ``ilp`` policy's model (policies/_ilp_model.py) at op
granularity over *every* candidate (each access gap of an evictable storage that covers an op
over the budget), with each swap's in-copy free to start any time after its out-copy, adds the
cuts of Note [Cuts the simulator implies] (``add_cuts``) and, on request, the rows of Note
[Replays take memory] (``tight_memory`` and ``kept_resident`` by default), and returns the
larger of two proven bounds on the optimum of that model:

- ``lp_ns``: the optimum of its linear relaxation (all variables continuous), as the value of a
  dual solution (HiGHS's interior point through MathOpt, GLOP where HiGHS gives none; Note [A
  bound from any dual]);
- ``cpsat_ns``: CP-SAT's best objective bound after ``time_limit_s`` of search.

``improve.search_plans(problem, budget, start)`` is a seeded local search over plans from
``start`` (e.g. capuchin's), every one judged by the simulator: the best that fits is an upper
bound on the optimum, so a policy's plan is at least (its extra - found) / its extra above the
optimum.

# Note: [Why the bound holds for every plan]
# At op granularity the model is a relaxation of the simulator (policies/_ilp_model.py Note
# [Where the ILP and the simulator differ]): for any choice of keep, swap or recompute per
# candidate, its memory is never above the simulator's and its cost never above the simulated
# extra time. The ``ilp`` policy fixes each swap's in-trigger by a rule, which would leave out
# plans that prefetch earlier; here every candidate's trigger is its first possible op, so the
# in-copy may start anywhere after the out-copy and every swap a plan can express is admitted.
# A decision on a gap that covers no op over the budget lowers no memory row of the model; a
# plan's choices on the candidates alone already satisfy every row. The cuts hold for every
# plan the simulator accepts (Note [Cuts the simulator implies]), at the model's image of the
# plan (its choices, its replays, its stalls where it stalled). So no plan whose simulated
# peak fits the budget has a simulated extra time below the model's optimum, and each of the
# two bounds is below that optimum. Stages coarser than ops would break this (a storage off
# the device for part of a stage counts as present there), hence op granularity only.
# Where the simulator charges host work on the compute stream (``Problem.host``: CPU traces)
# the real timeline is longer than the model's stages, so the model's copy windows are shorter
# than the simulator's and this argument does not cover the copy-schedule rows there (the
# ``ilp`` model's own caveat); the time cuts are left out on such problems. The DTR traces have
# no host work.
#
# Note: [Cuts the simulator implies]
# ``add_cuts`` adds inequalities the model alone does not imply, each a fact of the simulator
# (planner/simulator.py Note [Simulation model]) that holds for every plan it accepts:
# - ``one_per_storage``: at most one decision per storage over all its gaps
#   (``check_decisions`` raises ``PlanError`` on two; the plan format keys decisions by storage).
# - ``copies_in_sequence``: a swapped storage's host->device copy starts when its device->host
#   copy has ended (``start_swap_in``: ``begin >= out_end``), the out-copy starts after the
#   evicted-access ends and the back-access waits for the in-copy: the time from the end of
#   op ``e`` to the start of op ``b`` is at least ``out + in``. The model lets the two copies of
#   one storage overlap (its "in follows out" is proportional, per stage).
# - ``swap_outs_in_order``: device->host copies run one at a time in issue order, issued at
#   the end of their evicted-access: when swaps ``u`` and ``v`` with ``e_u < e_v`` are both
#   taken, ``v``'s out-copy ends at least ``out_u + out_v`` after op ``e_u`` ends, so op
#   ``b_v`` starts at least ``out_u + out_v + in_v`` after it. The model shares a channel
#   fractionally within a stage and in any order.
# - ``sources_restored``: a swapped-out storage that a replay before op ``b`` reads as a source
#   (lineage's rule: alive at ``b``, not written in place since the replayed op read it) is
#   restored on demand before the replay (``restore``: its in-copy allocates it when it starts,
#   compute waits for the end) and stays resident (state "in") up to its back-access; one already
#   prefetched is resident too. So it is on the device at every op from ``b`` to its
#   back-access: ``a[v, t] + R[b, j] <= 1`` for those ``t``, written with one monotone
#   "restored by op t" variable per swap candidate (linear size). The model lets it stay absent
#   (Note [Where the ILP and the simulator differ]: a swapped-out source is restored at no
#   charge).
# The time cuts are written on a clock of the model's own replays and stalls (``clock[k]``: the
# ticks of ``pre`` before ops 0..k; a span from the end of op i to the start of op b is the
# rounded-up baseline of ops i+1..b-1 plus ``clock[b] - clock[i]``), copy times rounded down
# to ticks as the model's, and a cut is added only where the baseline alone does not already
# cover it. A stall is a whole number of ticks in the model, so the image of a plan counts each
# stall up to a tick short: every stage that may stall inside a span is credited one tick (the
# model's copy-schedule rows round the same way: durations up, copies down). Wrap-around swaps
# are left out (the argument needs both copies in one iteration).
# On the small generated traces (tests/test_bound.py) the cuts lift the LP bound (e.g. 211 ->
# 565 ns against an optimum of 1000), and a cut strengthened beyond these facts (one decision
# per storage made none, a storage's copy time doubled, a queued swap-out counted twice) makes
# the bound exceed brute force there. On DTR's U-Net they do not move the LP: its swaps have
# gaps long enough for both copies and the queue (docs/planner.md, Lower bound).
# ``sources_restored`` lifts CP-SAT's bound on small traces (3400 -> 3800 ns against an optimum
# of 4000; 6300 -> 9900, the optimum), and made to start one op before the replay, or at the
# start of the gap, it lifts the bound above brute force (tests/test_bound.py). On DTR's U-Net
# and ResNet-32 at 80/60/40% it leaves the LP where it was and adds 2-4% variables (ResNet-32
# 40%: 402k -> 420k, the LP slower), so it is not among the default ``CUTS``.
#
# Note: [Replays take memory]
# Three families for what the model's memory rows leave out (policies/_ilp_model.py Note
# [Where the ILP and the simulator differ]: replay intermediates and storages kept by
# collective recomputation take no memory; a fraction of a storage counts off), each true of
# every plan the simulator accepts, at the model's image of the plan (its drops, swaps,
# absences and kept storages 0/1, its replays where it replays):
# - ``replay_memory`` (opt-in): the simulator runs the replays due at op ``b`` before op ``b``'s
#   own allocations (``_replay``; their events count for op ``b``). While replayed op ``j``
#   runs, its outputs and scratch are allocated, and every storage it reads is on the device: a
#   storage the replay made is freed only after its last use in the replay, a source is
#   resident or restored first (a dropped source is a ``PlanError``). The rest of what is
#   resident before op ``b`` in the baseline (``live[b]`` less op ``b``'s outputs and scratch)
#   is there too, except what a decision has off the device at that moment: a storage inside an
#   access gap ``e < b <= b'`` (due back at ``b`` included: its restore or replay may come
#   later in the plan's order) or a wrap-around gap. Such a storage counts off by its drop
#   literal; by ``swap`` for a wrap-around gap; for a swap by a literal ``off <= swap`` with
#   ``c_out off <= co[b]`` and ``ci[b-1] <= c_in (1 - off)`` (off while op ``b``'s replays run:
#   out-copy done by the end of op ``b``, in-copy not begun before op ``b``); and as off
#   outright where the model has no variable for its gap (one covering no op over the budget,
#   or none at all, ``e = b - 1``: the simulator accepts a decision there). What op ``j`` reads
#   that is not alive at ``b``, or written since ``j`` read it, is a copy of the replay's own
#   and adds its bytes; one counted off above comes back as ``size (off + R[b, j] - 1)``
#   (at most ``size off R[b, j]``, its value at the image). So ``before_b - off_b + M_b <=
#   budget`` with ``M_b >= `` each replayed op's additions holds at the event where the
#   heaviest replayed op allocates its outputs, which the simulated peak covers. Counting op
#   ``b``'s outputs as allocated then, or a storage due back at ``b`` as restored before the
#   replays, lifts the bound above brute force (tests/test_bound.py).
# - ``kept_resident`` (default): a dropped storage kept by a replay at op ``b`` inside its gap
#   (the model's ``kept`` literal, which waives its own replay) is in state "in" from then on
#   and stays on the device up to its back-access (simulator ``_replay``, Note [Simulation
#   model]): its bytes are added back to the memory rows of ops ``b`` up to its back-access
#   (``_Model(kept_resident=True)``), alongside each row as it was (which stays valid: it
#   counts a kept storage off).
# - ``tight_memory`` (default): a memory row ``sum size_v x_v >= need`` over 0/1 literals holds
#   with each positive ``size_v`` capped at ``need`` plus the magnitudes of the row's negative
#   (kept) terms (``_ilp_model.tightened``): a literal at 1 whose size reaches the cap
#   satisfies the row whatever the others are, and where none is at 1 the caps change nothing.
#   So the 0/1 points, the plans' images among them, are the same; the LP's are fewer (a
#   storage larger than the excess no longer covers it with a fraction). Capped at half the
#   excess it lifts the bound above brute force (tests/test_bound.py).
# The time cuts' clock (``add_cuts``) reaches the sum of every stall's upper bound: a plan may
# stall longer than all replays together (tests/test_bound.py).
# On the small generated traces ``tight_memory`` lifts the LP bound (282 -> 506 ns at seed 0,
# 90%, brute force 1000; 265 -> 1799 at seed 62, 50%, brute force 4000); ``replay_memory`` and
# ``kept_resident`` bind on hand-made traces (a replay holding a freed input; a kept storage
# over two ops over the budget) and lift the CP-SAT bound there to the optimum and to a fitting
# plan's cost. On DTR's ResNet-32 at 40% ``kept_resident`` lifts the LP from 24.37 to 25.23 ms
# (+225 rows); in the other four U-Net and ResNet-32 cells none of the three moves it
# (docs/planner.md, Lower bound). At U-Net 60% (its LP optimum read back): each replay's
# back-access allocates at least what the replay holds (a convolution's backward writes a
# gradient as large as its input), the storages the LP keeps are due back one op later, under
# the budget, capping the rows' sizes at their excess leaves the LP's value as it was, and the
# optimum's cost is all replays (no stall), with 7 of its 177 swaps fractional (copy channels
# filled by parts of storages). ``replay_memory`` stays opt-in: it moved no DTR cell and adds
# 3-10% variables and 10-30% rows.
#
# Note: [A bound from any dual]
# The LP is ``min c x`` over ``row_lo <= A x <= row_hi``, ``lo <= x <= hi`` with every ``lo``
# and ``hi`` finite (the model's domains). For any row multipliers ``y`` and every feasible
# ``x``: ``c x = y A x + (c - y A) x >= sum_i min(y_i row_lo_i, y_i row_hi_i) + sum_j min(d_j
# lo_j, d_j hi_j)`` with ``d = c - y A`` (a multiplier whose row side is infinite is set to 0
# first). So the right-hand side is a lower bound on the LP optimum whatever ``y`` is: it needs
# no optimal basis, no solver tolerance and no trust in the solver, only ``y`` close to an optimal
# dual for the bound to be close to the optimum. ``_dual_value`` evaluates it in floating point
# and subtracts a bound on the rounding error (each reduced cost a sequential sum of at most k + 1
# products, k the longest column, each product rounded once; the totals summed by ``math.fsum``)
# and 1 ns; the LP's data are integers below 2^53, exact in floating point. That is what lets
# the interior-point solve stop without crossover (the DTR ResNet-32 LP at 40% with the cuts
# of before Note [Replays take memory]: 402k columns; HiGHS's barrier about 70 s, GLOP's primal
# simplex about 230 s; not done: GLOP's dual simplex in 300 s, CLP in 400 s, HiGHS's barrier
# with crossover in 240 s, PDLP far off after 150 s; one core, load 0.2-2.3), and the value it
# gives is within 1e-5 of the LP optimum there (24.3677 ms against 24.3679). Only an infeasible
# LP is taken on the solver's word (``math.inf``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from dataclasses import dataclass, replace

import numpy as np

from ..errors import CapuchinError
from .coarsen import coarsen
from .problem import Problem

# add_cuts' defaults (``tight_memory`` and ``kept_resident`` act on the model's own memory
# rows: ``lower_bound``)
CUTS = (
    "one_per_storage",
    "copies_in_sequence",
    "swap_outs_in_order",
    "tight_memory",
    "kept_resident",
)
# add_cuts' other family: valid, lifts CP-SAT's bound on small traces, leaves the LP on the DTR
# traces where it was (and makes it ~4% larger): Note [Cuts the simulator implies]
SOURCES_RESTORED = "sources_restored"
# Note [Replays take memory]: a replayed op's outputs are on the device while it runs (opt-in),
# and a storage kept by a replay stays there up to its back-access
REPLAY_MEMORY = "replay_memory"
KEPT_RESIDENT = "kept_resident"  # in CUTS
TIGHT_MEMORY = "tight_memory"  # Note [Replays take memory]: coefficient tightening, in CUTS


@dataclass(frozen=True)
class LowerBound:
    """``bound_ns``: proven lower bound on the extra ns of any plan that fits (``math.inf``
    when none can: the relaxation is infeasible). ``lp_ns``/``cpsat_ns``: the two bounds
    (None: not reached in time)."""

    bound_ns: float
    lp_ns: float | None
    cpsat_ns: int | None
    candidates: int
    variables: int
    constraints: int
    lp_s: float
    cpsat_s: float
    cpsat_status: str

    def gap(self, extra_ns: float) -> float | None:
        """How far a plan with ``extra_ns`` may be above the optimum, as a fraction of its own
        extra time ((extra - bound) / extra): 0 when it is optimal; None for infinite bounds."""
        if math.isinf(self.bound_ns):
            return None
        if extra_ns <= 0:
            return 0.0
        return max(0.0, (extra_ns - self.bound_ns) / extra_ns)


def lower_bound(
    problem: Problem,
    budget_bytes: int,
    *,
    time_limit_s: float = 120.0,
    tick_ns: int | None = None,
    cpsat: bool = True,
    cuts: Collection[str] = CUTS,
) -> LowerBound:
    """See the module docstring. ``time_limit_s``: wall-clock seconds for the whole call; the
    model build and the LP run to completion, CP-SAT gets what is left (none: no CP-SAT bound).
    ``cpsat``: run CP-SAT at all. ``cuts``: which of ``add_cuts``'s families to add (``CUTS``:
    all). ``tick_ns``: the copy schedule's unit (default 1/100000 of the iteration, as the
    ``ilp`` policy)."""
    from .policies._ilp_model import _import_cp_model, _Model
    from .policies.ilp import DEFAULT_TICKS, candidates

    t0 = time.perf_counter()
    cands = [replace(c, trigger=c.evict_op + 1) for c in candidates(problem, budget_bytes)]
    if not cands:
        over = bool((problem.live_bytes > budget_bytes).any())
        return LowerBound(
            math.inf if over else 0.0,
            None,
            None,
            0,
            0,
            0,
            0.0,
            0.0,
            "INFEASIBLE" if over else "OPTIMAL",
        )
    n = problem.n_ops
    stages = coarsen(problem.durations_ns.tolist(), problem.live_bytes.tolist(), max_stages=n)
    if not stages.is_op_level:  # pragma: no cover - coarsen keeps every op when asked to
        raise CapuchinError("lower_bound needs the model at op granularity")
    if tick_ns is None:
        tick_ns = max(1, problem.time_ns // DEFAULT_TICKS)
    model = _Model(
        problem,
        stages,
        budget_bytes,
        cands,
        tick_ns,
        kept_resident=KEPT_RESIDENT in cuts,
        tighten_memory=TIGHT_MEMORY in cuts,
    )
    if cuts:
        add_cuts(model, problem, cuts)
    proto = model.m.proto
    if model.hopeless:
        return LowerBound(
            math.inf,
            None,
            None,
            len(cands),
            len(proto.variables),
            len(proto.constraints),
            0.0,
            0.0,
            "INFEASIBLE",
        )
    t_lp = time.perf_counter()
    lp = _lp_bound(model)
    lp_s = time.perf_counter() - t_lp
    cp_model = _import_cp_model()
    solver = cp_model.CpSolver()
    left = time_limit_s - (time.perf_counter() - t0)
    cp_bound, status, cp_s = None, "SKIPPED", 0.0
    if cpsat and left > 1 and not (lp is not None and math.isinf(lp)):
        t_cp = time.perf_counter()
        solver.parameters.max_time_in_seconds = left
        solver.parameters.num_workers = 1
        solver.parameters.linearization_level = 2
        code = solver.solve(model.m)
        cp_s = time.perf_counter() - t_cp
        status = solver.status_name(code)
        if code == cp_model.INFEASIBLE:
            cp_bound = math.inf
        elif code in (cp_model.OPTIMAL, cp_model.FEASIBLE, cp_model.UNKNOWN):
            # the tie-break adds at most scale - 1 to scale * objective (_Model.__init__)
            cp_bound = max(0, int(solver.best_objective_bound + 1e-6) // model.scale)
    bounds = [b for b in (lp, cp_bound) if b is not None]
    return LowerBound(
        max(bounds, default=0.0),
        lp,
        cp_bound,
        len(cands),
        len(proto.variables),
        len(proto.constraints),
        lp_s,
        cp_s,
        status,
    )


def add_cuts(model, problem: Problem, families: Collection[str] = CUTS) -> int:
    """Add to ``model`` (an op-granularity ``_Model``) the ``families`` of inequalities (``CUTS``,
    ``SOURCES_RESTORED``, ``REPLAY_MEMORY``) that every plan the simulator accepts satisfies
    (Notes [Cuts the simulator implies], [Replays take memory]); returns how many were added.
    ``TIGHT_MEMORY`` and ``KEPT_RESIDENT`` act on the model's own memory rows: ``_Model``'s
    ``tighten_memory`` and ``kept_resident``, which ``lower_bound`` sets from its ``cuts``."""
    m, q = model.m, model.q
    added = 0
    # (1) one decision per storage
    for cs in model.by_storage.values() if "one_per_storage" in families else ():
        lits = [d[c.key] for c in cs for d in (model.drop, model.swap) if c.key in d]
        if len(lits) > 1:
            m.add(sum(lits) <= 1)
            added += 1
    if SOURCES_RESTORED in families:
        added += _sources_restored(model, problem)
    if REPLAY_MEMORY in families:
        added += _replay_memory(model, problem)
    if problem.host or not {"copies_in_sequence", "swap_outs_in_order"} & set(families):
        return added  # host work lengthens the real timeline beyond the model's: no time cuts
    swaps = [
        (c.evict_op, c.back_op, c.out_ns // q, c.in_ns // q, w)
        for k, w in model.swap.items()
        for c in [model.cands[k]]
        if not c.wraps
    ]
    swaps.sort(key=lambda x: x[:4])
    if not swaps:
        return added
    n = problem.n_ops
    # ``base[k]``: ticks of ops 0..k-1 (durations rounded up, as the model's stages);
    # ``clock[k]``: ticks of replays and stalls before the ops 0..k (the model's ``pre``)
    base = [0]
    for d in problem.durations_ns.tolist():
        base.append(base[-1] + -(-int(d) // q))
    # (a protobuf repeated field takes no negative index: ``domain[-1]`` reads 0 there, which
    # capped the clock at the replays' ticks and so every plan's stalls below that)
    hi = sum(list(model.m.proto.variables[v.Index()].domain)[-1] for v in model.stall.values())
    hi += sum(-(-problem.ops[j].duration_ns // q) for (_b, j) in model.R)
    clock = []
    for k in range(n):
        x = m.new_int_var(0, hi, f"clock{k}")
        m.add(x == (clock[-1] if clock else 0) + model.pre[k])
        clock.append(x)

    # ``stalls[k]``: stages 0..k-1 that may stall. A stall of s ns is floor(s / q) ticks in the
    # model's image of a plan, up to a tick short: each one in a span is credited a tick.
    stalls = [0]
    for k in range(n):
        stalls.append(stalls[-1] + (k in model.stall))

    def span_at_least(i: int, b: int, need: int, lits: list) -> None:
        """ticks from the end of op i to the start of op b >= need when every literal holds"""
        nonlocal added
        free = base[b] - base[i + 1] + stalls[b + 1] - stalls[i + 1]
        if need <= free:
            return  # the baseline alone covers it
        m.add(clock[b] - clock[i] >= (need - free) * (sum(lits) - len(lits) + 1))
        added += 1

    # (2) a swap's in-copy starts after its out-copy ends
    for e, b, out, inn, w in swaps if "copies_in_sequence" in families else ():
        span_at_least(e, b, out + inn, [w])
    # (3) swap-outs run one at a time in the order they are issued (evicted-access order)
    for iu, (eu, _bu, outu, _inu, wu) in enumerate(
        swaps if "swap_outs_in_order" in families else ()
    ):
        for ev, bv, outv, inv, wv in swaps[iu + 1 :]:
            if ev > eu:
                span_at_least(eu, bv, outu + outv + inv, [wu, wv])
    return added


def _sources_restored(model, problem: Problem) -> int:
    """Cut (4) of Note [Cuts the simulator implies]: a swapped storage that a replay before op
    ``b`` reads as a source is on the device from op ``b`` to its back-access. ``rho[t]`` (per
    swap candidate): some replay before an op ``b <= t`` of its gap reads it."""
    m = model.m
    if len(model.pre) != problem.n_ops:  # pragma: no cover - the bound's model is op-level
        return 0
    readers: dict = {}  # swap candidate key -> {b: [R[b, j] of replayed ops j reading it]}
    for (b, j), r in model.R.items():
        op = problem.ops[j]
        for x in op.inputs:
            if x in op.writes:
                continue
            xs = problem.storages[x]
            if not xs.source_at(j, b):
                continue  # not a source: regenerated by the replay (lineage's rule)
            for c in model.by_storage.get(x, ()):
                if not c.wraps and c.key in model.swap and c.evict_op < b < c.back_op:
                    readers.setdefault(c.key, {}).setdefault(b, []).append(r)
    added = 0
    for k, at in readers.items():
        c = model.cands[k]
        rho = None
        for t in range(min(at), c.back_op):
            if t in at or rho is None:
                nxt = m.new_bool_var(f"restored{k}@{t}")
                for r in at.get(t, ()):
                    m.add(nxt >= r)
                if rho is not None:
                    m.add(nxt >= rho)
                rho = nxt
                added += 1
            a = model.absent.get((k, t))
            if a is not None:
                m.add(a + rho <= 1)
                added += 1
    return added


def _replay_memory(model, problem: Problem, mutant: str = "") -> int:
    """Note [Replays take memory]: while op ``j`` is replayed before op ``b``, its outputs and
    scratch and every storage it reads are on the device, with everything resident before op
    ``b`` that no decision can have taken off it. One row per such ``b``: ``before_b - off_b +
    M_b <= budget``, and per replayed ``j`` a row ``M_b >= (what j adds) R[b, j]`` (Note).
    ``mutant`` (tests only: the cut made stronger than the simulator allows): "op" counts op
    ``b``'s own outputs and scratch as resident then, "back" takes a storage due back at ``b`` as
    restored before the replays."""
    import bisect

    m, st = model.m, problem.storages
    budget = model.budget_bytes
    if len(model.pre) != problem.n_ops:  # pragma: no cover - the bound's model is op-level
        return 0
    by_back: dict[int, list[tuple[int, object]]] = {}
    for (b, j), r in model.R.items():
        by_back.setdefault(b, []).append((j, r))
    live = problem.live_bytes
    evictable = [
        s
        for s in st.values()
        if s.size_bytes > 0
        and s.swappable
        and (s.evictable or problem.persistent_candidates)
        and (s.accesses or s.wrap is not None)
    ]
    added = 0
    for b, rs in sorted(by_back.items()):
        op_b = problem.ops[b]
        before = int(live[b])
        if mutant != "op":
            before -= op_b.scratch_bytes + sum(st[x].size_bytes for x in op_b.allocs)
        fixed = 0  # bytes of storages a decision the model has no variable for may take off
        off: dict[str, list] = {}  # storage -> its literals, one of them 1 when it may be off
        for s in evictable:
            a = s.accesses
            i = bisect.bisect_left(a, b)
            if mutant == "back" and (b in a[i : i + 1] or s.wrap is not None and b == s.wrap[1]):
                continue
            gap = None
            if 0 < i < len(a):
                gap = (a[i - 1], False)
            elif s.wrap is not None and (b > s.wrap[0] or b <= s.wrap[1]):
                gap = (s.wrap[0], True)
            if gap is None:
                continue
            k = (s.storage_id, gap[0])
            c = model.cands.get(k)
            if c is None or c.wraps != gap[1]:
                off[s.storage_id] = []
                fixed += s.size_bytes
                continue
            lits = off[s.storage_id] = []
            if k in model.drop:
                lits.append(model.drop[k])
            if k in model.swap:
                lits.append(model.swap[k] if c.wraps else _off_before(model, k, b))
        base = before - fixed - budget
        rows = []
        for j, r in rs:
            op = problem.ops[j]
            add = sum(st[x].size_bytes for x in op.allocs) + op.scratch_bytes
            back = []  # (size, literals): read by j, so on the device whatever its literals say
            for x in dict.fromkeys(op.inputs):
                xs = st[x]
                if not xs.source_at(j, b):
                    add += xs.size_bytes  # regenerated by the replay: a copy of its own
                elif x in off:
                    if off[x]:
                        back.append((xs.size_bytes, off[x]))
                    else:
                        add += xs.size_bytes  # counted off above, on the device here
            if base + add + sum(n for n, _l in back) > 0:
                rows.append((add, back, r))
        if not rows:
            continue
        terms = [(st[x].size_bytes, v) for x, lits in off.items() for v in lits]
        big = max(add + sum(n for n, _l in back) for add, back, _r in rows)
        mb = m.new_int_var(0, big, f"replaymem{b}")
        for add, back, r in rows:
            # size * (off + R - 1) <= size * off * R: the bytes of a source counted off above
            m.add(mb >= add * r + sum(n * (sum(lits) + r - 1) for n, lits in back))
        m.add(sum(size * v for size, v in terms) - mb >= base)
        added += 1 + len(rows)
    return added


def _off_before(model, k, b: int):
    """A literal that is 1 when swapped candidate ``k`` is off the device while op ``b``'s
    replays run: its out-copy done by the end of op ``b``'s stage, its in-copy not begun by the
    end of the stage before."""
    got = model.__dict__.setdefault("_off_before", {})
    if (k, b) in got:
        return got[(k, b)]
    m, c = model.m, model.cands[k]
    st = model.stages
    co, ci = model.copy_done[k]
    q = model.q
    x = m.new_bool_var(f"offbefore{k}@{b}")
    m.add(x <= model.swap[k])
    m.add((c.out_ns // q) * x <= co[st.stage_of(b)])
    prev = st.stage_of(b) - 1
    if prev in ci:
        m.add(ci[prev] <= (c.in_ns // q) * (1 - x))
    got[(k, b)] = x
    return x


def _lp_bound(model) -> float | None:
    """A proven lower bound on the optimum of the linear relaxation of ``model``'s time objective
    (ns): the Lagrangian value of the solver's dual solution (Note [A bound from any dual]);
    ``math.inf`` when the relaxation is infeasible, None when no solver gives an answer."""
    lp = _relaxation(model)
    for solver in ("highs", "glop"):
        got = _lp_duals(lp, solver)
        if got is None:
            continue
        if isinstance(got, float):  # math.inf: infeasible
            return got
        return max(0.0, _dual_value(lp, got))
    return None


@dataclass(frozen=True)
class _Relaxation:
    """min ``c @ x`` subject to ``row_lo <= A x <= row_hi``, ``lo <= x <= hi`` (``A`` in
    coordinates ``rows``, ``cols``, ``vals``, sorted by row, one entry per row and column);
    infinite row sides are ``inf``."""

    c: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    vals: np.ndarray
    row_lo: np.ndarray
    row_hi: np.ndarray


def _relaxation(model) -> _Relaxation:
    """``model``'s CP-SAT proto as an LP: every variable continuous over its domain's hull, every
    constraint a row over its domain's hull, negated literals ``1 - x`` folded into the sides."""
    proto = model.m.proto
    nv = len(proto.variables)
    lo = np.empty(nv)
    hi = np.empty(nv)
    for i, v in enumerate(proto.variables):
        dom = list(v.domain)  # (a protobuf repeated field takes no negative index)
        lo[i], hi[i] = dom[0], dom[-1]
    refs: list[int] = []
    coefs: list[int] = []
    lens: list[int] = []
    dlo: list[int] = []
    dhi: list[int] = []
    for ct in proto.constraints:
        if not ct.has_linear() or len(ct.enforcement_literal):
            raise CapuchinError(
                "lower_bound: the model has a constraint that is not plain "
                "linear (no LP relaxation here)"
            )
        lin = ct.linear
        refs += lin.vars
        coefs += lin.coeffs
        lens.append(len(lin.vars))
        dom = list(lin.domain)  # (a split domain relaxes to its hull)
        dlo.append(dom[0])
        dhi.append(dom[-1])
    nr = len(lens)
    ref = np.asarray(refs, dtype=np.int64)
    coef = np.asarray(coefs, dtype=np.float64)
    rid = np.repeat(np.arange(nr, dtype=np.int64), lens)
    neg = ref < 0  # a negated literal: coef * (1 - x)
    const = np.bincount(rid[neg], weights=coef[neg], minlength=nr)
    var = np.where(neg, -ref - 1, ref)
    coef = np.where(neg, -coef, coef)
    key, at = np.unique(rid * nv + var, return_inverse=True)  # merge repeated terms
    vals = np.bincount(at, weights=coef)
    nz = vals != 0
    key, vals = key[nz], vals[nz]
    big = float(2**62)
    dlo_a = np.asarray(dlo, dtype=np.float64)
    dhi_a = np.asarray(dhi, dtype=np.float64)
    c = np.zeros(nv)
    for (_b, j), v in model.R.items():
        c[v.Index()] += model.problem.ops[j].duration_ns
    for v in model.stall.values():
        c[v.Index()] += model.q
    return _Relaxation(
        c,
        lo,
        hi,
        key // nv,
        key % nv,
        vals,
        np.where(dlo_a <= -big, -np.inf, dlo_a - const),
        np.where(dhi_a >= big, np.inf, dhi_a - const),
    )


def _lp_duals(lp: _Relaxation, solver: str):
    """Row duals of ``lp`` from ``solver`` (MathOpt: "highs", its interior point without
    crossover; "glop", simplex): an array, ``math.inf`` when the solver proves the LP infeasible,
    None when it gives no dual solution (or is not in this OR-Tools)."""
    try:
        from ortools.math_opt import (
            callback_pb2,
            model_parameters_pb2,
            model_pb2,
            parameters_pb2,
            result_pb2,
        )
        from ortools.math_opt.core.python import solver as mo
    except ImportError:  # pragma: no cover - depends on the OR-Tools version
        return None
    nv, nr = len(lp.c), len(lp.row_lo)
    mp = model_pb2.ModelProto()
    mp.variables.ids.extend(range(nv))
    mp.variables.lower_bounds.extend(lp.lo.tolist())
    mp.variables.upper_bounds.extend(lp.hi.tolist())
    mp.variables.integers.extend([False] * nv)
    nz = np.nonzero(lp.c)[0]
    mp.objective.linear_coefficients.ids.extend(nz.tolist())
    mp.objective.linear_coefficients.values.extend(lp.c[nz].tolist())
    mp.linear_constraints.ids.extend(range(nr))
    mp.linear_constraints.lower_bounds.extend(lp.row_lo.tolist())
    mp.linear_constraints.upper_bounds.extend(lp.row_hi.tolist())
    mp.linear_constraint_matrix.row_ids.extend(lp.rows.tolist())
    mp.linear_constraint_matrix.column_ids.extend(lp.cols.tolist())
    mp.linear_constraint_matrix.coefficients.extend(lp.vals.tolist())
    params = parameters_pb2.SolveParametersProto()
    if solver == "highs":
        kind = parameters_pb2.SOLVER_TYPE_HIGHS
        params.lp_algorithm = parameters_pb2.LP_ALGORITHM_BARRIER
        params.highs.string_options["run_crossover"] = "off"  # the duals need no basis
    else:
        kind = parameters_pb2.SOLVER_TYPE_GLOP
        params.threads = 1
    try:
        res = mo.solve(
            mp,
            kind,
            parameters_pb2.SolverInitializerProto(),
            params,
            model_parameters_pb2.ModelSolveParametersProto(),
            None,
            callback_pb2.CallbackRegistrationProto(),
            None,
            None,
        )
    except Exception:  # pragma: no cover - a solver missing from this build, or failing
        return None
    if res.termination.reason == result_pb2.TERMINATION_REASON_INFEASIBLE:
        return math.inf
    for sol in res.solutions:
        if sol.HasField("dual_solution"):
            y = np.zeros(nr)
            dv = sol.dual_solution.dual_values
            y[np.asarray(dv.ids, dtype=np.int64)] = dv.values
            return y
    return None


def _dual_value(lp: _Relaxation, y: np.ndarray) -> float:
    """The Lagrangian bound of ``lp`` at row multipliers ``y``, rounded down past its
    floating-point error (Note [A bound from any dual])."""
    y = np.where((y > 0) & np.isneginf(lp.row_lo), 0.0, y)  # a side that is not there
    y = np.where((y < 0) & np.isposinf(lp.row_hi), 0.0, y)
    side = np.where(y > 0, lp.row_lo, np.where(y < 0, lp.row_hi, 0.0))
    row_terms = np.where(y != 0, y * np.where(np.isfinite(side), side, 0.0), 0.0)
    ay = lp.vals * y[lp.rows]
    nv = len(lp.c)
    d = lp.c - np.bincount(lp.cols, weights=ay, minlength=nv)  # reduced costs
    var_terms = np.where(d > 0, d * lp.lo, np.where(d < 0, d * lp.hi, 0.0))
    # floating-point error: a reduced cost is off by at most (k + 2) ulps of its terms' magnitude
    # (k products summed in turn, k the longest column, then c), which times |lo| or |hi| bounds
    # its term's error (a sign flipped near 0 included); each product adds 1 ulp; the totals are
    # summed exactly (fsum). gamma is taken well above that, and the error counted twice.
    k = int(np.bincount(lp.cols, minlength=nv).max(initial=0))
    gamma = (k + 256 + 2 * math.log2(max(2, len(ay)))) * 2.0**-53
    mag_d = np.abs(lp.c) + np.bincount(lp.cols, weights=np.abs(ay), minlength=nv)
    err = gamma * (
        np.abs(row_terms).sum()
        + np.abs(var_terms).sum()
        + (mag_d * np.maximum(np.abs(lp.lo), np.abs(lp.hi))).sum()
    )
    return float(math.fsum(row_terms.tolist()) + math.fsum(var_terms.tolist()) - 2 * err - 1.0)
