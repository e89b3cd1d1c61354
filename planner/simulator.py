"""The simulator: the single judge of every plan. Replays one iteration under a list of decisions.

``simulate(problem, decisions)`` checks the plan's invariants (raising ``PlanError`` naming the
decision and the broken rule) and returns a ``SimResult``: the memory curve, the predicted peak,
the predicted iteration time and overhead, and per decision its stall or recompute time. It is
independent of the policy that made the decisions; every policy's output goes through it.
What it models is Note [Simulation model]; how it runs fast, Note [Only the ops of decisions].

# Note: [Simulation model]
# - One compute stream runs the ops in order, back to back (Note [Baseline timeline]).
# - One copy channel per direction; transfers in one direction run one at a time, in issue order
#   (pinned copies occupy a PCIe direction fully, paper §4.4). Copy time = bytes / bandwidth.
# - EVICT_SWAP after the evicted-access: the device->host copy starts when the op ends (or when
#   the channel frees up); device memory is freed when the copy completes, decoupled from
#   compute (paper §5.3).
# - PREFETCH before the in-trigger op: the host->device copy starts at that moment (or when the
#   channel frees up, or when the swap-out is done); device memory is taken when it starts.
# - RESTORE before the back-access: compute waits for the copy (a stall); without a prefetch the
#   copy starts right then (on demand).
# - EVICT_DROP after the evicted-access frees at once. RECOMPUTE before the back-access replays
#   ``replay_ops`` on the compute stream (adding their durations) with their outputs allocated;
#   intermediates are freed after their last use in the replay, except the target and the
#   ``keep`` storages that are out (collective recomputation, paper §5.3), which stay resident.
# - An op's scratch memory (``OpInfo.scratch_bytes``) is taken while it runs, replays included.
# - Sources a replay reads that are swapped out are restored on demand (the runtime does the
#   same); sources that are dead, dropped, or written since the replayed op read them are errors.
# - Memory events at the same instant apply frees first.
# - A wrap-around swap (``Decision.wraps``, problem.py Note [Wrap-around gaps]) is evicted after
#   ``evict_op`` as any swap and comes back before ``back_op`` of the *next* iteration: in the
#   simulated iteration it is out from the start until its prefetch (or on-demand restore) and
#   from its swap-out to the end. Its prefetch runs at ``trigger_op`` of the next iteration when
#   ``trigger_op <= back_op``, else late in this one (then it is resident at the start).
# - A dead decision (``Decision.dead``, dead.py Note [Dead storages]) swaps out after its
#   ``evict_op`` as any swap and never comes back; at its ``back_op`` (where the script frees
#   the storage) the op's own free finds it out already, and compute waits there for its
#   swap-out if still copying.
# - The runtime's host work that runs on the compute stream (``Problem.host``; on CPU, zero on
#   CUDA: costs.py Note [Host work on the compute stream]) is charged there: ``action_op_ns``
#   before each op with an action, ``swap_ns`` after each swap-out's evicted-access (before its
#   copy starts) and at each swap-in's start, ``replay_op_ns`` per replayed op, ``drop_ns`` after
#   each recompute decision's drop.
#
# Note: [Only the ops of decisions]
# The pass visits only the ops where a decision evicts, prefetches or brings back. Every other
# op starts at its baseline start plus the host time of the action ops up to it (a cumulative
# sum) plus the stall, replay and host time the visited ops before it added; its own memory
# events (its start mark, its allocations and scratch, its frees) come from per-problem arrays
# (``_Ops``) and are timed in bulk from the per-op start, allocation and end times. The visited
# ops' own events (replays, drops) are merged with those by order key (5 * op + phase: 0 the
# mark, 1 the replays, 2 the op's allocations, 3 its frees, 4 the drops), which is program
# order; the copies' events come in issue order, and ``_curve`` puts each at its time. Nothing
# is built for reports during a search: the storage ids of the memory events and the spans are
# made on first use of ``SimResult.memory``/``.spans`` by the same pass with ``detail``, from
# the same input carry. Without the static checks (``check=False``) the pass visits every op,
# to find an op that accesses a storage while it is out (which the static checks rule out).
# ``tests/oracle_simulator.py`` is the model written as one loop over every op, the oracle that
# ``tests/test_simulator_fast.py`` holds this pass equal to, field by field.
#
# Note: [Steady state across iterations]
# The simulated iteration is one of a steady run, so what a wrap-around swap leaves running at
# the end carries into the start: a swap-out still copying holds its memory until the copy ends
# (and the swap-in waits for it), a prefetch still copying makes its back-access wait. The
# simulation is repeated with the carry of the previous pass (at most 4 passes; it settles in 2
# when the plan's time does not change the carry).
#
# Note: [Swap-out memory and delayed synchronization]
# The simulator takes no budget and compute never waits for a swap-out. A storage being swapped
# out stays in device memory from its evicted-access until its device->host copy completes, at
# out_end_ns = max(end of the evicted-access op, d2h channel free) + size / d2h bandwidth
# (``DecisionOutcome.out_end_ns`` = ``freed_ns``); every allocation made meanwhile simply adds to
# the curve. So a plan whose peak is over the budget only because swap-outs are still in flight
# is reported over budget (the builder marks it infeasible), with no stall charged.
# The paper's runtime (§5.3, reference/capuchin.md §1.9) would instead, when an allocation does
# not fit, synchronize the earliest unfinished swap-out (compute stalls until its out_end_ns) and
# free it, repeating while swap-outs are pending: the same plan fits there, at the cost of that
# stall. The simulator does not model this wait on purpose: its result would depend on the
# budget (today one plan has one curve and one time, which the policies, the ILP and
# ``smallest_feasible_budget`` rely on), and a policy should not lean on it anyway (Capuchin
# hides a swap only when its free time covers both copies). The judgement is conservative:
# a plan it calls feasible needs no delayed synchronization; one it calls over budget might run
# under a Capuchin runtime with stalls. To see whether in-flight swap-outs explain an excess,
# compare the peak time with the decisions' ``out_end_ns``.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pandas as pd

from ..errors import PlanError, PlanFormatError
from ..tracer.schema import scratch_id
from .plan import Decision, Method, Plan, decision_window, overlapping
from .problem import Problem


@dataclass(frozen=True)
class DecisionOutcome:
    """What the simulation says about one decision (times in ns from iteration start; -1 = did
    not happen)."""

    storage_id: str
    method: Method
    stall_ns: int = 0  # swap: compute waited at the back-access (or for a source restore)
    recompute_ns: int = 0  # recompute: replay time added to the compute stream
    out_start_ns: int = -1
    out_end_ns: int = -1  # swap-out complete: memory freed
    in_start_ns: int = -1  # swap-in start: memory taken
    in_end_ns: int = -1
    freed_ns: int = -1  # when device memory was released
    back_ns: int = -1  # when it was resident again (before its back-access ran)


@dataclass(frozen=True, eq=False)
class SimResult:
    """A simulated iteration. ``memory``: one row per memory event (time_ns, live_bytes,
    op_index, delta_bytes, what, storage_id); ``op_peak_bytes``/``op_start_ns``/``op_end_ns``:
    per op; ``spans``: what ran when on each stream (compute, d2h, h2d), for reports."""

    peak_bytes: int
    peak_op: int
    peak_time_ns: int
    time_ns: int
    baseline_time_ns: int
    baseline_peak_bytes: int
    stall_ns: int  # summed over the decisions
    recompute_ns: int
    op_peak_bytes: np.ndarray = field(repr=False)
    op_start_ns: np.ndarray = field(repr=False)
    op_end_ns: np.ndarray = field(repr=False)
    _carry: dict = field(repr=False)  # Note [Steady state across iterations]
    _decisions: tuple[Decision, ...] = field(repr=False)
    # per decision: stall, replay time and the outcome's six times (lists in the order of
    # ``DecisionOutcome``'s fields; -1: did not happen)
    _per_decision: tuple[list[int], list[int], tuple[list[int], ...]] = field(repr=False)
    # Note [Only the ops of decisions]: the events and spans for reports, made by the same pass
    # with ``detail`` on first use (``_again``: its arguments); most results of a search are
    # judged by their peak and time alone
    _memory: dict | None = field(default=None, repr=False)
    _spans: list | None = field(default=None, repr=False)
    _again: tuple | None = field(default=None, repr=False)

    @cached_property
    def outcomes(self) -> tuple[DecisionOutcome, ...]:
        """One ``DecisionOutcome`` per decision, in the plan's order."""
        stall, recomp, (os_, oe, ins, ine, fr, bk) = self._per_decision
        return tuple(
            DecisionOutcome(
                d.storage_id,
                d.method,
                stall[i],
                recomp[i],
                os_[i],
                oe[i],
                ins[i],
                ine[i],
                fr[i],
                bk[i],
            )
            for i, d in enumerate(self._decisions)
        )

    @cached_property
    def _full(self) -> SimResult:
        if self._memory is not None:
            return self
        problem, bw_out, bw_in, carry = self._again
        return _pass(problem, self._decisions, bw_out, bw_in, carry, detail=True)

    @cached_property
    def memory(self) -> pd.DataFrame:
        """One row per memory event: time_ns, live_bytes, op_index, delta_bytes, what,
        storage_id (what: "op" marks an op's start, then "alloc"/"free")."""
        m = dict(self._full._memory)
        m["what"] = np.array(["free", "alloc", "op"], dtype=object)[m["what"]]
        return pd.DataFrame(m)

    @cached_property
    def spans(self) -> pd.DataFrame:
        """What ran when: stream (compute, d2h, h2d), name, start_ns, end_ns, op_index,
        storage_id."""
        return pd.DataFrame(
            self._full._spans,
            columns=["stream", "name", "start_ns", "end_ns", "op_index", "storage_id"],
        )

    @property
    def overhead(self) -> float:
        """Predicted slowdown as a fraction of the baseline time (0.05 = 5%)."""
        return self.time_ns / self.baseline_time_ns - 1.0 if self.baseline_time_ns > 0 else 0.0

    def outcomes_frame(self) -> pd.DataFrame:
        return pd.DataFrame([{**o.__dict__, "method": o.method.value} for o in self.outcomes])


