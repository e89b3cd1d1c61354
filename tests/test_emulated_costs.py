"""Dynamic mode's costs on the device's timeline (review defect 9, Note [Costs on the device's
timeline] in runtime/backend.py). On the emulated device every op takes 1000 ticks (1 ms) of device time
and one tick of the host's (its launch), a copy takes one tick on its stream, and the host waits
for a copy only by draining the compute queued before it. Timed on the host, an op cost its
launch and a swap the whole queue's drain, so dynamic mode's ``remat="auto"`` dropped and
replayed storages whose replay is far dearer on the device than their swap; timed on the
device, it swaps them."""

from __future__ import annotations

import pytest
from capuchin.planner.problem import Problem
from capuchin.runtime.engine import Runtime
from capuchin.testing.emulated import EmulatedBackend, EmulatedCompute, EmulatedTimeline
from capuchin.testing.training import TRACES, reference, train_mismatches
from capuchin.tracer.reader import load_trace

pytestmark = pytest.mark.emulated

OP_TICKS = 1000  # device time of every op (a tick is 1 µs)
COPY_TICKS = 1  # device time of every copy, on its stream


def _run(monkeypatch):
    import capuchin.runtime.engine as engine
    import capuchin.runtime.guards.dtr as dtr
    from capuchin.runtime.memory import memory_for

    tl = EmulatedTimeline(launch=1)
    made = []

    def emulated(device, plan=None):
        be = EmulatedBackend(tl, copy_cost=COPY_TICKS)
        be.memory = memory_for(be.device, plan)
        made.append(be)
        return be

    monkeypatch.setattr(engine, "backend_for", emulated)
    monkeypatch.setattr(dtr, "seconds", tl.host_s)  # the host's clock: launches and waits
    reference("mlp", ())  # plain training first, outside the emulated compute
    peak = Problem.from_trace(load_trace(TRACES / "mlp.trace.parquet")).peak_bytes
    rt = Runtime(budget_bytes=peak // 2, device="cpu", remat="auto", measure_memory=False)
    with EmulatedCompute(tl, OP_TICKS):
        assert train_mismatches("mlp", rt) == []
    assert made and tl.now > 0
    return rt


def test_dynamic_mode_weighs_replays_and_swaps_by_device_time(monkeypatch):
    rt = _run(monkeypatch)
    its = rt.report.iterations
    assert sum(s.dynamic_swaps for s in its) > 0
    assert sum(s.dynamic_drops for s in its) == 0, [s.dynamic_drops for s in its]


def test_a_swaps_cost_is_its_copy_not_the_queue_it_waited_for():
    from capuchin.runtime.guards.dtr import DynamicGuard

    tl = EmulatedTimeline()
    be = EmulatedBackend(tl, copy_cost=3)
    tl.compute(40)  # queued compute the copy waits behind
    g = DynamicGuard.__new__(DynamicGuard)
    g.dclock = be.clock
    import torch

    st = torch.zeros(256).untyped_storage()
    copy = be.copy_out(st, be.host_buffer(st.nbytes()))
    waited = copy.wait()
    assert waited == pytest.approx(43e-6)  # the drain and the copy, on the host
    # 5 µs of host bookkeeping besides the wait: the swap cost that and the copy's 3 ticks
    assert g._copy_time(waited + 5e-6, waited, copy) == pytest.approx(8e-6)
    g.dclock = None  # where the host is the device, its time is the cost
    assert g._copy_time(waited + 5e-6, waited, copy) == pytest.approx(48e-6)
