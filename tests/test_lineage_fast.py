"""Lineage's shortcuts against their straightforward definitions, on every call the capuchin
policy's search makes: the replay memo (Note [Replay memo]) against a fresh walk, ``keepable``,
the keepable storages tested at once (Note [Keepable, at once]) and the collective keeps that
fit (``_fit_keeps``) against plain loops over the replay's ops and the room per op."""

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


def at_once_pairs(problem, d, replay_ops, res):
    """``_keepable_at_once`` as ``_keepable``'s ``(storage, window back-access)`` pairs."""
    got = lineage._keepable_at_once(problem, d, replay_ops, res)
    if isinstance(got, list):
        return got
    sids, his, sizes = got
    assert sizes.tolist() == [problem.storages[x].size_bytes for x in sids]
    return list(zip(sids, his.tolist(), strict=True))


class Counted:
    def __init__(self):
        self.keepable = self.kept = self.fits = self.replays = self.hits = self.costly = 0
        self.regenerated = self.at_once = 0


def _checked(monkeypatch) -> Counted:
    c = Counted()
    replay_for = lineage.replay_for
    real_keeps = lineage._keeps

    def keeps(problem, d, replay_ops, res, room):
        xs = lineage.keepable(problem, d, replay_ops, res)
        assert xs == keepable_plain(problem, d, replay_ops, res)
        if not res._back_from:
            at_once = at_once_pairs(problem, d, replay_ops, res)
            assert at_once == lineage._keepable(problem, d, replay_ops, res)
            c.at_once += 1
        want_room = room.copy()
        want = fit_keeps_plain(problem, d, replay_ops, res, want_room)
        got = real_keeps(problem, d, replay_ops, res, room)
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
    assert c.at_once > 100
    assert c.fits > 0 and c.costly > 10


@pytest.mark.slow
def test_lineage_shortcuts_equal_their_definitions_on_a_small_search(monkeypatch):
    c = _checked(monkeypatch)
    problem = Problem.from_trace(load_trace(ROOT / "traces" / "cnn.trace.parquet"))
    for f in (0.5, 0.4):
        get_policy("capuchin")(problem, int(problem.peak_bytes * f))
    assert c.keepable > 1000 and c.kept > 1000 and c.fits > 100 and c.at_once > 1000
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


@pytest.mark.parametrize("name", ["cnn", "mlp", "transformer"])
def test_keepable_at_once_equals_the_loop_on_random_plans(name):
    # Note [Keepable, at once]: random decision sets, most storages dropped, some swapped, a few
    # with two windows (they take the loop)
    import random

    from capuchin.planner.plan import Decision

    problem = Problem.from_trace(load_trace(ROOT / "traces" / f"{name}.trace.parquet"))
    gaps = [(sid, a, b) for sid, s in problem.storages.items() if s.evictable for a, b in s.gaps()]
    size = {sid: s.size_bytes for sid, s in problem.storages.items()}
    rnd = random.Random(0)
    compared = found = several = 0
    for _ in range(40):
        picked: dict[str, list] = {}
        for sid, a, b in rnd.sample(gaps, len(gaps) // 2):
            if sid not in picked or rnd.random() < 0.1:
                picked.setdefault(sid, []).append((a, b))
        ds = [
            Decision(sid, Method.RECOMPUTE if rnd.random() < 0.85 else Method.SWAP, size[sid], a, b)
            for sid, ws in picked.items()
            for a, b in ws
        ]
        res = lineage.EvictionWindows(ds)
        for d in ds:
            if d.method != Method.RECOMPUTE:
                continue
            r = lineage.replay_for(problem, d.storage_id, d.evict_op, d.back_op, res)
            if r is None:
                continue
            want = lineage._keepable(problem, d, r[0], res)
            assert at_once_pairs(problem, d, r[0], res) == want
            compared += 1
            found += len(want)
            several += any(len(res._iv[x]) > 1 for x, _ in want)
    assert compared > 500 and found > 100 and several > 5


def test_a_storage_written_after_the_version_a_replay_regenerates_is_not_kept():
    # Note [Keepable, at once]: t is made from x before x is written in place; t's replay
    # regenerates x as it was then (op 0 only), so x, dropped over t's back-access, is not kept
    # (its chain up to its evicted-access 3 holds the write, op 2): ``lim``
    from capuchin.planner.plan import Decision
    from capuchin.tracer.synthetic import trace_from_ops

    ops = [
        ("mk", 10, (), ("x",)),
        ("f", 10, ("x",), ("t",)),
        ("w", 10, (), (), ("x",)),
        ("u", 10, ("x",), ("y",)),
        ("z", 10, ("y",), ("z",)),
        ("g", 10, ("t", "z"), ("o",)),
        ("h", 10, ("x", "o"), ("q",)),
    ]
    sizes = dict.fromkeys(["x", "t", "y", "z", "o", "q"], 100)
    problem = Problem.from_trace(trace_from_ops(ops, sizes))
    t = Decision("t", Method.RECOMPUTE, 100, 1, 5)
    res = lineage.EvictionWindows([t, Decision("x", Method.RECOMPUTE, 100, 3, 6)])
    replay_ops, _ = lineage.replay_for(problem, "t", 1, 5, res)
    assert replay_ops == [0, 1]
    assert lineage._keepable(problem, t, replay_ops, res) == []
    assert at_once_pairs(problem, t, replay_ops, res) == []
    # dropped until before the write instead, x is kept
    t2 = Decision("t", Method.RECOMPUTE, 100, 1, 2)
    res = lineage.EvictionWindows([t2, Decision("x", Method.RECOMPUTE, 100, 1, 2)])
    replay_ops, _ = lineage.replay_for(problem, "t", 1, 2, res)
    assert lineage._keepable(problem, t2, replay_ops, res) == [("x", 2)]
    assert at_once_pairs(problem, t2, replay_ops, res) == [("x", 2)]
