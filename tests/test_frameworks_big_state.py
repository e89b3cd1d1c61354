"""A script whose parameters, gradients and Adam state dominate its memory
(tests/frameworks/big_state.py; the probe's big_state of ../shared/reports/real-scripts.md):
planned from fixed op costs at the smallest budget the planner reaches (near the floor), run
bitwise, every iteration (the first included) within 1.05x the budget and every one over it
named by a warning."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from capuchin.errors import InfeasibleBudgetError
from capuchin.planner.api import load_problem, make_plan
from capuchin.runtime.engine import Runtime
from capuchin.testing.training import (
    FIXED_BANDWIDTH,
    run_example,
    state_mismatches,
    with_fixed_costs,
)
from capuchin.tracer.script import trace_script

from .test_frameworks_real import _named_over_budget

SCRIPT = Path(__file__).resolve().parent / "frameworks" / "big_state.py"
STEPS = 6


def traced_with_fixed_costs(tmp_path):
    """big_state traced (4 steps: 2 recorded, no plain step) and given fixed op costs (Note
    [Fixed op costs]); plan it with ``bandwidth=FIXED_BANDWIDTH``."""
    trace = trace_script(
        SCRIPT,
        ["--steps", "4"],
        output=tmp_path / "t.parquet",
        iterations=2,
        log=lambda m: None,
        plain_steps=0,
    )
    return with_fixed_costs(trace)


@pytest.mark.slow
def test_big_state_at_the_smallest_feasible_budget(tmp_path, capsys):
    loaded = traced_with_fixed_costs(
        tmp_path
    )  # Note [Fixed op costs]: one plan whatever the host's load
    kw = {"policy": "capuchin", "bandwidth": FIXED_BANDWIDTH}
    with pytest.raises(InfeasibleBudgetError) as exc:
        make_plan(loaded, "1%", **kw)
    smallest = exc.value.smallest_feasible_bytes
    plan = make_plan(loaded, str(smallest), **kw)
    peak = plan.predictions.baseline_peak_bytes
    # the state is what must move: the smallest budget is within 5 points of the peak of the
    # floor (45% of the peak; with one decision per storage the planner stopped at 63%), which
    # takes the parameters and Adam moments out in every gap: between their uses within the
    # iteration and across the boundary (Note [A candidate per gap of persistent storages] in
    # planner/policies/capuchin.py)
    floor = load_problem(loaded, bandwidth=FIXED_BANDWIDTH).floor_bytes()
    assert floor < 0.5 * peak, (floor, peak)
    assert plan.budget_bytes <= floor + 0.05 * peak, (plan.budget_bytes, floor, peak)
    assert any(d.wraps for d in plan.decisions), "parameters or Adam state kept out across steps"
    windows = Counter(d.storage_id for d in plan.decisions)
    assert any(n > 1 for n in windows.values()), "no storage out twice an iteration"

    args = ["--steps", str(STEPS)]
    capsys.readouterr()
    rt = Runtime(plan, measure_memory=True)
    got = run_example(SCRIPT, args, rt)
    err = capsys.readouterr().err
    assert state_mismatches(run_example(SCRIPT, args), got) == []
    its = [s for s in rt.report.iterations if s.complete]
    assert [s.iteration for s in its] == list(range(STEPS))
    # every iteration, the first included: iteration 0 follows no plan, and the budget guard
    # keeps the optimizer state it swapped out across its step end (Note [Persistent state
    # under the guard] in runtime/guards/lru.py)
    ratios = {s.iteration: round(s.peak_bytes / plan.budget_bytes, 3) for s in its}
    assert all(r <= 1.05 for r in ratios.values()), ratios
    assert {i for i, r in ratios.items() if r > 1.0} <= _named_over_budget(err), (ratios, err)
    assert all(not s.diverged and s.evictions > 0 for s in its[1:]), ratios
