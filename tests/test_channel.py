"""``swapping.Channel``'s coalesced runs give the same first/latest fit as the intervals as
reserved (the plain scan over them is the reference)."""

from __future__ import annotations

import random

import pytest
from capuchin.planner.swapping import Channel


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
        assert c.first_fit(e0, d) == ref.first_fit(e0, d)
        assert c.latest_fit(e0, dl, d) == ref.latest_fit(e0, dl, d)
