"""planner/views.py: several plans side by side (DataFrames and one plot)."""

from __future__ import annotations

import pytest
from capuchin.planner.api import make_plan
from capuchin.planner.problem import Problem
from capuchin.planner.views import memory_curves, plans_frame, plot_plans
from capuchin.tracer.synthetic import trace_from_ops, transformer_ops


@pytest.fixture(scope="module")
def problem():
    ops, sizes, persistent = transformer_ops(2, 12)
    return Problem.from_trace(trace_from_ops(ops, sizes, persistent=persistent))


def test_a_sequence_of_plans_is_named_by_policy_and_budget(problem):
    a = make_plan(problem, int(problem.peak_bytes * 0.8), "capuchin")
    b = make_plan(problem, int(problem.peak_bytes * 0.6), "capuchin")
    df = plans_frame([a, b, a])
    assert len(df) == 3 and df.index.is_unique
    assert df.index[2] == df.index[0] + " #2"
    assert list(df["budget_bytes"]) == [a.budget_bytes, b.budget_bytes, a.budget_bytes]
    assert list(df["predicted_peak_bytes"]) == [
        a.predictions.predicted_peak_bytes,
        b.predictions.predicted_peak_bytes,
        a.predictions.predicted_peak_bytes,
    ]


def test_curves_are_the_simulations_and_the_baseline(problem, tmp_path):
    plans = {
        "cap": make_plan(problem, "60%", "capuchin"),
        "rec": make_plan(problem, "60%", "recompute", allow_infeasible=True),
    }
    curves = memory_curves(plans, problem)
    assert list(dict.fromkeys(curves["plan"])) == ["baseline", "cap", "rec"]
    peaks = curves.groupby("plan")["live_bytes"].max()
    assert peaks["baseline"] == problem.peak_bytes
    assert (
        peaks["cap"] == plans["cap"].predictions.predicted_peak_bytes <= plans["cap"].budget_bytes
    )
    assert peaks["rec"] == plans["rec"].predictions.predicted_peak_bytes
    pytest.importorskip("matplotlib")
    out = plot_plans(plans, tmp_path / "m.png", problem)
    assert out.stat().st_size > 1000