def check_decisions(problem: Problem, decisions: Sequence[Decision]) -> None:
    """Static invariants of a plan; raises ``PlanError`` on the first broken one."""
    n = problem.n_ops
    per = _ops_of(problem)
    checked = per.checked
    if len(per.checked_objects) > 50_000:
        per.checked_objects = {}
    seen = per.checked_objects
    for d in decisions:
        # every check below depends on the decision and the problem only; a decision object
        # checked before is found by identity, without hashing its fields
        if seen.get(id(d)) is d:
            continue
        if d in checked:
            seen[id(d)] = d
            continue
        s = problem.storages.get(d.storage_id)
        where = f"decision {d.storage_id} ({d.method.value} after op {d.evict_op})"
        if s is None:
            raise PlanError(f"{where}: no such storage in the planned iteration")
        if d.dead:  # Note [Dead storages] in dead.py
            if (
                d.method != Method.SWAP
                or d.wraps
                or d.trigger_op is not None
                or s.dead_gap != (d.evict_op, d.back_op)
                or d.size_bytes != s.size_bytes
            ):
                raise PlanError(
                    f"{where}: a dead decision must be a swap without in-trigger from the "
                    f"storage's last access to the op that frees it, of its size (its dead "
                    f"gap: {s.dead_gap}, {s.size_bytes} B)"
                )
            checked.add(d)
            seen[id(d)] = d
            continue
        if not s.swappable or (not s.evictable and not problem.persistent_candidates):
            raise PlanError(
                f"{where}: storage is not evictable (a view, accessed once, or "
                f"persistent without a swap candidate gap)"
            )
        if not s.evictable and d.method != Method.SWAP:
            raise PlanError(
                f"{where}: storage is persistent ({s.kind.value}): it can only be "
                f"swapped, no op of the iteration produces it"
            )
        if d.size_bytes != s.size_bytes:
            raise PlanError(f"{where}: size {d.size_bytes} B, the storage has {s.size_bytes} B")
        if d.wraps:
            if d.method != Method.SWAP or s.wrap != (d.evict_op, d.back_op):
                raise PlanError(
                    f"{where}: a wrap-around decision must be a swap from the "
                    f"storage's last access to its first (its wrap-around gap: "
                    f"{s.wrap})"
                )
            if (
                d.trigger_op is not None
                and not (0 <= d.trigger_op < n)
                or (d.trigger_op is not None and d.back_op < d.trigger_op <= d.evict_op)
            ):
                raise PlanError(
                    f"{where}: in-trigger op {d.trigger_op} not after op "
                    f"{d.evict_op} nor up to op {d.back_op}"
                )
            checked.add(d)
            seen[id(d)] = d
            continue
        if not (0 <= d.evict_op < d.back_op < n):
            raise PlanError(
                f"{where}: needs 0 <= evict_op < back_op < {n}, got {d.evict_op}, {d.back_op}"
            )
        if d.evict_op not in s.accesses or s.next_access(d.evict_op) != d.back_op:
            raise PlanError(
                f"{where}: evict_op and back_op must be consecutive accesses of the "
                f"storage (its accesses: {list(s.accesses)[:12]}...)"
            )
        if d.method == Method.SWAP:
            if d.trigger_op is not None and not (d.evict_op < d.trigger_op <= d.back_op):
                raise PlanError(
                    f"{where}: in-trigger op {d.trigger_op} not in ({d.evict_op}, {d.back_op}]"
                )
        else:
            _check_replay(problem, d, where)
        checked.add(d)
        seen[id(d)] = d
    dead = {d.storage_id: d.evict_op for d in decisions if d.dead}
    for d in decisions if dead else ():
        x = next((x for x in d.sources if x in dead and d.back_op > dead[x]), None)
        if x is not None:  # a dead storage comes back on demand only, never for a replay
            raise PlanError(
                f"decision {d.storage_id}: source {x} of its replay at op {d.back_op} is "
                f"evicted as dead after op {dead[x]}"
            )
    sids = [d.storage_id for d in decisions]
    if len(set(sids)) == len(sids):
        return
    # Note [Several windows per storage] in plan.py: a window can only overlap another of its
    # storage, so the storages with one decision are left out; each storage's decisions, in
    # plan order, are checked once per problem (a search checks the same ones again and again)
    once: set[str] = set()
    several = {x for x in sids if x in once or once.add(x)}
    groups: dict[str, list[int]] = {}
    for pos, x in enumerate(sids):
        if x in several:
            groups.setdefault(x, []).append(pos)
    windows = per.windows
    if len(windows) > 100_000:
        windows.clear()
    first = None  # (position in the plan, message) of the first decision that overlaps
    for x, where in groups.items():
        key = tuple(decisions[i] for i in where)
        got = windows.get(key, _UNSEEN)
        if got is _UNSEEN:
            got = windows[key] = _first_overlap(key, n)
        if got is not None and (first is None or where[got[0]] < first[0]):
            first = (where[got[0]], f"storage {x}: {got[0] + 1} decisions evict it: {got[1]}")
    if first is not None:
        raise PlanError(first[1])


