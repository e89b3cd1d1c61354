"""Lineage's shortcuts against their straightforward definitions, on every call the capuchin
policy's search makes: the replay memo (Note [Replay memo]) against a fresh walk, ``keepable``
and the collective keeps that fit (``_fit_keeps``) against plain loops over the replay's ops and
the room per op."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from capuchin.planner import lineage, msps, search
from capuchin.planner.plan import Method
from capuchin.planner.problem import Problem
from capuchin.planner.registry import get_policy
from capuchin.tracer.reader import load_trace

ROOT = Path(__file__).resolve().parent.parent


def keepable_plain(problem, d, replay_ops, res):
    rs = set(replay_ops)
    out = []
    for j in replay_ops:
        for x in problem.ops[j].allocs:
            if x == d.storage_id or res.out_at(x, d.back_op) != Method.RECOMPUTE:
                continue
            for e, b, m in res._iv.get(x, ()):
                if m == Method.RECOMPUTE and e < d.back_op <= b:
                    chain = lineage.chain_ops(problem, x, e)
                    if chain and all(o in rs for o in chain):
                        out.append(x)
    return out


def fit_keeps_plain(problem, d, replay_ops, res, room):
    keep = []
    for x in keepable_plain(problem, d, replay_ops, res):
        xb = next(b for e, b, m in res._iv[x] if e < d.back_op <= b)
        size = problem.storages[x].size_bytes
        if room[d.back_op : xb].min(initial=size) >= size:
            room[d.back_op : xb] -= size
            keep.append(x)
    return keep


class Counted:
    def __init__(self):
        self.keepable = self.kept = self.fits = self.replays = self.hits = self.costly = 0
        self.regenerated = 0


def _checked(monkeypatch) -> Counted:
    c = Counted()
    replay_for = lineage.replay_for

    def keeps(problem, d, replay_ops, res, room):
        xs = lineage.keepable(problem, d, replay_ops, res)
        assert xs == keepable_plain(problem, d, replay_ops, res)
        want_room = room.copy()
        want = fit_keeps_plain(problem, d, replay_ops, res, want_room)
        got = lineage._fit_keeps(problem, d, lineage._keepable(problem, d, replay_ops, res), room)
        assert got == want and np.array_equal(room, want_room)
        c.keepable += 1
        c.kept += len(got)
        c.fits += len(xs) > len(got) > 0  # some kept, some not: the room decided
        return got

    def r(
        problem, sid, evict_op, back_op, residency=None, resident=None, max_ops=None, max_ns=None
    ):
        max_ops = lineage.MAX_REPLAY_OPS if max_ops is None else max_ops
        memo = lineage._REPLAY_MEMO.get(problem, {})
        before = sum(len(v) for v in memo.values())
        got = replay_for(problem, sid, evict_op, back_op, residency, resident, max_ops, max_ns)
        memo = lineage._REPLAY_MEMO.get(problem, {})
        c.hits += sum(len(v) for v in memo.values()) == before  # nothing walked: the memo's
        want = lineage._replay_walk(
            problem, sid, evict_op, back_op, residency, resident, max_ops, []
        )
        # the whole walk, without a time bound: a bounded query answers None exactly when the
        # replay does not exist or takes max_ns or more (lineage Note [Replays with a time bound])
        if want is not None and max_ns is not None and want[2] >= max_ns:
            want = None
            c.costly += 1
        assert got == (None if want is None else (list(want[0]), list(want[1])))
        c.replays += 1
        return got

    plain_keepable = lineage.keepable

    def keepable(problem, d, replay_ops, res):  # the builder's path: storages regenerated
        got = plain_keepable(problem, d, replay_ops, res)
        assert got == keepable_plain(problem, d, replay_ops, res)
        c.keepable += 1
        c.regenerated += bool(res._back_from)
        return got

    monkeypatch.setattr(lineage, "_keeps", keeps)
    monkeypatch.setattr(lineage, "keepable", keepable)
    for mod in (lineage, search, msps):
        monkeypatch.setattr(mod, "replay_for", r)
    return c


@pytest.mark.slow
def test_lineage_shortcuts_equal_their_definitions_on_a_search(monkeypatch):
    c = _checked(monkeypatch)
    problem = Problem.from_trace(load_trace(ROOT / "traces" / "transformer.trace.parquet"))
    for f in (0.6, 0.45):
        get_policy("capuchin")(problem, int(problem.peak_bytes * f))
    assert c.keepable > 100 and c.kept > 10 and c.replays > 1000 and c.hits > 500
    assert c.fits > 0 and c.costly > 10


def test_lineage_shortcuts_equal_their_definitions_on_a_small_search(monkeypatch):
    c = _checked(monkeypatch)
    problem = Problem.from_trace(load_trace(ROOT / "traces" / "cnn.trace.parquet"))
    for f in (0.5, 0.4):
        get_policy("capuchin")(problem, int(problem.peak_bytes * f))
    assert c.keepable > 1000 and c.kept > 1000 and c.fits > 100
    assert c.replays > 1000 and c.hits > 1000
    assert c.costly > 10  # time-bounded queries that the bound answered


def test_replay_memo_equals_a_fresh_walk_when_the_builder_resolves(monkeypatch):
    # resolve_recompute marks storages regenerated as it goes (EvictionWindows.regenerated),
    # which out_at and the memo's test must honour; the recompute-only plans, their lineage
    # stripped, resolved twice (the second time from the memo)
    from dataclasses import replace

    c = _checked(monkeypatch)
    for name in ("transformer", "cnn"):
        problem = Problem.from_trace(load_trace(ROOT / "traces" / f"{name}.trace.parquet"))
        for f in (0.6, 0.45):
            ds = get_policy("recompute")(problem, int(problem.peak_bytes * f)).decisions
            bare = [replace(d, replay_ops=(), sources=(), keep=()) for d in ds]
            bare.sort(key=lambda d: (d.evict_op, d.storage_id))
            for _ in range(2):
                lineage.resolve_recompute(problem, bare)
    assert c.replays > 50 and c.hits > 20
    assert c.regenerated > 5  # keepable asked where earlier replays brought storages back


def test_a_time_bounded_replay_query_leaves_the_memo_exact():
    # lineage Note [Replays with a time bound]: a walk stopped at a low bound is remembered, and
    # must answer only queries with a bound no higher; every answer equals the whole walk's
    problem = Problem.from_trace(load_trace(ROOT / "traces" / "cnn.trace.parquet"))
    ops = problem.ops
    checked = 0
    for sid, s in problem.storages.items():
        for a, b in s.gaps()[:1]:
            want = lineage._replay_walk(problem, sid, a, b, None, None, lineage.MAX_REPLAY_OPS, [])
            if want is None or len(want[0]) < 2:
                continue
            dur = sum(ops[j].duration_ns for j in want[0])
            assert dur == want[2]
            res = lineage.EvictionWindows([])
            lineage._REPLAY_MEMO.pop(problem, None)
            assert lineage.replay_for(problem, sid, a, b, res, max_ns=1) is None  # stopped at once
            assert lineage.replay_for(problem, sid, a, b, res, max_ns=dur) is None  # not cheaper
            whole = (list(want[0]), list(want[1]))
            assert lineage.replay_for(problem, sid, a, b, res, max_ns=dur + 1) == whole
            assert lineage.replay_for(problem, sid, a, b, res) == whole
            assert lineage.replay_for(problem, sid, a, b, res, max_ns=2) is None  # from the memo
            checked += 1
    assert checked > 5
