"""The emulated device's timeline (capuchin/testing/emulated.py): the host runs ahead of the
device, copies and events complete later. On it, a prefetch's lateness is judged on the device's
timeline, not at dispatch (review defect 7, Note [Lateness on the device's timeline] in
runtime/swap.py)."""

from __future__ import annotations

import weakref

import pytest
import torch
from capuchin.runtime.report import IterationStats
from capuchin.runtime.state import Entry, Reason, Residency
from capuchin.runtime.swap import SwapEngine
from capuchin.testing.emulated import EmulatedBackend, EmulatedTimeline

pytestmark = pytest.mark.emulated


def test_copies_complete_on_the_device_not_at_dispatch():
    be = EmulatedBackend()
    t = torch.arange(1024, dtype=torch.float32)
    want = t.clone()
    st = t.untyped_storage()
    buf = be.host_buffer(st.nbytes())
    out = be.copy_out(st, buf)
    assert not out.done() and not be.free_after_copy_out(st, out)  # the host ran ahead
    assert not torch.equal(buf.view(torch.float32), want)  # nothing moved yet
    be.timeline.advance(5)
    assert out.done() and be.free_after_copy_out(st, out) and st.nbytes() == 0
    st.resize_(1024 * 4)
    st.copy_(torch.zeros(1024).untyped_storage())
    cin = be.copy_in(buf, st, after=out)
    assert not cin.done()
    be.wait_compute(cin)  # the consumer waits for the copy: then the bytes are there
    assert torch.equal(t, want)


def _late(copy_cost: int, ops_between: int) -> int:
    """Late prefetches counted for one prefetch of ``copy_cost`` ticks issued ``ops_between``
    one-tick ops before its back-access, on a device the host runs ahead of."""
    be = EmulatedBackend(EmulatedTimeline(), copy_cost=copy_cost)
    swap = SwapEngine(be)
    swap.stats = IterationStats(iteration=1)
    t = torch.randn(4096)
    st = t.untyped_storage()
    e = Entry("s", weakref.ref(st), st.nbytes(), True, Reason.PLANNED)
    swap.evict_now(e)  # synchronous: the device is given the time
    assert e.state is Residency.OUT
    swap.prefetch(e)  # the in-trigger
    be.timeline.compute(ops_between)  # the host issues the ops up to the back-access
    assert not e.in_copy.done()  # at dispatch the host never sees the copy complete
    swap.restore(e, True)  # the back-access
    swap.judged_late()  # the iteration's end
    be.close()
    return swap.stats.late_prefetches


def test_a_prefetch_done_before_its_consumer_on_the_device_is_not_late():
    assert _late(copy_cost=2, ops_between=5) == 0


def test_a_prefetch_done_after_its_consumer_on_the_device_is_late():
    assert _late(copy_cost=10, ops_between=3) == 1


def test_a_plan_trains_bitwise_when_copies_complete_late(monkeypatch):
    """The whole runtime on the emulated timeline: every swap-out and prefetch completes only
    when the host waits for it, so a missing wait (``wait_compute``, the swap-out's completion
    before its free) reads stale or unwritten bytes and the final state differs."""
    import capuchin.runtime.engine as engine
    from capuchin.planner.problem import Problem
    from capuchin.runtime.engine import Runtime
    from capuchin.runtime.memory import memory_for
    from capuchin.testing.training import TRACES, hand_plan, train_mismatches
    from capuchin.tracer.reader import load_trace

    made = []

    def emulated(device, plan=None):
        be = EmulatedBackend(EmulatedTimeline(), copy_cost=3)
        be.memory = memory_for(be.device, plan)
        made.append(be)
        return be

    monkeypatch.setattr(engine, "backend_for", emulated)
    plan = hand_plan(Problem.from_trace(load_trace(TRACES / "mlp.trace.parquet")), "swap", limit=6)
    rt = Runtime(plan, measure_memory=False)
    assert train_mismatches("mlp", rt) == []
    its = [s for s in rt.report.iterations if s.iteration >= 1]
    assert sum(s.evictions for s in its) > 0 and sum(s.swapped_in_bytes for s in its) > 0
    assert made and made[0].host_pool_bytes > 0