_UNSEEN = object()


def _first_overlap(ds: tuple[Decision, ...], n: int) -> tuple[int, str] | None:
    """The first of one storage's decisions (in plan order) whose window may not join those
    before it, and why; None when all may."""
    ws: list = []
    for j, d in enumerate(ds):
        w = decision_window(d)
        why = overlapping(w, ws, n)
        if why is not None:
            return j, why
        ws.append(w)
    return None


def _check_replay(problem: Problem, d: Decision, where: str) -> None:
    s = problem.storages[d.storage_id]
    ops = d.replay_ops
    if not ops:
        raise PlanError(f"{where}: recompute decision without replay_ops")
    if list(ops) != sorted(set(ops)) or ops[-1] > d.evict_op:
        raise PlanError(f"{where}: replay_ops must be increasing op indices <= evict_op")
    if s.alloc_op not in ops:
        raise PlanError(f"{where}: replay_ops lack the producer op {s.alloc_op}")
    missing = [w for w in s.writers if s.alloc_op < w <= d.evict_op and w not in ops]
    if missing:
        raise PlanError(f"{where}: replay_ops lack the in-place writes {missing} of the storage")
    made: set[str] = set()
    need: dict[str, int] = {}
    for j in ops:
        op = problem.ops[j]
        for x in op.inputs:
            if x not in made and x not in need:
                need[x] = j
        made.update(op.allocs)
    srcs = set(d.sources)
    if set(need) != srcs:
        raise PlanError(
            f"{where}: sources {sorted(srcs)} but the replayed ops read "
            f"{sorted(need)} from outside the replay"
        )
    for x, j in need.items():
        xs = problem.storages[x]
        if not xs.alive_at(d.back_op):
            raise PlanError(
                f"{where}: source {x} is not alive at the back-access op "
                f"{d.back_op} (allocated after op {xs.alloc_op}, freed after op "
                f"{xs.free_op})"
            )
        if xs.written_between(j, d.back_op):
            raise PlanError(
                f"{where}: source {x} is written in place after replayed op {j} "
                f"read it, before op {d.back_op}"
            )


