"""The simulation model written as one loop over every op: the oracle the simulator's pass
(planner/simulator.py, Note [Only the ops of decisions]) is held equal to, field by field, in
tests/test_simulator_fast.py and benchmarks/simulator_speed.py. It implements Note [Simulation
model] and Note [Steady state across iterations] directly: every op is visited, every memory
event is recorded with its storage, and every op checks that it touches no storage that is out.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pandas as pd
from capuchin.errors import PlanError
from capuchin.planner.costs import action_ops
from capuchin.planner.plan import Decision, Method
from capuchin.planner.problem import Problem
from capuchin.planner.simulator import (
    DecisionOutcome,
    _steady,
    check_decisions,
)
from capuchin.tracer.schema import scratch_id

_FREE, _ALLOC, _MARK = 0, 1, 2


@dataclass(frozen=True, eq=False)
class OracleResult:
    """The fields of a ``SimResult``, as the oracle computes them."""

    peak_bytes: int
    peak_op: int
    peak_time_ns: int
    time_ns: int
    baseline_time_ns: int
    baseline_peak_bytes: int
    outcomes: tuple[DecisionOutcome, ...]
    op_peak_bytes: np.ndarray = field(repr=False)
    op_start_ns: np.ndarray = field(repr=False)
    op_end_ns: np.ndarray = field(repr=False)
    _memory: dict = field(repr=False)
    _spans: list = field(repr=False)
    _carry: dict = field(default_factory=dict, repr=False)

    @property
    def stall_ns(self) -> int:
        return sum(o.stall_ns for o in self.outcomes)

    @property
    def recompute_ns(self) -> int:
        return sum(o.recompute_ns for o in self.outcomes)

    @cached_property
    def memory(self) -> pd.DataFrame:
        m = dict(self._memory)
        csid, asid, order, kind = m.pop("_lazy")
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
        return pd.DataFrame(
            self._spans, columns=["stream", "name", "start_ns", "end_ns", "op_index", "storage_id"]
        )


def simulate_oracle(problem: Problem, decisions: Sequence[Decision]) -> OracleResult:
    """``simulator.simulate`` by the oracle pass (checked, steady state, nothing remembered)."""
    bw_out = float(problem.bandwidth_d2h_bytes_per_s)
    bw_in = float(problem.bandwidth_h2d_bytes_per_s)
    check_decisions(problem, decisions)
    return _steady(problem, decisions, bw_out, bw_in, oracle_pass)


def oracle_pass(
    problem: Problem,
    decisions: Sequence[Decision],
    bw_out: float,
    bw_in: float,
    carry: dict | None = None,
) -> OracleResult:
    n = problem.n_ops
    ops = problem.ops
    st = problem.storages
    evict_at: dict[int, list[int]] = {}
    trig_at: dict[int, list[int]] = {}
    back_at: dict[int, list[int]] = {}
    free_at: dict[int, list[int]] = {}  # dead decisions by the op that frees the storage
    for i, d in enumerate(decisions):
        evict_at.setdefault(d.evict_op, []).append(i)
        if d.dead:
            free_at.setdefault(d.back_op, []).append(i)
            continue
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
                if host.drop_ns:
                    spans.append(("compute", f"drop call {sid}", t, t + host.drop_ns, k, sid))
                    t += host.drop_ns
        for i in free_at.get(k, ()):  # a dead storage freed by the script: out already
            sid = decisions[i].storage_id
            ct.append(t), cd.append(decisions[i].size_bytes), ck.append(_ALLOC), cop.append(k)
            csid.append(sid)
            wait = max(0, out_end[sid] - t)  # the free waits for the swap-out
            if wait:
                spans.append(("compute", f"stall {sid}", t, t + wait, k, sid))
            stall[i] += wait
            t += wait
            state.pop(sid, None)
            del active[sid]
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
    return OracleResult(
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
