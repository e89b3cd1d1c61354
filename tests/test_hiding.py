"""Hidden swaps (planner/hiding.py Note [Hidden swaps]): a simulated plan's replays and stalled
swaps switched to swaps that the simulation hides, and the capuchin policy picking among them
(search.py Note [Hidden swaps, on the grid]). All judged by the simulator."""

from __future__ import annotations

from pathlib import Path

import pytest
from capuchin.planner import hiding, search
from capuchin.planner.hiding import advance, hide
from capuchin.planner.plan import Method
from capuchin.planner.policies import capuchin as cap
from capuchin.planner.problem import Problem
from capuchin.planner.simulator import simulate
from capuchin.tracer.dtr_import import dtr_logs_path
from capuchin.tracer.reader import load_trace

ROOT = Path(__file__).resolve().parent.parent
DTR_ZIP = dtr_logs_path()


def _bundled(name: str) -> Problem:
    return Problem.from_trace(load_trace(ROOT / "traces" / f"{name}.trace.parquet"))


def _time(problem: Problem, decisions, budget: int) -> int:
    sim = simulate(problem, decisions)
    assert sim.peak_bytes <= budget
    return sim.time_ns


def _without_hiding(monkeypatch, problem: Problem, budget: int):
    """The capuchin plan as it was before the hidden variants: none offered."""
    with monkeypatch.context() as m:
        m.setattr(search, "hidden", lambda problem, plans, budget: [])
        return cap.capuchin(problem, budget).decisions


def test_hide_switches_replays_to_hidden_swaps():
    # the recompute-only plan of the bundled MLP at 50%: several replays become swaps whose
    # copies the channels hide, within the plan's own peak
    p = _bundled("mlp")
    budget = int(p.peak_bytes * 0.5)
    ds = list(cap.recompute_only(p, budget).decisions)
    sim = simulate(p, ds)
    assert sim.recompute_ns > 0
    got, gsim = hide(p, ds, sim, sim.peak_bytes)
    assert gsim.peak_bytes <= sim.peak_bytes
    assert gsim.time_ns < sim.time_ns
    assert simulate(p, got).time_ns == gsim.time_ns
    before = {d.storage_id: d for d in ds}
    switched = [d for d in got if d is not before[d.storage_id]]
    assert switched and all(d.method == Method.SWAP for d in switched)
    for d in switched:  # a prefetch inside the gap, nothing else changed
        b = before[d.storage_id]
        assert (d.evict_op, d.back_op) == (b.evict_op, b.back_op)
        assert d.evict_op < d.trigger_op < d.back_op
    # deterministic, and the input back (the same objects) when nothing helps
    again, asim = hide(p, ds, sim, sim.peak_bytes)
    assert again == got and asim.time_ns == gsim.time_ns
    fixed, fsim = hide(p, got, gsim, gsim.peak_bytes)
    assert fsim.time_ns <= gsim.time_ns and fsim.peak_bytes <= gsim.peak_bytes
    none, nsim = hide(p, [], simulate(p, []), p.peak_bytes)
    assert none == [] and nsim.time_ns == p.time_ns


def test_hide_keeps_to_its_bound():
    # a bound below the problem's floor: no plan fits it, so the plan stays (unbounded, the
    # plan's replays become hidden swaps: test_hide_switches_replays_to_hidden_swaps)
    p = _bundled("mlp")
    budget = int(p.peak_bytes * 0.5)
    ds = list(cap.recompute_only(p, budget).decisions)
    sim = simulate(p, ds)
    got, gsim = hide(p, ds, sim, p.floor_bytes() - 1)
    assert got is ds and gsim is sim


