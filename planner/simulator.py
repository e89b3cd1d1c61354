"""The simulator: the single judge of every plan. Replays one iteration under a list of decisions.

``simulate(problem, decisions)`` checks the plan's invariants (raising ``PlanError`` naming the
decision and the broken rule) and returns a ``SimResult``: the memory curve, the predicted peak,
the predicted iteration time and overhead, and per decision its stall or recompute time. It is
independent of the policy that made the decisions; every policy's output goes through it.
``_simulate`` below is the reference pass, the definition of the model; ``simulate`` runs the
fast pass of simfast.py on checked plans, equal to it field by field (simfast.py Note [The fast
pass]).

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
# - The runtime's host work that runs on the compute stream (``Problem.host``; on CPU, zero on
#   CUDA: costs.py Note [Host work on the compute stream]) is charged there: ``action_op_ns``
#   before each op with an action, ``swap_ns`` after each swap-out's evicted-access (before its
#   copy starts) and at each swap-in's start, ``replay_op_ns`` per replayed op.
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

import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pandas as pd

from ..errors import PlanError, PlanFormatError
from ..tracer.schema import scratch_id
from .costs import action_ops
from .plan import Decision, Method, Plan
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
    # the outcomes, or a function that makes them: the fast pass leaves them to first use, as
    # most of the plans a search simulates are judged by their peak and time alone
    _outcomes: tuple[DecisionOutcome, ...] | Callable[[], tuple[DecisionOutcome, ...]] = field(
        repr=False
    )
    op_peak_bytes: np.ndarray = field(repr=False)
    op_start_ns: np.ndarray = field(repr=False)
    op_end_ns: np.ndarray = field(repr=False)
    _memory: dict | None = field(repr=False)  # column arrays; DataFrames are built on first use
    _spans: list | None = field(repr=False)
    _carry: dict = field(default_factory=dict, repr=False)  # Note [Steady state across iterations]
    # the fast pass (simfast.py) leaves _memory and _spans to the reference pass, run on first use
    _reference: Callable[[], SimResult] | None = field(default=None, repr=False)
    _totals: tuple[int, int] | None = field(default=None, repr=False)  # stall_ns, recompute_ns

    @cached_property
    def outcomes(self) -> tuple[DecisionOutcome, ...]:
        """One ``DecisionOutcome`` per decision, in the plan's order."""
        o = self._outcomes
        return o if isinstance(o, tuple) else o()

    @cached_property
    def _full(self) -> SimResult:
        return self if self._memory is not None else self._reference()

    @cached_property
    def memory(self) -> pd.DataFrame:
        """One row per memory event: time_ns, live_bytes, op_index, delta_bytes, what,
        storage_id (what: "op" marks an op's start, then "alloc"/"free")."""
        m = dict(self._full._memory)
        csid, asid, order, kind = m.pop("_lazy")  # the object columns, built on first use
        m["what"] = np.array(["free", "alloc", "op"], dtype=object)[kind]
        m["storage_id"] = np.concatenate(
            [np.asarray(csid, dtype=object), np.asarray(asid, dtype=object)]
        )[order]
        return pd.DataFrame(
            {
                k: m[k]
                for k in ("time_ns", "live_bytes", "op_index", "delta_bytes", "what", "storage_id")
            }
        )

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

    @property
    def stall_ns(self) -> int:
        if self._totals is not None:
            return self._totals[0]
        return sum(o.stall_ns for o in self.outcomes)

    @property
    def recompute_ns(self) -> int:
        if self._totals is not None:
            return self._totals[1]
        return sum(o.recompute_ns for o in self.outcomes)

    def outcomes_frame(self) -> pd.DataFrame:
        return pd.DataFrame([{**o.__dict__, "method": o.method.value} for o in self.outcomes])


_FREE, _ALLOC, _MARK = 0, 1, 2


