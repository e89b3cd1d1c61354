"""``CAPUCHIN_VERIFY=1`` keeps its snapshots in host memory the device's allocator does not count
(review defect 12, Note [Snapshots on the host] in runtime/backend.py). On CUDA a device copy
counts against the cap set for the budget; on the CPU "device" a copy through PyTorch's
allocator is what the runtime measures as the device's peak. So with the check on, a plan's
measured peak must be the peak without it."""

from __future__ import annotations

import pytest
from capuchin.planner.problem import Problem
from capuchin.runtime.engine import Runtime
from capuchin.testing.training import TRACES, hand_plan, train_mismatches
from capuchin.tracer.reader import load_trace

pytestmark = pytest.mark.emulated


@pytest.fixture(autouse=True)
def _swap_outs_complete_at_once(monkeypatch):
    """Every swap-out copies on the calling thread, so that both runs free each storage at the
    same op whatever the copy thread's speed (the peaks are then comparable exactly)."""
    import capuchin.runtime.backend as backend

    monkeypatch.setattr(backend, "INLINE_COPY_MAX_BYTES", 1 << 40)


def _peaks(monkeypatch, plan, verify: bool) -> list[int]:
    monkeypatch.setenv("CAPUCHIN_VERIFY", "1" if verify else "0")
    rt = Runtime(plan, measure_memory=True)
    assert rt.verify is verify
    assert train_mismatches("mlp", rt) == []
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
    assert its and all(s.evictions > 0 for s in its)
    return [s.peak_bytes for s in its]


def test_verify_snapshots_do_not_count_against_the_device(monkeypatch):
    plan = hand_plan(
        Problem.from_trace(load_trace(TRACES / "mlp.trace.parquet")), "hybrid", limit=8
    )
    snapshots = sum(d.size_bytes for d in plan.decisions)
    plain = _peaks(monkeypatch, plan, verify=False)
    checked = _peaks(monkeypatch, plan, verify=True)
    # a snapshot counted on the device would raise the peak by up to every evicted storage's
    # bytes; the tolerance is far below the smallest of them
    smallest = min(d.size_bytes for d in plan.decisions)
    assert snapshots > 0
    assert max(checked) <= max(plain) + smallest // 4, (plain, checked, smallest)