def _on_demand(p: Problem, frac: float):
    """The swap-only plan at ``frac`` of the peak with every in-trigger dropped: each swap
    restored on demand at its back-access, so each stalls."""
    from capuchin.planner.plan import Decision

    ds = [
        Decision(d.storage_id, Method.SWAP, d.size_bytes, d.evict_op, d.back_op)
        for d in cap.swap_only(p, int(p.peak_bytes * frac)).decisions
        if d.method == Method.SWAP and not d.wraps
    ]
    sim = simulate(p, ds)
    assert sim.stall_ns > 0
    return ds, sim


def test_advance_moves_stalled_prefetches_earlier_within_the_bound():
    # Note [Partly hidden swaps]: the stalled swaps' in-triggers move earlier together while
    # the simulation gets faster within the bound
    p = _bundled("mlp")
    ds, sim = _on_demand(p, 0.5)
    got, gsim = advance(p, ds, sim, sim.peak_bytes)
    assert gsim.peak_bytes <= sim.peak_bytes and gsim.time_ns < sim.time_ns
    assert gsim.stall_ns < sim.stall_ns
    assert simulate(p, got).time_ns == gsim.time_ns
    moved = [(a, b) for a, b in zip(ds, got, strict=True) if a is not b]
    assert moved
    for a, b in moved:  # only the in-trigger changed, to an op inside the gap
        assert (b.storage_id, b.method, b.evict_op, b.back_op) == (
            a.storage_id,
            a.method,
            a.evict_op,
            a.back_op,
        )
        assert a.trigger_op is None and b.evict_op < b.trigger_op < b.back_op
    again, asim = advance(p, ds, sim, sim.peak_bytes)
    assert again == got and asim.time_ns == gsim.time_ns  # deterministic
    # a bound the moves cannot keep (below the plan's peak): the input back, the same objects
    same, ssim = advance(p, ds, sim, sim.peak_bytes - 1)
    assert same is ds and ssim is sim


def test_hide_advances_the_swaps_it_leaves_stalled(monkeypatch):
    # hide ends with advance: without it the stalled swaps' plan is slower
    p = _bundled("mlp")
    ds, sim = _on_demand(p, 0.5)
    with_advance = hide(p, ds, sim, sim.peak_bytes)[1].time_ns
    monkeypatch.setattr(hiding, "ADVANCE_STEPS", ())
    without = hide(p, ds, sim, sim.peak_bytes)[1].time_ns
    assert with_advance < without


@pytest.mark.parametrize(
    "name, frac", [("mlp", 0.5), pytest.param("transformer", 0.6, marks=pytest.mark.slow)]
)
def test_capuchin_faster_with_hidden_swaps(monkeypatch, name, frac):
    # bundled MLP at 50%: +3.66% of the iteration before, +2.26% with the hidden variants;
    # bundled transformer at 60%: +10.26% before, +8.66%
    p = _bundled(name)
    budget = int(p.peak_bytes * frac)
    old = _time(p, _without_hiding(monkeypatch, p, budget), budget)
    new = _time(_bundled(name), cap.capuchin(_bundled(name), budget).decisions, budget)
    assert new < old


@pytest.mark.slow
def test_unet_at_60_percent(monkeypatch, tmp_path):
    # DTR U-Net at 60% (docs/planner.md, Lower bound): 36.42 ms above the baseline without the
    # hidden variants on the 39-step target grid, 17.75 ms with them (a local search found
    # 13.49 ms)
    if not DTR_ZIP.exists():
        pytest.skip("DTR logs not available")
    from capuchin.tracer.dtr_import import import_dtr_log

    path = import_dtr_log(f"{DTR_ZIP}/unet", tmp_path / "unet.trace.parquet")

    def fresh() -> Problem:
        return Problem.from_trace(load_trace(path))

    p = fresh()
    budget = int(p.peak_bytes * 0.6)
    old = _time(p, _without_hiding(monkeypatch, p, budget), budget) - p.time_ns
    q = fresh()
    new = _time(q, cap.capuchin(q, budget).decisions, budget) - q.time_ns
    assert old == pytest.approx(36.42e6, rel=0.01)
    assert new < 0.9 * old
