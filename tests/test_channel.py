"""``swapping.Channel``'s coalesced runs give the same first/latest fit as the intervals as
reserved (the plain scan over them is the reference), and its first fit over the runs' gaps
(Note [First fit]) the plain scan's."""

from __future__ import annotations

import random

import pytest
from capuchin.planner.swapping import Channel, scan_first_fit


def _reference(c: Channel) -> Channel:
    ref = Channel()
    ref.starts, ref.ends = list(c.starts), list(c.ends)
    ref._rs, ref._re = ref.starts, ref.ends  # no coalescing
    return ref


@pytest.mark.parametrize("seed", range(200))
def test_coalesced_runs_fit_like_the_intervals(seed):
    rnd = random.Random(seed)
    c = Channel()
    ivs, t = [], 0
    for _ in range(rnd.randint(0, 30)):  # disjoint, often back to back (a serial channel)
        s = rnd.choice([t, t + rnd.randint(0, 5)])
        e = s + rnd.randint(1, 6)
        ivs.append((s, e))
        t = e + rnd.choice([0, 0, 1, 3])
    rnd.shuffle(ivs)
    for s, e in ivs:
        c.reserve(s, e)
    assert all(a < b for a, b in zip(c._re, c._rs[1:], strict=False))  # runs are maximal
    ref = _reference(c)
    for _ in range(60):
        e0, d = rnd.randint(0, t + 5), rnd.randint(0, 7)
        dl = e0 + rnd.randint(0, 40)
        assert c.first_fit(e0, d) == scan_first_fit(ref.starts, ref.ends, e0, d)
        assert c.latest_fit(e0, dl, d) == ref.latest_fit(e0, dl, d)


@pytest.mark.parametrize("seed", range(100))
def test_first_fit_between_reservations(seed):
    """Queries between reservations, on channels of up to 300 copies with slots longer than
    most gaps, so that the search over the gaps' array runs and must see each reservation."""
    rnd = random.Random(seed)
    ivs, t = [], 0
    for _ in range(rnd.randint(20, 300)):
        s = t + rnd.choice([0, 0, 1, 2, 4, 9, 20])
        e = s + rnd.randint(1, 6)
        ivs.append((s, e))
        t = e
    rnd.shuffle(ivs)
    c = Channel()
    for s, e in ivs:
        c.reserve(s, e)
        for _ in range(3):
            e0, d = rnd.randint(0, t + 5), rnd.choice([1, 3, 5, 8, 12, 19, 25])
            assert c.first_fit(e0, d) == scan_first_fit(c.starts, c.ends, e0, d)


def _transformer_gaps():
    """The bundled transformer's problem, its storages' access gaps and its iteration's end."""
    from pathlib import Path

    from capuchin.planner.problem import Problem
    from capuchin.tracer.reader import load_trace

    root = Path(__file__).resolve().parent.parent
    problem = Problem.from_trace(load_trace(root / "traces" / "transformer.trace.parquet"))
    gaps = [(s.size_bytes, a, b) for s in problem.storages.values() for a, b in s.gaps()]
    return problem, gaps, int(problem.end_ns[-1])


def _fill_at_random(timer, rnd: random.Random, t_end: int) -> None:
    """Up to 60 random reservations on the timer's two copy channels."""
    for _ in range(rnd.randint(0, 60)):
        s = rnd.randint(0, t_end)
        (timer.d2h if rnd.random() < 0.5 else timer.h2d).reserve(s, s + rnd.randint(1, t_end // 50))


def test_least_overhead_bounds_every_estimate():
    # SwapTimer.least_overhead: the hybrid's zero-overhead pass skips a pair when it is > 0, so it
    # must never exceed the overhead the estimate gives, on channels filled at random
    import numpy as np
    from capuchin.planner.swapping import SwapTimer

    problem, gaps, t_end = _transformer_gaps()
    rnd = random.Random(0)
    checked = tight = 0
    for _ in range(20):
        in_peak = np.array([rnd.random() < 0.3 for _ in range(problem.n_ops)])
        timer = SwapTimer(problem, in_peak)
        _fill_at_random(timer, rnd, t_end)
        for size, a, b in rnd.sample(gaps, min(200, len(gaps))):
            lb = timer.least_overhead(size, a, b)
            e = timer.estimate(size, a, b)
            assert 0 <= lb <= e.overhead_ns
            checked += 1
            tight += lb == e.overhead_ns > 0
    assert checked > 1000 and tight > 10


def test_hidden_span_holds_every_hidden_option():
    # SwapTimer.hidden_span (policies/capuchin.py Note [Only gaps that can help]): the swap-first
    # pass skips a pair when no op of the span is over the target, so every in-trigger whose copy
    # ends in time must cover ops of the span only, and there must be none when it is None; on
    # channels filled at random
    import numpy as np
    from capuchin.planner.swapping import SwapTimer

    problem, gaps, t_end = _transformer_gaps()
    rnd = random.Random(1)
    hidden = at_edge = none = 0
    for _ in range(10):
        timer = SwapTimer(problem, np.zeros(problem.n_ops, dtype=bool))
        _fill_at_random(timer, rnd, t_end)
        for size, a, b in rnd.sample(gaps, min(60, len(gaps))):
            span = timer.hidden_span(size, a, b)
            t_out, t_in = timer.out_time(size), timer.in_time(size)
            out_start = timer.d2h.first_fit(timer._end[a], t_out)
            none += span is None
            for k in [*range(a + 1, b), None]:
                e = timer._at(k, a, b, out_start, out_start + t_out, t_in)
                if e.overhead_ns > 0 or e.cover_lo > e.cover_hi:
                    continue
                assert span is not None and span[0] <= e.cover_lo <= e.cover_hi <= span[1]
                hidden += 1
                at_edge += e.cover_hi == span[1]
    assert hidden > 1000 and at_edge > 10 and none > 10
