"""The simulator's fast pass: the same simulation as ``simulator._simulate``, visiting only the
ops where a decision acts. No torch.

# Note: [The fast pass]
# ``simulate`` runs this pass for checked plans; ``simulator._simulate`` (the reference pass,
# one loop over every op) stays the definition, and ``tests/test_simulator_fast.py`` holds the
# two equal, field by field, on thousands of plans the searches simulate and on perturbed ones.
# What makes it cheaper, with the same results:
# - The loop visits only the ops where a decision evicts, prefetches or brings back. Every other
#   op starts at its baseline start plus the host time of the action ops up to it (``acts``, a
#   cumulative sum) plus the stall, replay and host time the visited ops before it added. Its
#   own memory events (its start mark, its allocations and scratch, its frees) come from
#   per-problem arrays and are timed in bulk from the per-op start, allocation and end times.
# - The visited ops' own events (replays, drops) are merged with those by order key
#   (5 * op + phase: 0 the mark, 1 the replays, 2 the op's allocations, 3 its frees, 4 the
#   drops), which is the reference's program order; the copies' events are appended in the
#   reference's issue order, so the curve (``_curve``'s sort) is the same array.
# - Nothing is built for reports during the pass: ``SimResult.memory`` and ``SimResult.spans``
#   (storage ids, span names) are made on first use by the reference pass, with the same input
#   carry (Note [Steady state across iterations]).
# - A plan that breaks an invariant during the pass is re-run by the reference pass, which raises
#   its error.
# A plan simulated with ``check=False`` (its invariants unchecked, so an op may access a storage
# while it is out, which only the reference's per-op test catches) takes the reference pass.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence

import numpy as np

from ..errors import PlanError
from .plan import Decision, Method
from .problem import Problem

_FREE, _ALLOC, _MARK = 0, 1, 2


class _Ops:
    """Per problem: baseline op times and every op's own memory events in program order."""

    def __init__(self, problem: Problem):
        st = problem.storages
        key, opx, where, delta, kind = [], [], [], [], []

        def add(k, phase, d, kd):
            key.append(5 * k + phase), opx.append(k), where.append((phase + 1) // 2)
            delta.append(d), kind.append(kd)

        for op in problem.ops:
            k = op.index
            add(k, 0, 0, _MARK)
            for s in op.allocs:
                add(k, 2, st[s].size_bytes, _ALLOC)
            if op.scratch_bytes:
                add(k, 2, op.scratch_bytes, _ALLOC)
                add(k, 3, -op.scratch_bytes, _FREE)
            for s in op.frees:
                add(k, 3, -st[s].size_bytes, _FREE)
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
        self.time_ns = problem.time_ns
        self.peak_bytes = problem.peak_bytes
        self._sizes = {sid: s.size_bytes for sid, s in st.items()}
        self._copies: dict[tuple[float, float], tuple[dict, dict]] = {}

    def copy_ns(self, bw_out: float, bw_in: float) -> tuple[dict, dict]:
        """Per storage, its swap-out and swap-in copy times at these bandwidths (ns, rounded
        as the reference pass rounds them)."""
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


def fast_pass(
    problem: Problem,
    decisions: Sequence[Decision],
    bw_out: float,
    bw_in: float,
    carry: dict | None = None,
):
    """One pass of ``simulator._simulate`` (Note [The fast pass]); the ``SimResult``'s memory
    and spans are made on first use by the reference pass."""
    from .costs import action_ops
    from .simulator import (
        _REPLAYS,
        DecisionOutcome,
        SimResult,
        _replay_template,
        _simulate,
    )

    n = problem.n_ops
    st = problem.storages
    P = _ops_of(problem)
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

    # dynamic compute events (replays at phase 1, drops at phase 4), as chunks in program
    # order: key, start time, (times from the start, deltas, kinds)
    dk: list[int] = []
    dt: list[int] = []
    dev: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    tpl_arrays = _TEMPLATE_ARRAYS.get(problem)
    if tpl_arrays is None:
        tpl_arrays = _TEMPLATE_ARRAYS[problem] = {}
    # asynchronous events (copy start / copy end), in issue order
    at: list[int] = []
    ad: list[int] = []
    ak: list[int] = []

    state: dict[str, str] = {}
    away: set[str] = set()  # the storages whose state is "out" or "swapping_in"
    active: dict[str, int] = {}
    out_end: dict[str, int] = {}
    in_end: dict[str, int] = {}
    m_ = len(decisions)
    stall = [0] * m_
    recomp = [0] * m_
    info = [None] * m_  # per decision: dict of the outcome's times, made when first needed
    h2d_free = 0
    d2h_free = 0
    resident = problem.resident_bytes
    carry = carry or {}
    for i, d in enumerate(decisions):  # Note [Steady state across iterations]
        if not d.wraps:
            continue
        sid = d.storage_id
        active[sid] = i
        c_out, c_in = carry.get(sid, (0, 0))
        if d.trigger_op is not None and d.trigger_op > d.evict_op:
            state[sid] = "swapping_in"
            away.add(sid)
            in_end[sid] = c_in
            h2d_free = max(h2d_free, c_in)
        else:
            state[sid] = "out"
            away.add(sid)
            out_end[sid] = c_out
            d2h_free = max(d2h_free, c_out)
            if c_out > 0:
                at.append(c_out), ad.append(-d.size_bytes), ak.append(_FREE)
            else:
                resident -= d.size_bytes

    host = problem.host
    swap_ns, replay_op_ns = host.swap_ns, host.replay_op_ns
    if host.action_op_ns:
        A = np.zeros(n, dtype=np.int64)
        acts = [k for k in action_ops(decisions) if 0 <= k < n]
        A[acts] = host.action_op_ns
        cA = np.cumsum(A).tolist()  # host time of the action ops up to and including op k
    else:
        A = None
        cA = None
    start_l, dur_l = P.start_l, P.dur_l
    replays = _REPLAYS.get(problem)
    if replays is None:
        replays = _REPLAYS[problem] = {}
    D: dict[int, int] = {}  # visited op -> time added between its start and its allocations
    E: dict[int, int] = {}  # visited op -> time added after it ends (swap-out calls)
    shift = 0
    t = 0
    out_ns, in_ns = P.copy_ns(bw_out, bw_in)  # storage -> copy time
    visit = sorted({*evict_at, *back_at, *trig_at})
    for k in visit:
        t = t0 = start_l[k] + (cA[k] if cA is not None else 0) + shift
        for i in trig_at.get(k, ()):
            d = decisions[i]
            sid = d.storage_id
            if state.get(sid) == "out" and active.get(sid) == i:
                # start_swap_in
                if swap_ns:
                    t += swap_ns
                begin = max(t, h2d_free, out_end.get(sid, 0))
                end = begin + in_ns[sid]
                h2d_free = end
                at.append(begin), ad.append(d.size_bytes), ak.append(_ALLOC)
                in_end[sid] = end
                state[sid] = "swapping_in"
                inf = info[i]
                if inf is None:
                    inf = info[i] = dict(_TIMES)
                inf["in_start_ns"], inf["in_end_ns"] = begin, end
        for i in back_at.get(k, ()):
            d = decisions[i]
            sid = d.storage_id
            if active.get(sid) != i:
                raise PlanError("never evicted")  # the reference pass words it
            if d.method == Method.SWAP:
                restore = (sid,)
            elif state.get(sid) != "in":
                restore = []
                for x in d.sources if not away.isdisjoint(d.sources) else ():
                    if x in away:
                        if decisions[active[x]].method != Method.SWAP:
                            raise PlanError("dropped source")
                        restore.append(x)
            else:
                restore = ()
            for x in restore:
                # restore(x, k, charge=i)
                if state.get(x) == "out":
                    if swap_ns:
                        t += swap_ns
                    begin = max(t, h2d_free, out_end.get(x, 0))
                    end = begin + in_ns[x]
                    h2d_free = end
                    at.append(begin), ad.append(st[x].size_bytes), ak.append(_ALLOC)
                    in_end[x] = end
                    state[x] = "swapping_in"
                    j = active[x]
                    inf = info[j]
                    if inf is None:
                        inf = info[j] = dict(_TIMES)
                    inf["in_start_ns"], inf["in_end_ns"] = begin, end
                if state.get(x) == "swapping_in":
                    wait = in_end[x] - t
                    if wait > 0:
                        stall[i] += wait
                        t += wait
                    state[x] = "in"
                    away.discard(x)
                    j = active[x]
                    inf = info[j]
                    if inf is None:
                        inf = info[j] = dict(_TIMES)
                    inf["back_ns"] = t
            if d.method != Method.SWAP and state.get(sid) != "in":
                t1 = t
                keep = tuple(
                    sorted(
                        x
                        for x in d.keep
                        if state.get(x) == "out"
                        and x in active
                        and decisions[active[x]].method == Method.RECOMPUTE
                    )
                )
                rkey = (d.storage_id, d.replay_ops, keep)
                tpl = replays.get(rkey)
                if tpl is None:
                    tpl = replays[rkey] = _replay_template(problem, d, set(keep))
                dts, deltas, kinds, _sids, dur = tpl
                if dts:
                    arr = tpl_arrays.get(rkey)
                    if arr is None:
                        arr = tpl_arrays[rkey] = (
                            np.asarray(dts, dtype=np.int64),
                            np.asarray(deltas, dtype=np.int64),
                            np.asarray(kinds, dtype=np.int8),
                        )
                    dk.append(5 * k + 1), dt.append(t), dev.append(arr)
                for x in keep:
                    state[x] = "in"
                    away.discard(x)
                t += dur
                t += len(d.replay_ops) * replay_op_ns
                recomp[i] = t - t1
                inf = info[i]
                if inf is None:
                    inf = info[i] = dict(_TIMES)
                inf["back_ns"] = t
            state[sid] = "in"
            away.discard(sid)
            del active[sid]
        if t != t0:
            D[k] = t - t0
        t += dur_l[k]
        t_end = t
        for i in evict_at.get(k, ()):
            d = decisions[i]
            sid = d.storage_id
            active[sid] = i
            state[sid] = "out"
            away.add(sid)
            if d.method == Method.SWAP:
                if swap_ns:
                    t += swap_ns
                begin = max(t, d2h_free)
                end = begin + out_ns[sid]
                d2h_free = end
                out_end[sid] = end
                at.append(end), ad.append(-d.size_bytes), ak.append(_FREE)
                inf = info[i]
                if inf is None:
                    inf = info[i] = dict(_TIMES)
                inf["out_start_ns"], inf["out_end_ns"], inf["freed_ns"] = begin, end, end
            else:
                dk.append(5 * k + 4), dt.append(t), dev.append(_drop_event(d.size_bytes))
                inf = info[i]
                if inf is None:
                    inf = info[i] = dict(_TIMES)
                inf["freed_ns"] = t
        if t != t_end:
            E[k] = t - t_end
        shift += t - t0 - dur_l[k]
    # the time after the last op: its baseline end plus every delay before it
    t = (int(P.start[-1] + P.dur[-1]) + (cA[-1] if cA is not None else 0) + shift) if n else 0
    for i in active.values():
        if not decisions[i].wraps:
            raise PlanError("still evicted")  # the reference pass words it
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
    live, time, op_of = _curve(ct_a, cd_a, ck_a, at, ad, ak, resident)
    op_peak = np.zeros(n, dtype=np.int64)
    if len(live):
        np.maximum.at(op_peak, op_of, live)
        j = int(live.argmax())
        peak, peak_t, peak_op = int(live[j]), int(time[j]), int(op_of[j])
    else:
        peak, peak_t, peak_op = problem.resident_bytes, 0, -1

    ds = tuple(decisions)  # a caller may reuse its list; the outcomes are made on first use

    def outcomes() -> tuple[DecisionOutcome, ...]:
        # DecisionOutcome(...) field by field, without its frozen __init__'s setattr calls
        new, setattr_ = object.__new__, object.__setattr__
        out = []
        for i, d in enumerate(ds):
            o = new(DecisionOutcome)
            setattr_(
                o,
                "__dict__",
                {
                    "storage_id": d.storage_id,
                    "method": d.method,
                    "stall_ns": stall[i],
                    "recompute_ns": recomp[i],
                    **(info[i] or _TIMES),
                },
            )
            out.append(o)
        return tuple(out)

    ref_args = (problem, ds, bw_out, bw_in, carry or None)
    return SimResult(
        peak,
        peak_op,
        peak_t,
        int(t),
        P.time_ns,
        P.peak_bytes,
        outcomes,
        op_peak,
        op_start,
        op_end,
        None,
        None,
        new_carry,
        _reference=lambda: _simulate(*ref_args),
        _totals=(sum(stall), sum(recomp)),
    )


_TEMPLATE_ARRAYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # replay templates


@functools.lru_cache(maxsize=4096)
def _drop_event(size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A dropped storage's one event, as a chunk of the fast pass's dynamic events."""
    return (
        np.zeros(1, dtype=np.int64),
        np.full(1, -size, dtype=np.int64),
        np.full(1, _FREE, dtype=np.int8),
    )


_TIMES = dict(  # DecisionOutcome's times, in field order, as when they did not happen
    out_start_ns=-1, out_end_ns=-1, in_start_ns=-1, in_end_ns=-1, freed_ns=-1, back_ns=-1
)


def _curve(ct_a, cd_a, ck_a, at, ad, ak, resident):
    """``simulator._curve`` without the storage ids: live bytes, time and op of every event."""
    at_a = np.asarray(at, dtype=np.int64)
    ak_a = np.asarray(ak, dtype=np.int8)
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
    op_of = np.cumsum(kind == _MARK) - 1
    if len(op_of) and op_of[0] < 0:
        op_of = np.maximum(op_of, 0)
    return live, time, op_of