def simulate(
    problem: Problem,
    decisions: Sequence[Decision],
    *,
    bandwidth_d2h_bytes_per_s: float | None = None,
    bandwidth_h2d_bytes_per_s: float | None = None,
    check: bool = True,
) -> SimResult:
    """Replay ``problem``'s iteration under ``decisions``; see Note [Simulation model].

    Bandwidths default to the problem's (bytes/s). Raises ``PlanError`` when the plan breaks an
    invariant: unknown or non-evictable storage, wrong size, evict/back not consecutive accesses,
    overlapping decisions on one storage, a trigger outside (evict, back], replay ops missing
    the producer or an in-place write, sources not matching what the replay reads, a source not
    alive or written since it was read, or an access to a storage that is out. ``check=False``
    skips the static checks (``check_decisions``); the pass then visits every op to find an
    access to a storage that is out.
    """
    bw_out = float(bandwidth_d2h_bytes_per_s or problem.bandwidth_d2h_bytes_per_s)
    bw_in = float(bandwidth_h2d_bytes_per_s or problem.bandwidth_h2d_bytes_per_s)
    # searches simulate the same plan again and again (and the plan builder the policy's
    # last one): results are remembered per problem, the most recent first, as many as
    # _MEMO_EVENTS op-slots allow (a result's arrays grow with the number of ops)
    key = _Key((tuple(decisions), bw_out, bw_in, check))
    # kept on the problem itself: a result refers to its problem (to make its memory events on
    # first use), so a weak-keyed memo would keep every problem alive; as an attribute the two
    # form a cycle the garbage collector frees
    memo = problem.__dict__.get("_simulation_memo")
    if memo is None:
        memo = OrderedDict()
        object.__setattr__(problem, "_simulation_memo", memo)
    res = memo.get(key)
    if res is not None:
        memo.move_to_end(key)
        return res
    if check:
        check_decisions(problem, decisions)
    res = _steady(problem, tuple(decisions), bw_out, bw_in, _pass, check_access=not check)
    memo[key] = res
    while len(memo) > max(2, _MEMO_EVENTS // max(1, problem.n_ops)):
        memo.popitem(last=False)
    return res


class _Key:
    """A memo key that hashes its decisions once: the memo looks it up and then stores it,
    and a tuple's hash calls every decision's ``__hash__`` (a Python method) each time."""

    __slots__ = ("key", "h")

    def __init__(self, key: tuple) -> None:
        self.key = key
        self.h = hash(key)

    def __hash__(self) -> int:
        return self.h

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and self.h == other.h and self.key == other.key


def _steady(problem, decisions, bw_out, bw_in, one_pass, **kw) -> SimResult:
    """Passes of ``one_pass`` until the carry settles (Note [Steady state across iterations])."""
    res = one_pass(problem, decisions, bw_out, bw_in, **kw)
    prev: dict = {}
    for _ in range(3):
        if all(v == (0, 0) for v in res._carry.values()) and not any(prev.values()):
            break  # nothing carried over: the first pass was the steady state already
        prev = res._carry
        res = one_pass(problem, decisions, bw_out, bw_in, prev, **kw)
        if res._carry == prev:
            break
    return res


def simulate_plan(plan: Plan, trace=None) -> SimResult:
    """Re-simulate a ``Plan`` (``.memory`` of the result is a DataFrame).

    ``trace``: a ``Trace``, a path, or a ``Problem``; default: reload
    ``provenance.trace_path``. Raises ``PlanFormatError`` when the trace's op sequence is not
    the one the plan was made for.
    """
    if isinstance(trace, Problem):
        problem = trace
    else:
        from ..tracer.reader import Trace, load_trace

        if trace is None:
            if not plan.provenance.trace_path:
                raise PlanFormatError("plan has no trace_path; pass the trace to simulate_plan()")
            trace = load_trace(plan.provenance.trace_path)
        elif not isinstance(trace, Trace):
            trace = load_trace(trace)
        problem = Problem.from_trace(trace, iteration=plan.provenance.iteration)
    problem = problem.with_bandwidth(
        plan.provenance.bandwidth_d2h_bytes_per_s, plan.provenance.bandwidth_h2d_bytes_per_s
    )
    if problem.fingerprint() != plan.provenance.trace_fingerprint:
        raise PlanFormatError(
            f"{plan.provenance.trace_path or 'trace'}: op sequence differs from the one the "
            f"plan was made for (fingerprint {problem.fingerprint()} vs "
            f"{plan.provenance.trace_fingerprint})"
        )
    return simulate(problem, plan.decisions)


_MEMO_EVENTS = 200_000
_FREE, _ALLOC, _MARK = 0, 1, 2


class _Ops:
    """Per problem: baseline op times, every op's own memory events in program order, the
    replays' event templates (Note [Only the ops of decisions]) and the decisions checked."""

    def __init__(self, problem: Problem):
        st = problem.storages
        key, opx, where, delta, kind, sids = [], [], [], [], [], []

        def add(k, phase, d, kd, sid):
            key.append(5 * k + phase), opx.append(k), where.append((phase + 1) // 2)
            delta.append(d), kind.append(kd), sids.append(sid)

        for op in problem.ops:
            k = op.index
            add(k, 0, 0, _MARK, "")
            for s in op.allocs:
                add(k, 2, st[s].size_bytes, _ALLOC, s)
            if op.scratch_bytes:
                add(k, 2, op.scratch_bytes, _ALLOC, scratch_id(k))
                add(k, 3, -op.scratch_bytes, _FREE, scratch_id(k))
            for s in op.frees:
                add(k, 3, -st[s].size_bytes, _FREE, s)
        self.dur = np.array([op.duration_ns for op in problem.ops], dtype=np.int64)
        end = np.cumsum(self.dur)
        self.start = end - self.dur
        self.start_l = self.start.tolist()
        self.dur_l = self.dur.tolist()
        self.key = np.array(key, dtype=np.int64)
        self.op = np.array(opx, dtype=np.int64)
        self.where = np.array(where, dtype=np.int64)  # 0: op start, 1: after stalls, 2: op end
        self.delta = np.array(delta, dtype=np.int64)
        self.kind = np.array(kind, dtype=np.int8)
        self.sids = sids  # the events' storage ids (for reports)
        self.time_ns = problem.time_ns
        self.peak_bytes = problem.peak_bytes
        self._sizes = {sid: s.size_bytes for sid, s in st.items()}
        self._copies: dict[tuple[float, float], tuple[dict, dict]] = {}
        self.replays: dict = {}  # (storage, replay ops, keeps out) -> _replay_template
        self.replay_arrays: dict = {}  # the same key -> its times, deltas and kinds as arrays
        self.checked: set[Decision] = set()  # decisions that passed ``check_decisions``
        self.checked_objects: dict[int, Decision] = {}  # id -> such a decision object
        # one storage's decisions in plan order -> the first that overlaps those before it
        self.windows: dict[tuple[Decision, ...], tuple[int, str] | None] = {}

    def copy_ns(self, bw_out: float, bw_in: float) -> tuple[dict, dict]:
        """Per storage, its swap-out and swap-in copy times at these bandwidths (ns, rounded
        to the nearest ns)."""
        got = self._copies.get((bw_out, bw_in))
        if got is None:
            got = self._copies[(bw_out, bw_in)] = (
                {sid: int(round(b / bw_out * 1e9)) for sid, b in self._sizes.items()},
                {sid: int(round(b / bw_in * 1e9)) for sid, b in self._sizes.items()},
            )
        return got


_OPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _ops_of(problem: Problem) -> _Ops:
    got = _OPS.get(problem)
    if got is None:
        got = _OPS[problem] = _Ops(problem)
    return got


def _pass(
    problem: Problem,
    decisions: tuple[Decision, ...],
    bw_out: float,
    bw_in: float,
    carry: dict | None = None,
    *,
    detail: bool = False,
    check_access: bool = False,
) -> SimResult:
    """One pass over the iteration (Note [Simulation model], Note [Only the ops of decisions]).
    ``detail``: also the memory events' storage ids and the spans, for reports.
    ``check_access``: visit every op and raise when one accesses a storage that is out."""
    n = problem.n_ops
    P = _ops_of(problem)
    SWAP, RECOMPUTE = Method.SWAP, Method.RECOMPUTE
    sizes = P._sizes
    evict_at: dict[int, list[int]] = {}
    trig_at: dict[int, list[int]] = {}
    back_at: dict[int, list[int]] = {}
    free_at: dict[int, list[int]] = {}  # dead decisions by the op that frees the storage
    acts: list[int] = []  # costs.action_ops(decisions), with repeats, made in the same loop
    for i, d in enumerate(decisions):
        evict_at.setdefault(d.evict_op, []).append(i)
        acts.append(d.evict_op)
        if d.dead:
            free_at.setdefault(d.back_op, []).append(i)
            continue
        back_at.setdefault(d.back_op, []).append(i)
        acts.append(d.back_op)
        if d.method == SWAP:
            if d.trigger_op is not None:
                acts.append(d.trigger_op)
                if d.trigger_op < d.back_op or (d.wraps and d.trigger_op != d.back_op):
                    trig_at.setdefault(d.trigger_op, []).append(i)
        else:
            acts.extend(d.replay_ops)
    for lst in trig_at.values():
        lst.sort(key=lambda i: (decisions[i].back_op, i))

    # dynamic compute events (replays at phase 1, drops at phase 4), as chunks in program
    # order: key, start time, (times from the start, deltas, kinds), and with ``detail`` their
    # storage ids
    dk: list[int] = []
    dt: list[int] = []
    dev: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    dsid: list[tuple[str, ...]] = []
    # asynchronous events (copy start / copy end), in issue order
    at: list[int] = []
    ad: list[int] = []
    ak: list[int] = []
    asid: list[str] = []
    # with ``detail``: (op, phase, span) of what the visited ops add (phase 1 before the op,
    # 3 after it); the ops' own spans are added at the end (0: host work, 2: the op)
    spans: list[tuple[int, int, tuple]] = []

    state: dict[str, str] = {}  # storage -> "out" | "swapping_in" | "in" (only decided ones)
    away: set[str] = set()  # the storages whose state is "out" or "swapping_in"
    active: dict[str, int] = {}  # storage -> index of the decision currently evicting it
    out_end: dict[str, int] = {}
    in_end: dict[str, int] = {}
    m_ = len(decisions)
    stall = [0] * m_
    recomp = [0] * m_
    # per decision, its outcome's times (-1: did not happen)
    os_, oe, ins, ine, fr, bk = ([-1] * m_ for _ in range(6))
    h2d_free = 0
    d2h_free = 0
    resident = problem.resident_bytes
    carry = carry or {}
    for i, d in enumerate(decisions):  # Note [Steady state across iterations]
        if not d.wraps:
            continue
        sid = d.storage_id
        active[sid] = i
        away.add(sid)
        c_out, c_in = carry.get(sid, (0, 0))
        if d.trigger_op is not None and d.trigger_op > d.evict_op:
            state[sid] = "swapping_in"  # prefetched late in the previous iteration
            in_end[sid] = c_in
            h2d_free = max(h2d_free, c_in)
        else:
            state[sid] = "out"
            out_end[sid] = c_out
            d2h_free = max(d2h_free, c_out)
            if c_out > 0:  # its swap-out from the previous iteration is still running
                at.append(c_out), ad.append(-d.size_bytes), ak.append(_FREE), asid.append(sid)
            else:
                resident -= d.size_bytes

    host = problem.host  # Note [Simulation model]: the runtime's host work on compute
    swap_ns, replay_op_ns, drop_ns = host.swap_ns, host.replay_op_ns, host.drop_ns
    visit = range(n) if check_access else sorted({*evict_at, *back_at, *trig_at, *free_at})
    vis = np.arange(n) if check_access else np.array(visit, dtype=np.int64)
    if host.action_op_ns:
        A = np.zeros(n, dtype=np.int64)
        a = np.array(acts, dtype=np.int64)
        A[a[(a >= 0) & (a < n)]] = host.action_op_ns
        cA = np.cumsum(A)  # host time of the action ops up to and including op k
        host_before = int(cA[-1]) if n else 0
        base = (P.start[vis] + cA[vis]).tolist()  # each visited op's start, but for the delays
    else:
        A = None
        host_before = 0
        base = P.start[vis].tolist()
    dur_l = P.dur_l
    replays, replay_arrays = P.replays, P.replay_arrays
    D: dict[int, int] = {}  # visited op -> time added between its start and its allocations
    E: dict[int, int] = {}  # visited op -> time added after it ends (swap-out calls)
    shift = 0
    t = 0
    out_ns, in_ns = P.copy_ns(bw_out, bw_in)  # storage -> copy time

    def swap_in(i: int, sid: str, k: int) -> None:
        """Start decision i's swap-in of ``sid`` at time t (after the host call)."""
        nonlocal t, h2d_free
        if swap_ns:
            if detail:
                spans.append((k, 1, ("compute", f"swap-in call {sid}", t, t + swap_ns, -1, sid)))
            t += swap_ns
        begin = max(t, h2d_free, out_end.get(sid, 0))
        end = begin + in_ns[sid]
        h2d_free = end
        at.append(begin), ad.append(sizes[sid]), ak.append(_ALLOC), asid.append(sid)
        in_end[sid] = end
        state[sid] = "swapping_in"
        ins[i], ine[i] = begin, end
        if detail:
            spans.append((k, 1, ("h2d", f"swap-in {sid}", begin, end, -1, sid)))

    trig_get, back_get, evict_get, free_get = trig_at.get, back_at.get, evict_at.get, free_at.get
    for k, b in zip(visit, base, strict=True):
        t = t0 = b + shift
        for i in trig_get(k, ()):
            sid = decisions[i].storage_id
            if state.get(sid) == "out" and active.get(sid) == i:
                swap_in(i, sid, k)
        for i in back_get(k, ()):
            d = decisions[i]
            sid = d.storage_id
            if active.get(sid) != i:
                raise PlanError(f"decision {sid}: back-access op {k} but it was never evicted")
            if d.method == SWAP:
                restore = (sid,)
            elif state.get(sid) != "in":  # not kept by an earlier collective recomputation
                restore = []
                for x in d.sources if not away.isdisjoint(d.sources) else ():
                    if x in away:
                        if decisions[active[x]].method != SWAP:
                            raise PlanError(f"decision {sid}: source {x} is dropped at op {k}")
                        restore.append(x)
            else:
                restore = ()
            for x in restore:  # made resident before op k, waiting if needed; charged to i
                j = active[x]
                if state.get(x) == "out":
                    swap_in(j, x, k)
                if state.get(x) == "swapping_in":
                    wait = in_end[x] - t
                    if wait > 0:
                        if detail:
                            spans.append((k, 1, ("compute", f"stall {x}", t, t + wait, k, x)))
                        stall[i] += wait
                        t += wait
                    state[x] = "in"
                    away.discard(x)
                    bk[j] = t
            if d.method != SWAP and state.get(sid) != "in":
                t1 = t
                # the keeps that are out come back with the replay (collective recomputation);
                # the replay's events depend only on them: one template per such set
                keep = tuple(
                    sorted(
                        x
                        for x in d.keep
                        if state.get(x) == "out"
                        and x in active
                        and decisions[active[x]].method == RECOMPUTE
                    )
                )
                rkey = (d.storage_id, d.replay_ops, keep)
                tpl = replays.get(rkey)
                if tpl is None:
                    tpl = replays[rkey] = _replay_template(problem, d, set(keep))
                dts, deltas, kinds, sids, dur = tpl
                if dts:
                    arr = replay_arrays.get(rkey)
                    if arr is None:
                        arr = replay_arrays[rkey] = (
                            np.asarray(dts, dtype=np.int64),
                            np.asarray(deltas, dtype=np.int64),
                            np.asarray(kinds, dtype=np.int8),
                        )
                    dk.append(5 * k + 1), dt.append(t), dev.append(arr)
                    if detail:
                        dsid.append(sids)
                for x in keep:  # back early: its own RECOMPUTE will find it resident
                    state[x] = "in"
                    away.discard(x)
                if detail:
                    spans.append((k, 1, ("compute", f"recompute {sid}", t, t + dur, k, sid)))
                t += dur
                t += len(d.replay_ops) * replay_op_ns
                recomp[i] = t - t1
                bk[i] = t
            state[sid] = "in"
            away.discard(sid)
            del active[sid]
        if check_access and active:
            x = next((x for x in problem.ops[k].accessed if x in active), None)
            if x is not None:
                d = decisions[active[x]]
                raise PlanError(
                    f"op {k} ({problem.ops[k].name}) accesses storage {x}, which the plan "
                    f"evicted after op {d.evict_op} and brings back at op {d.back_op}"
                )
        if t != t0:
            D[k] = t - t0
        t += dur_l[k]
        t_end = t
        for i in evict_get(k, ()):
            d = decisions[i]
            sid = d.storage_id
            active[sid] = i
            state[sid] = "out"
            away.add(sid)
            if d.method == SWAP:
                if swap_ns:
                    if detail:
                        spans.append(
                            (k, 3, ("compute", f"swap-out call {sid}", t, t + swap_ns, k, sid))
                        )
                    t += swap_ns
                begin = max(t, d2h_free)
                end = begin + out_ns[sid]
                d2h_free = end
                out_end[sid] = end
                at.append(end), ad.append(-d.size_bytes), ak.append(_FREE), asid.append(sid)
                os_[i], oe[i], fr[i] = begin, end, end
                if detail:
                    spans.append((k, 3, ("d2h", f"swap-out {sid}", begin, end, -1, sid)))
            else:
                dk.append(5 * k + 4), dt.append(t), dev.append(_drop_event(d.size_bytes))
                if detail:
                    dsid.append((sid,))
                fr[i] = t
                if drop_ns:
                    if detail:
                        spans.append(
                            (k, 3, ("compute", f"drop call {sid}", t, t + drop_ns, k, sid))
                        )
                    t += drop_ns
        for i in free_get(k, ()):  # Note [Dead storages] in dead.py
            d = decisions[i]
            sid = d.storage_id
            # the op's own free of the storage (in the problem) finds it out already
            dk.append(5 * k + 4), dt.append(t), dev.append(_undo_free_event(d.size_bytes))
            if detail:
                dsid.append((sid,))
            wait = out_end[sid] - t  # freeing it waits for its swap-out
            if wait > 0:
                if detail:
                    spans.append((k, 3, ("compute", f"stall {sid}", t, t + wait, k, sid)))
                stall[i] += wait
                t += wait
            state.pop(sid, None)
            away.discard(sid)
            del active[sid]
        if t != t_end:
            E[k] = t - t_end
        shift += t - t0 - dur_l[k]
    # the time after the last op: its baseline end plus every delay before it
    t = (int(P.start[-1] + P.dur[-1]) + host_before + shift) if n else 0
    left = [sid for sid, i in active.items() if not decisions[i].wraps]
    if left:
        raise PlanError(f"decision {left[0]}: still evicted at the end of the iteration")
    new_carry = {}
    for d in decisions:
        if d.wraps:
            sid = d.storage_id
            new_carry[sid] = (
                max(0, out_end.get(sid, 0) - t),
                max(0, in_end.get(sid, 0) - t)
                if d.trigger_op is not None and d.trigger_op > d.evict_op
                else 0,
            )

    # every op's start, allocation and end time
    Dv = np.zeros(n, dtype=np.int64)
    Ev = np.zeros(n, dtype=np.int64)
    if D:
        Dv[list(D)] = list(D.values())
    if E:
        Ev[list(E)] = list(E.values())
    tot = Dv + Ev
    if A is not None:
        tot += A
    excl = np.cumsum(tot) - tot
    op_start = P.start + excl
    if A is not None:
        op_start += A
    alloc_t = op_start + Dv
    op_end = alloc_t + P.dur

    # the compute stream's events: each op's own, timed, merged with the dynamic ones by key
    times = np.stack([op_start, alloc_t, op_end])[P.where, P.op]
    idx = None
    if dk:
        m = len(P.key)
        lens = np.fromiter((len(e[0]) for e in dev), dtype=np.int64, count=len(dev))
        dk_a = np.repeat(np.asarray(dk, dtype=np.int64), lens)
        dt_a = np.concatenate([e[0] for e in dev]) + np.repeat(np.asarray(dt, dtype=np.int64), lens)
        pos = np.searchsorted(P.key, dk_a, side="right")
        idx = np.insert(np.arange(m), pos, m + np.arange(len(dk_a)))
        ct_a = np.concatenate([times, dt_a])[idx]
        cd_a = np.concatenate([P.delta, *(e[1] for e in dev)])[idx]
        ck_a = np.concatenate([P.kind, *(e[2] for e in dev)])[idx]
    else:
        ct_a, cd_a, ck_a = times, P.delta, P.kind
    live, time, op_of, delta, kind, order = _curve(ct_a, cd_a, ck_a, at, ad, ak, resident)
    op_peak = np.zeros(n, dtype=np.int64)
    if len(live):
        np.maximum.at(op_peak, op_of, live)
        j = int(live.argmax())
        peak, peak_t, peak_op = int(live[j]), int(time[j]), int(op_of[j])
    else:
        peak, peak_t, peak_op = problem.resident_bytes, 0, -1

    memory = report_spans = None
    if detail:
        csid = np.asarray(P.sids + [s for c in dsid for s in c], dtype=object)
        if idx is not None:
            csid = csid[idx]
        sid_all = np.concatenate([csid, np.asarray(asid, dtype=object)])
        memory = {
            "time_ns": time,
            "live_bytes": live,
            "op_index": op_of,
            "delta_bytes": delta,
            "what": kind,
            "storage_id": sid_all if order is None else sid_all[order],
        }
        for k, op in enumerate(problem.ops):
            if A is not None and A[k]:
                a = int(op_start[k])
                spans.append((k, 0, ("compute", "slow path", a - int(A[k]), a, k, "")))
            if op.duration_ns:
                span = ("compute", op.name, int(alloc_t[k]), int(op_end[k]), k, "")
                spans.append((k, 2, span))
        spans.sort(key=lambda s: (s[0], s[1]))  # stable: a visited op's spans in their order
        report_spans = [s for _, _, s in spans]
    return SimResult(
        peak,
        peak_op,
        peak_t,
        int(t),
        P.time_ns,
        P.peak_bytes,
        sum(stall),
        sum(recomp),
        op_peak,
        op_start,
        op_end,
        new_carry,
        decisions,
        (stall, recomp, (os_, oe, ins, ine, fr, bk)),
        memory,
        report_spans,
        (problem, bw_out, bw_in, carry or None),
    )


def _replay_template(problem, d: Decision, keep: set):
    """The memory events of ``d``'s replay as (times from its start, deltas, kinds, storage
    ids, duration): its ops' outputs allocated, intermediates freed after their last use in
    the replay, except the target and the ``keep`` storages, which stay resident."""
    ops = problem.ops
    st = problem.storages
    last_use: dict[str, int] = {}
    for pos, j in enumerate(d.replay_ops):
        for x in ops[j].inputs:
            last_use[x] = pos
    # each intermediate is freed after the op of its last use, or of its allocation if later;
    # at one op, in the order of allocation
    frees: dict[int, list[tuple[str, int]]] = {}
    ct, cd, ck, csid = [], [], [], []
    t = 0
    for pos, j in enumerate(d.replay_ops):
        op = ops[j]
        for s in op.allocs:
            size = st[s].size_bytes
            if not (s == d.storage_id or s in keep):
                frees.setdefault(max(pos, last_use.get(s, -1)), []).append((s, size))
            ct.append(t), cd.append(size), ck.append(_ALLOC), csid.append(s)
        if op.scratch_bytes:
            ct.append(t), cd.append(op.scratch_bytes), ck.append(_ALLOC), csid.append(scratch_id(j))
        t += op.duration_ns
        if op.scratch_bytes:
            ct.append(t), cd.append(-op.scratch_bytes), ck.append(_FREE), csid.append(scratch_id(j))
        for s, size in frees.pop(pos, ()):
            ct.append(t), cd.append(-size), ck.append(_FREE), csid.append(s)
    return tuple(ct), tuple(cd), tuple(ck), tuple(csid), t


@functools.lru_cache(maxsize=4096)
def _drop_event(size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A dropped storage's one event, as a chunk of the pass's dynamic events."""
    return (
        np.zeros(1, dtype=np.int64),
        np.full(1, -size, dtype=np.int64),
        np.full(1, _FREE, dtype=np.int8),
    )


@functools.lru_cache(maxsize=4096)
def _undo_free_event(size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A dead storage's event where the script frees it: its bytes back, as its swap-out
    already freed them (Note [Dead storages] in dead.py)."""
    return (
        np.zeros(1, dtype=np.int64),
        np.full(1, size, dtype=np.int64),
        np.full(1, _ALLOC, dtype=np.int8),
    )


def _curve(ct_a, cd_a, ck_a, at, ad, ak, resident):
    """The memory curve from the compute stream's events (program order) and the copies'
    (issue order): live bytes, time, op, delta and kind of every event in time order, and the
    order that sorted them (None: no copies, program order). Each copy event goes at its time
    among the compute events; see Note [Simulation model] for ties (frees first)."""
    at_a = np.asarray(at, dtype=np.int64)
    ak_a = np.asarray(ak, dtype=np.int8)
    order = None
    if len(at_a):
        pos = np.where(
            ak_a == _FREE,
            np.searchsorted(ct_a, at_a, side="left"),
            np.searchsorted(ct_a, at_a, side="right"),
        )
        key = np.concatenate([2 * np.arange(len(ct_a)) + 1, 2 * pos])
        tie = np.concatenate([np.zeros(len(ct_a), dtype=np.int64), at_a])
        order = np.lexsort((tie, key))
        time = np.concatenate([ct_a, at_a])[order]
        delta = np.concatenate([cd_a, np.asarray(ad, dtype=np.int64)])[order]
        kind = np.concatenate([ck_a, ak_a])[order]
    else:
        time, delta, kind = ct_a, cd_a, ck_a
    live = resident + np.cumsum(delta)
    op_of = np.cumsum(kind == _MARK) - 1  # op of each event: the last op start at or before it
    if len(op_of) and op_of[0] < 0:  # copies cannot come before op 0 (they follow ops)
        op_of = np.maximum(op_of, 0)
    return live, time, op_of, delta, kind, order
