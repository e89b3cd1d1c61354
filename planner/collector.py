"""Python's cyclic garbage collector, paused where the planner allocates in bulk.

# Note: [Garbage collection while planning]
# Building a problem from a trace, searching for a plan and building the plan each allocate
# millions of short-lived objects. Each allocation burst triggers the cyclic collector, which
# walks every tracked object of the generations it collects (the problem's storages and ops, the
# search's memoized results) and finds little cyclic garbage: reference counting frees it. So
# ``Problem.from_trace``, the policies that search (``capuchin``, ``capuchin-ls``, ``swap``,
# ``recompute``), ``dtr``, ``build_plan`` and ``Plan.to_json`` run with the collector paused
# (``gc_paused``); the cyclic garbage they leave is collected once it runs again.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable


def gc_paused(fn: Callable) -> Callable:
    """``fn`` with the cyclic garbage collector paused while it runs (Note [Garbage collection
    while planning]); the collector's state is restored afterwards (a collector the caller
    paused stays paused)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return run
