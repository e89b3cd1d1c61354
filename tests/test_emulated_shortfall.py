"""Dynamic mode's shortfall after a replay counts the replayed bytes once (review defect 13): an
allocator that counts (CUDA) has counted them when the replay returns; the CPU estimate has
not yet."""

from __future__ import annotations

import pytest
from capuchin.planner.problem import Problem
from capuchin.runtime.engine import Runtime
from capuchin.runtime.guards.dtr import DynamicGuard
from capuchin.testing.training import TRACES, train_mismatches
from capuchin.tracer.reader import load_trace

pytestmark = pytest.mark.emulated


class _Memory:
    def __init__(self, allocated):
        self.allocated = allocated

    def allocated_bytes(self):
        return self.allocated


class _Tracker:
    def estimate_bytes(self):
        return 60


def _guard(allocated) -> DynamicGuard:
    g = DynamicGuard.__new__(DynamicGuard)
    g.memory, g.tracker = _Memory(allocated), _Tracker()
    return g


def test_replayed_bytes_are_counted_once():
    assert _guard(100).replayed_bytes(30) == 100  # CUDA: the allocator has them already
    assert _guard(None).replayed_bytes(30) == 90  # CPU: the estimate does not yet


def test_replays_report_their_shortfall_through_that_rule(monkeypatch):
    calls = []
    real = DynamicGuard.replayed_bytes

    def counted(self, n):
        calls.append(n)
        return real(self, n)

    monkeypatch.setattr(DynamicGuard, "replayed_bytes", counted)
    peak = Problem.from_trace(load_trace(TRACES / "mlp.trace.parquet")).peak_bytes
    rt = Runtime(budget_bytes=peak // 2, remat="recompute", measure_memory=False)
    assert train_mismatches("mlp", rt) == []
    assert sum(s.recomputed_ops for s in rt.report.iterations) > 0
    assert calls and all(n > 0 for n in calls)
