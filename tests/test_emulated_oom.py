"""Out-of-memory errors inside the runtime's own allocations (review defect 4): an on-demand
restore or a replay that meets the allocator's cap makes room and retries, a prefetch that does
not fit is skipped; the run stays bitwise identical to plain training. The error is injected
where the CUDA allocator would raise it (the storage resize); CPU tensors otherwise."""

from __future__ import annotations

import pytest
import torch
from capuchin.planner.problem import Problem
from capuchin.runtime.engine import Runtime
from capuchin.testing.training import TRACES, hand_plan, train_mismatches
from capuchin.tracer.reader import load_trace

pytestmark = pytest.mark.emulated


class _FailOnce:
    """``resize`` that raises ``torch.OutOfMemoryError`` on its first ``times`` growing calls."""

    def __init__(self, real, times: int = 1):
        self.real, self.left, self.raised = real, times, 0

    def __call__(self, st, nbytes):
        if nbytes > 0 and self.left > 0:
            self.left -= 1
            self.raised += 1
            raise torch.OutOfMemoryError("emulated CUDA out of memory at the cap")
        return self.real(st, nbytes)


def test_an_on_demand_restore_that_meets_the_cap_makes_room_and_retries(monkeypatch):
    import capuchin.runtime.swap as swap

    fail = _FailOnce(swap.resize, times=2)
    monkeypatch.setattr(swap, "resize", fail)
    peak = Problem.from_trace(load_trace(TRACES / "mlp.trace.parquet")).peak_bytes
    rt = Runtime(budget_bytes=peak * 6 // 10, eviction="lru", measure_memory=False)
    assert train_mismatches("mlp", rt) == []
    assert fail.raised == 2  # the restores did meet the cap, and the run went on
    assert sum(s.passive_evictions for s in rt.report.iterations) > 0


@pytest.fixture(autouse=True)
def _swap_outs_complete_at_once(monkeypatch):
    """Every CPU swap-out copies on the calling thread, so that a storage is out (and its
    prefetch starts) at the same op in every run: the copy thread's speed on a loaded host
    would otherwise decide which prefetches find their swap-out still running."""
    import capuchin.runtime.backend as backend

    monkeypatch.setattr(backend, "INLINE_COPY_MAX_BYTES", 1 << 40)


def _plan(method: str):
    return hand_plan(Problem.from_trace(load_trace(TRACES / "mlp.trace.parquet")), method, limit=6)


def test_a_prefetch_that_does_not_fit_is_skipped_and_restored_on_demand(monkeypatch):
    import capuchin.runtime.swap as swap

    plan = _plan("swap")
    fail = _FailOnce(swap.resize, times=3)
    in_prefetch = [False]
    real_prefetch = swap.SwapEngine.prefetch

    def prefetch(self, e):
        in_prefetch[0] = True
        try:
            return real_prefetch(self, e)
        finally:
            in_prefetch[0] = False

    monkeypatch.setattr(swap.SwapEngine, "prefetch", prefetch)
    monkeypatch.setattr(
        swap, "resize", lambda st, n: (fail if in_prefetch[0] else fail.real)(st, n)
    )
    rt = Runtime(plan, measure_memory=False)
    assert train_mismatches("mlp", rt) == []
    assert fail.raised == 3  # three prefetches met the cap; their back-accesses restored
    assert sum(s.evictions for s in rt.report.iterations) > 0


def test_a_replay_that_meets_the_cap_gives_back_prefetches_and_retries(monkeypatch):
    from capuchin.runtime.guards.lru import BudgetGuard
    from capuchin.runtime.recompute import RecomputeEngine
    from capuchin.runtime.swap import SwapEngine

    plan = hand_plan(
        Problem.from_trace(load_trace(TRACES / "transformer.trace.parquet")),
        "hybrid",
        limit=12,
        trigger_lead=60,
    )
    real, real_unprefetch, real_prefetch = (
        RecomputeEngine.replay,
        SwapEngine.unprefetch,
        SwapEngine.prefetch,
    )
    engines, calls = [], {"raised": 0, "freed": 0}

    def prefetch(self, e):
        if self not in engines:
            engines.append(self)
        return real_prefetch(self, e)

    def replay(self, *a, **k):  # the cap is met while a prefetch is in flight
        if not calls["raised"] and any(x.prefetched for x in engines):
            calls["raised"] += 1
            raise torch.OutOfMemoryError("emulated CUDA out of memory at the cap")
        return real(self, *a, **k)

    def unprefetch(self, need, protect):
        got = real_unprefetch(self, need, protect)
        calls["freed"] += got
        return got

    monkeypatch.setattr(SwapEngine, "prefetch", prefetch)
    monkeypatch.setattr(RecomputeEngine, "replay", replay)
    monkeypatch.setattr(SwapEngine, "unprefetch", unprefetch)
    # the guard finds nothing to evict (parameters and optimizer state would do otherwise): the
    # room must come from a prefetch given back
    monkeypatch.setattr(BudgetGuard, "on_oom", lambda self, keys, need=1: False)
    rt = Runtime(plan, measure_memory=False)
    assert train_mismatches("transformer", rt) == []
    assert calls["raised"] == 1 and calls["freed"] > 0  # room came from a prefetch given back


def test_a_dynamic_replay_that_meets_the_cap_evicts_and_retries(monkeypatch):
    from capuchin.runtime.recompute import RecomputeEngine

    real = RecomputeEngine.replay
    calls = {"n": 0}

    def replay(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.OutOfMemoryError("emulated CUDA out of memory at the cap")
        return real(self, *a, **k)

    monkeypatch.setattr(RecomputeEngine, "replay", replay)
    peak = Problem.from_trace(load_trace(TRACES / "mlp.trace.parquet")).peak_bytes
    rt = Runtime(budget_bytes=peak // 2, remat="recompute", measure_memory=False)
    assert train_mismatches("mlp", rt) == []
    assert calls["n"] > 1 and sum(s.recomputed_ops for s in rt.report.iterations) > 0
