"""Algorithm 2's queue (planner/msps.py): the cap on a candidate's replay temporaries."""

from __future__ import annotations

import numpy as np
from capuchin.planner.gaps import AccessGap
from capuchin.planner.lineage import EvictionWindows
from capuchin.planner.msps import MspsQueue, temp_cap
from capuchin.planner.problem import Problem
from capuchin.tracer.synthetic import trace_from_ops

MB = 1 << 20


def _chain() -> Problem:
    # x0 -> x1 -> x2, all saved for the backward pass
    ops = [
        ("f0", 100, (), ("x0",)),
        ("f1", 100, ("x0",), ("x1",)),
        ("f2", 100, ("x1",), ("x2",)),
        ("b2", 100, ("x2",), ("g2",)),
        ("b1", 100, ("x1", "g2"), ("g1",)),
        ("b0", 100, ("x0", "g1"), ("g0",)),
    ]
    sizes = {"x0": 8 * MB, "x1": 8 * MB, "x2": 8 * MB, "g2": MB, "g1": MB, "g0": MB}
    return Problem.from_trace(trace_from_ops(ops, sizes))


def test_substituted_temporaries_are_capped_and_fit_int64():
    # Note [Temporaries, capped]: a substitution adds the source's bytes and temporaries; along
    # a chain that can double per link, and the policy adds it to an int64 excess (a 48-layer
    # GPT-2 overflowed). Capped, it stays above every target and fits int64.
    p = _chain()
    q = MspsQueue(p, EvictionWindows([]), 200)
    (a0, b0, _), (a1, b1, _) = (next(iter(p.swap_gaps(p.storages[s]))) for s in ("x0", "x1"))
    t = q.add(AccessGap("x0", 8 * MB, a0, b0))
    c = q.add(AccessGap("x1", 8 * MB, a1, b1))
    assert t is not None and c is not None and "x0" in c.srcs
    t.temp_bytes = 1 << 70  # as after many doublings
    q._substitute(t, c)
    cap = temp_cap(p)
    assert c.temp_bytes == cap
    assert cap > p.peak_bytes  # above every target: a capped replay still never fits
    excess = np.full(p.n_ops, -p.peak_bytes, dtype=np.int64)
    excess[b1] += c.temp_bytes  # what the hybrid does on selecting it: no OverflowError
    assert excess[b1] > 0
