"""Dynamic padding with two recurring batch shapes (tests/frameworks/dynamic_pad.py pads to 24 at
odd steps, to 20 at even ones): the planner makes one plan per recurring shape within the plan's
``kinds`` (Note [Shape kinds] in planner/api.py), and the runtime follows the plan of each
batch's shape at every batch (Note [Shape kinds at run time] in runtime/tracker.py): no
iteration diverges, every one carries out its kind's evictions within the budget, bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
from capuchin.planner.api import make_plan, shape_kinds
from capuchin.planner.build import build_plan
from capuchin.planner.problem import Problem
from capuchin.runtime.engine import Runtime
from capuchin.testing.training import (
    FIXED_BANDWIDTH,
    run_example,
    state_mismatches,
    with_fixed_costs,
)
from capuchin.tracer.script import trace_script
from capuchin.tracer.summary import iteration_kinds, summarize

PAD = Path(__file__).resolve().parent / "frameworks" / "dynamic_pad.py"


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = trace_script(
        PAD,
        ["--steps", "6"],
        output=tmp_path_factory.mktemp("shape_kinds") / "t.parquet",
        iterations=4,
        log=lambda m: None,
        plain_steps=0,
    )
    return with_fixed_costs(path)  # Note [Fixed op costs]


def test_recurring_shapes_are_kinds_of_their_own(trace):
    assert not trace.meta.regular  # the same op names, other shapes
    assert iteration_kinds(trace) == [("train", [1, 2, 3, 4])]
    # padded to 20 at iterations 2 and 4, to 24 at 1 and 3; within a bucket the samples'
    # lengths differ (the collate copies' shapes), which tells no kind apart
    assert shape_kinds(trace, iteration_kinds(trace)) == [("train", [2, 4]), ("kind1", [1, 3])]
    # ``capuchin show`` lists the kinds ``capuchin plan`` plans
    assert summarize(trace).kinds == {"train": [2, 4], "kind1": [1, 3]}


def test_every_batch_follows_the_plan_of_its_shape(trace, capsys):
    plan = make_plan(trace, "60%", policy="capuchin", bandwidth=FIXED_BANDWIDTH)  # no --iteration
    assert [k.kind for k in plan.kinds] == ["kind1"]
    assert plan.decisions and plan.kinds[0].decisions
    args = ["--steps", "11"]
    rt = Runtime(plan, measure_memory=True)
    got = run_example(PAD, args, rt)
    assert state_mismatches(run_example(PAD, args), got) == []
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
    assert len(its) == 10
    assert [(s.iteration, s.diverged_at) for s in its if s.diverged] == []
    assert [s.kind for s in its] == ["kind1", "train"] * 5  # 24 at odd steps, 20 at even
    for s in its:
        assert s.evictions > 0 and s.passive_evictions == 0, s
        assert s.peak_bytes <= plan.budget_bytes, (s.iteration, s.peak_bytes / plan.budget_bytes)
    # every batch of a shape carries out its kind's plan in full (from iteration 2 on: the
    # first planned one follows iteration 0, which no plan guided); a switch to the other kind
    # at a sample copy of a coincident length and back lost one eviction in iteration 8
    evictions = {(s.kind, s.evictions) for s in its if s.iteration >= 2}
    assert len(evictions) == 2, sorted((s.iteration, s.kind, s.evictions) for s in its)
    assert "diverges" not in capsys.readouterr().err


def test_the_main_kind_swaps_out_what_the_other_kind_left_resident(trace, capsys):
    """The 24-long kind's plan made to keep the largest of the optimizer's storages that both
    kinds keep out across the boundary resident instead: after such a batch the 20-long (main)
    kind, which every iteration starts as, swaps it out where the kinds part (without that:
    1.07x the budget in every 20-long batch)."""
    plan = make_plan(trace, "60%", policy="capuchin", bandwidth=FIXED_BANDWIDTH)
    other = plan.kinds[0]
    main_wraps = {d.storage_id for d in plan.decisions if d.wraps}
    both = [d for d in other.decisions if d.wraps and d.storage_id in main_wraps]
    drop = max(both, key=lambda d: d.size_bytes).storage_id
    problem = Problem.from_trace(trace, iteration=other.provenance.iteration)
    kept, _ = build_plan(
        problem.with_bandwidth(10e9, 10e9),
        [d for d in other.decisions if d.storage_id != drop],
        policy="capuchin-less-one",
        budget_bytes=plan.budget_bytes,
    )
    kept.kind = other.kind
    plan.kinds = [kept]
    args = ["--steps", "7"]
    rt = Runtime(plan, measure_memory=True)
    got = run_example(PAD, args, rt)
    assert state_mismatches(run_example(PAD, args), got) == []
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
    assert [(s.iteration, s.kind) for s in its if s.diverged] == []
    ratios = {s.iteration: round(s.peak_bytes / plan.budget_bytes, 3) for s in its}
    assert all(r <= 1.0 for r in ratios.values()), ratios


@pytest.mark.slow
def test_three_shapes_each_start_with_what_their_plan_keeps_out(tmp_path, capsys):
    """Three buckets (20, 24, 28 in turn): the 28-long kind keeps more of the optimizer's state
    out across the iteration boundary than the 20-long one before it; a switch to it swaps
    that out at once, so every batch stays within the budget (Note [Shape kinds at run time])."""
    args = ["--buckets", "3"]
    path = trace_script(
        PAD,
        ["--steps", "9", *args],
        output=tmp_path / "t.parquet",
        iterations=6,
        log=lambda m: None,
        plain_steps=0,
    )
    trace = with_fixed_costs(path)
    kinds = shape_kinds(trace, iteration_kinds(trace))
    assert kinds == [("train", [3, 6]), ("kind1", [2, 5]), ("kind2", [1, 4])]
    plan = make_plan(trace, "60%", policy="capuchin", bandwidth=FIXED_BANDWIDTH)
    wraps = [{d.storage_id for d in p.decisions if d.wraps} for p in (plan, *plan.kinds)]
    assert wraps[2] - wraps[0], "the 28-long kind keeps nothing more out than the 20-long one"
    run = ["--steps", "10", *args]
    rt = Runtime(plan, measure_memory=True)
    got = run_example(PAD, run, rt)
    assert state_mismatches(run_example(PAD, run), got) == []
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
    assert [(s.iteration, s.diverged_at) for s in its if s.diverged] == []
    assert [s.kind for s in its] == ["kind2", "kind1", "train"] * 3
    ratios = {s.iteration: round(s.peak_bytes / plan.budget_bytes, 3) for s in its}
    assert all(r <= 1.0 for r in ratios.values()), ratios
    assert "measured over the budget" not in capsys.readouterr().err