def check_decisions(problem: Problem, decisions: Sequence[Decision]) -> None:
    """Static invariants of a plan; raises ``PlanError`` on the first broken one."""
    n = problem.n_ops
    checked = _CHECKED.get(problem)
    if checked is None:
        checked = _CHECKED[problem] = set()
    seen = _CHECKED_OBJECTS.get(problem)
    if seen is None or len(seen) > 50_000:
        seen = _CHECKED_OBJECTS[problem] = {}
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
    if len({d.storage_id for d in decisions}) == len(decisions):
        return
    by_storage: dict[str, list[Decision]] = {}
    for d in decisions:
        by_storage.setdefault(d.storage_id, []).append(d)
    for sid, ds in by_storage.items():
        if len(ds) > 1:  # the plan format and the runtime key decisions by storage
            raise PlanError(
                f"storage {sid}: {len(ds)} decisions evict it (after ops "
                f"{sorted(d.evict_op for d in ds)}); a plan has one per storage"
            )


_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decisions that passed
_CHECKED_OBJECTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # id -> such a decision


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
    more than one decision on one storage, a trigger outside (evict, back], replay ops missing
    the producer or an in-place write, sources not matching what the replay reads, a source not
    alive or written since it was read, or an access to a storage that is out.
    """
    bw_out = float(bandwidth_d2h_bytes_per_s or problem.bandwidth_d2h_bytes_per_s)
    bw_in = float(bandwidth_h2d_bytes_per_s or problem.bandwidth_h2d_bytes_per_s)
    # searches simulate the same plan again and again (and the plan builder the policy's
    # last one): results are remembered per problem, the most recent first, as many as
    # _MEMO_EVENTS op-slots allow (a result's arrays grow with the number of ops)
    key = (tuple(decisions), bw_out, bw_in, check)
    # kept on the problem itself: a result of the fast pass refers to its problem (for the
    # reference pass it runs on first use of .memory/.spans), so a weak-keyed memo would keep
    # every problem alive; as an attribute the two form a cycle the garbage collector frees
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
    # Note [The fast pass] (simfast.py): the same result, visiting only the ops of decisions
    res = _steady(problem, decisions, bw_out, bw_in, _fast_pass if check and FAST else _simulate)
    memo[key] = res
    while len(memo) > max(2, _MEMO_EVENTS // max(1, problem.n_ops)):
        memo.popitem(last=False)
    return res


def _steady(problem, decisions, bw_out, bw_in, one_pass) -> SimResult:
    """Passes of ``one_pass`` until the carry settles (Note [Steady state across iterations])."""
    res = one_pass(problem, decisions, bw_out, bw_in)
    prev: dict = {}
    for _ in range(3):
        if all(v == (0, 0) for v in res._carry.values()) and not any(prev.values()):
            break  # nothing carried over: the first pass was the steady state already
        prev = res._carry
        res = one_pass(problem, decisions, bw_out, bw_in, prev)
        if res._carry == prev:
            break
    return res


FAST = True  # Note [The fast pass]; False: every plan takes the reference pass (tests)


def _fast_pass(problem, decisions, bw_out, bw_in, carry=None) -> SimResult:
    from .simfast import fast_pass

    try:
        return fast_pass(problem, decisions, bw_out, bw_in, carry)
    except PlanError:  # the reference pass raises the error, worded
        return _simulate(problem, decisions, bw_out, bw_in, carry)


def simulate_reference(
    problem: Problem,
    decisions: Sequence[Decision],
    *,
    bandwidth_d2h_bytes_per_s: float | None = None,
    bandwidth_h2d_bytes_per_s: float | None = None,
) -> SimResult:
    """``simulate`` by the reference pass alone, nothing remembered (for tests of the fast
    pass, Note [The fast pass])."""
    bw_out = float(bandwidth_d2h_bytes_per_s or problem.bandwidth_d2h_bytes_per_s)
    bw_in = float(bandwidth_h2d_bytes_per_s or problem.bandwidth_h2d_bytes_per_s)
    check_decisions(problem, decisions)
    return _steady(problem, decisions, bw_out, bw_in, _simulate)


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


def _simulate(
    problem: Problem,
    decisions: Sequence[Decision],
    bw_out: float,
    bw_in: float,
    carry: dict | None = None,
) -> SimResult:
    n = problem.n_ops
    ops = problem.ops
    st = problem.storages
    evict_at: dict[int, list[int]] = {}
    trig_at: dict[int, list[int]] = {}
    back_at: dict[int, list[int]] = {}
    for i, d in enumerate(decisions):
        evict_at.setdefault(d.evict_op, []).append(i)
        back_at.setdefault(d.back_op, []).append(i)
        if (
            d.method == Method.SWAP
            and d.trigger_op is not None
            and (d.trigger_op < d.back_op or (d.wraps and d.trigger_op != d.back_op))
        ):
            trig_at.setdefault(d.trigger_op, []).append(i)
    for lst in trig_at.values():
        lst.sort(key=lambda i: (decisions[i].back_op, i))

    # compute-stream memory events, in program order: (time, delta, kind, op, storage)
    ct: list[int] = []
    cd: list[int] = []
    ck: list[int] = []
    cop: list[int] = []
    csid: list[str] = []
    # asynchronous events (copy start / copy end): (time, delta, kind, storage)
    at: list[int] = []
    ad: list[int] = []
    ak: list[int] = []
    asid: list[str] = []
    spans: list[tuple[str, str, int, int, int, str]] = []

    state: dict[str, str] = {}  # storage -> "out" | "swapping_in" | "in" (only decided ones)
    active: dict[str, int] = {}  # storage -> index of the decision currently evicting it
    out_end: dict[str, int] = {}
    in_end: dict[str, int] = {}
    stall = [0] * len(decisions)
    recomp = [0] * len(decisions)
    info = [dict() for _ in decisions]
    h2d_free = 0
    d2h_free = 0
    t = 0
    op_start = np.zeros(n, dtype=np.int64)
    op_end = np.zeros(n, dtype=np.int64)
    resident = problem.resident_bytes
    carry = carry or {}
    for i, d in enumerate(decisions):  # Note [Steady state across iterations]
        if not d.wraps:
            continue
        sid = d.storage_id
        active[sid] = i
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
    acts = action_ops(decisions) if host.action_op_ns else ()

    def start_swap_in(sid: str, size: int, now: int) -> int:
        nonlocal h2d_free, t
        if host.swap_ns:
            spans.append(("compute", f"swap-in call {sid}", t, t + host.swap_ns, -1, sid))
            t += host.swap_ns
            now = max(now, t)
        begin = max(now, h2d_free, out_end.get(sid, 0))
        end = begin + int(round(size / bw_in * 1e9))
        h2d_free = end
        at.append(begin), ad.append(size), ak.append(_ALLOC), asid.append(sid)
        in_end[sid] = end
        state[sid] = "swapping_in"
        i = active[sid]
        info[i]["in_start_ns"], info[i]["in_end_ns"] = begin, end
        spans.append(("h2d", f"swap-in {sid}", begin, end, -1, sid))
        return end

    def restore(sid: str, k: int, charge: int) -> None:
        """Make a swapped storage resident before op k (waiting if needed)."""
        nonlocal t
        if state.get(sid) == "out":
            start_swap_in(sid, st[sid].size_bytes, t)
        if state.get(sid) == "swapping_in":
            wait = max(0, in_end[sid] - t)
            if wait:
                spans.append(("compute", f"stall {sid}", t, t + wait, k, sid))
            stall[charge] += wait
            t += wait
            state[sid] = "in"
            info[active[sid]]["back_ns"] = t

    accessed, pre, post = _op_events(problem)
    for k in range(n):
        op = ops[k]
        if k in acts:
            spans.append(("compute", "slow path", t, t + host.action_op_ns, k, ""))
            t += host.action_op_ns
        op_start[k] = t
        ct.append(t), cd.append(0), ck.append(_MARK), cop.append(k), csid.append("")
        for i in trig_at.get(k, ()):
            sid = decisions[i].storage_id
            if state.get(sid) == "out" and active.get(sid) == i:
                start_swap_in(sid, decisions[i].size_bytes, t)
        for i in back_at.get(k, ()):
            d = decisions[i]
            sid = d.storage_id
            if active.get(sid) != i:
                raise PlanError(f"decision {sid}: back-access op {k} but it was never evicted")
            if d.method == Method.SWAP:
                restore(sid, k, i)
            elif state.get(sid) != "in":  # not kept by an earlier collective recomputation
                for x in d.sources:
                    if state.get(x) in ("out", "swapping_in"):
                        if decisions[active[x]].method != Method.SWAP:
                            raise PlanError(f"decision {sid}: source {x} is dropped at op {k}")
                        restore(x, k, i)
                t1 = t
                t = _replay(
                    problem, d, t, k, state, decisions, active, ct, cd, ck, cop, csid, spans
                )
                t += len(d.replay_ops) * host.replay_op_ns
                recomp[i] = t - t1
                info[i]["back_ns"] = t
            state[sid] = "in"
            del active[sid]
        if active and not active.keys().isdisjoint(accessed[k]):
            x = next(x for x in accessed[k] if x in active)
            raise PlanError(
                f"op {k} ({op.name}) accesses storage {x}, which the plan "
                f"evicted after op {decisions[active[x]].evict_op} and brings "
                f"back at op {decisions[active[x]].back_op}"
            )
        pd_, pk, ps = pre[k]  # the op's allocations (and scratch) at its start
        if pd_:
            m = len(pd_)
            ct.extend([t] * m), cd.extend(pd_), ck.extend(pk), cop.extend([k] * m)
            csid.extend(ps)
        t_end = t + op.duration_ns
        if op.duration_ns:
            spans.append(("compute", op.name, t, t_end, k, ""))
        t = t_end
        op_end[k] = t
        pd_, pk, ps = post[k]  # its scratch and the storages freed after it, at its end
        if pd_:
            m = len(pd_)
            ct.extend([t] * m), cd.extend(pd_), ck.extend(pk), cop.extend([k] * m)
            csid.extend(ps)
        for i in evict_at.get(k, ()):
            d = decisions[i]
            sid = d.storage_id
            active[sid] = i
            state[sid] = "out"
            if d.method == Method.SWAP:
                if host.swap_ns:
                    spans.append(("compute", f"swap-out call {sid}", t, t + host.swap_ns, k, sid))
                    t += host.swap_ns
                begin = max(t, d2h_free)
                end = begin + int(round(d.size_bytes / bw_out * 1e9))
                d2h_free = end
                out_end[sid] = end
                at.append(end), ad.append(-d.size_bytes), ak.append(_FREE), asid.append(sid)
                info[i].update(out_start_ns=begin, out_end_ns=end, freed_ns=end)
                spans.append(("d2h", f"swap-out {sid}", begin, end, -1, sid))
            else:
                ct.append(t), cd.append(-d.size_bytes), ck.append(_FREE), cop.append(k)
                csid.append(sid)
                info[i]["freed_ns"] = t
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

    memory, op_peak = _curve(problem, ct, cd, ck, cop, csid, at, ad, ak, asid, resident)
    outcomes = tuple(
        DecisionOutcome(d.storage_id, d.method, int(stall[i]), int(recomp[i]), **info[i])
        for i, d in enumerate(decisions)
    )
    live = memory["live_bytes"]
    if len(live):
        j = int(live.argmax())
        peak, peak_t = int(live[j]), int(memory["time_ns"][j])
        peak_op = int(memory["op_index"][j])
    else:
        peak, peak_t, peak_op = problem.resident_bytes, 0, -1
    return SimResult(
        peak,
        peak_op,
        peak_t,
        int(t),
        problem.time_ns,
        problem.peak_bytes,
        outcomes,
        op_peak,
        op_start,
        op_end,
        memory,
        spans,
        new_carry,
    )


def _op_events(problem: Problem):
    """Per op, once per problem: the storages it touches, and the memory events of its own
    allocations and scratch at its start and of its scratch and frees at its end, each as
    (deltas, kinds, storage ids)."""
    got = _OP_EVENTS.get(problem)
    if got is not None:
        return got
    st = problem.storages
    accessed, pre, post = [], [], []
    for op in problem.ops:
        accessed.append(frozenset(op.accessed))
        a = [(st[s].size_bytes, _ALLOC, s) for s in op.allocs]
        f = [(-st[s].size_bytes, _FREE, s) for s in op.frees]
        if op.scratch_bytes:
            a.append((op.scratch_bytes, _ALLOC, scratch_id(op.index)))
            f.insert(0, (-op.scratch_bytes, _FREE, scratch_id(op.index)))
        pre.append(tuple(tuple(c) for c in zip(*a, strict=True)) if a else ((), (), ()))
        post.append(tuple(tuple(c) for c in zip(*f, strict=True)) if f else ((), (), ()))
    got = _OP_EVENTS[problem] = (accessed, pre, post)
    return got


_OP_EVENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_REPLAYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # replay event templates


def _replay(
    problem, d: Decision, t: int, k: int, state, decisions, active, ct, cd, ck, cop, csid, spans
) -> int:
    """Run a recompute decision's replay on the compute stream; returns the new time. The
    replay's events relative to its start depend only on the decision and which of its
    ``keep`` storages are out: made once per problem (``_replay_template``)."""
    keep = tuple(
        sorted(
            x
            for x in d.keep
            if state.get(x) == "out"
            and x in active
            and decisions[active[x]].method == Method.RECOMPUTE
        )
    )
    memo = _REPLAYS.get(problem)
    if memo is None:
        memo = _REPLAYS[problem] = {}
    key = (d.storage_id, d.replay_ops, keep)
    tpl = memo.get(key)
    if tpl is None:
        tpl = memo[key] = _replay_template(problem, d, set(keep))
    dts, deltas, kinds, sids, dur = tpl
    m = len(dts)
    ct.extend([t + x for x in dts]), cd.extend(deltas), ck.extend(kinds)
    cop.extend([k] * m), csid.extend(sids)
    for x in keep:  # back early: its own RECOMPUTE will find it resident
        state[x] = "in"
    spans.append(("compute", f"recompute {d.storage_id}", t, t + dur, k, d.storage_id))
    return t + dur


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


def _curve(problem, ct, cd, ck, cop, csid, at, ad, ak, asid, resident):
    n = problem.n_ops
    ct_a = np.asarray(ct, dtype=np.int64)
    at_a = np.asarray(at, dtype=np.int64)
    ak_a = np.asarray(ak, dtype=np.int8)
    # position of each async event among the compute events: frees before compute events at the
    # same instant, allocations after them. See Note [Simulation model].
    pos = np.where(
        ak_a == _FREE,
        np.searchsorted(ct_a, at_a, side="left"),
        np.searchsorted(ct_a, at_a, side="right"),
    )
    key = np.concatenate([2 * np.arange(len(ct_a)) + 1, 2 * pos])
    tie = np.concatenate([np.zeros(len(ct_a), dtype=np.int64), at_a])
    order = np.lexsort((tie, key))
    time = np.concatenate([ct_a, at_a])[order]
    delta = np.concatenate([np.asarray(cd, dtype=np.int64), np.asarray(ad, dtype=np.int64)])[order]
    kind = np.concatenate([np.asarray(ck, dtype=np.int8), ak_a])[order]
    live = resident + np.cumsum(delta)
    # op of each event: the last compute mark at or before it
    is_mark = kind == _MARK
    op_of = np.cumsum(is_mark) - 1
    if len(op_of) and op_of[0] < 0:  # async events before op 0 cannot exist (copies follow ops)
        op_of = np.maximum(op_of, 0)
    op_peak = np.zeros(n, dtype=np.int64)
    if len(live):
        np.maximum.at(op_peak, op_of, live)
    memory = {
        "time_ns": time,
        "live_bytes": live,
        "op_index": op_of,
        "delta_bytes": delta,
        "_lazy": (csid, asid, order, kind),
    }
    return memory, op_peak
