"""Phases by the autograd engine (Note [Phases by the autograd engine] in tracer/hooks.py): a
closure-based optimizer step (Lightning's automatic optimization, LBFGS) runs the script's forward
and backward inside ``optimizer.step(closure)``; they are labelled forward and backward, each
iteration starts at its closure, and training under a plan stays bitwise identical."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from capuchin.planner.api import make_plan
from capuchin.planner.problem import Problem
from capuchin.runtime.engine import Runtime
from capuchin.testing.training import hand_plan, run_example, state_mismatches
from capuchin.tracer.reader import load_trace
from capuchin.tracer.script import trace_script

HERE = Path(__file__).resolve().parent / "frameworks"


def _runs(trace, iteration=None):
    ops = trace.ops
    it = ops.iteration.max() if iteration is None else iteration
    names = ops[ops.iteration == it]
    return [(k, len(list(g))) for k, g in itertools.groupby(names.phase)], names


def _train_under_plan(script, plan, steps):
    rt = Runtime(plan)
    got = run_example(script, ["--steps", str(steps)], rt)
    assert state_mismatches(run_example(script, ["--steps", str(steps)]), got) == []
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
    return rt, its


@pytest.mark.slow
def test_lightning_trainer_phases_and_bitwise_training(tmp_path):
    pytest.importorskip("lightning")
    script = HERE / "lightning_mlp.py"
    trace = load_trace(
        trace_script(script, ["--steps", "6"], output=tmp_path / "t.parquet", log=lambda m: None)
    )
    runs, ops = _runs(trace)
    phases = [p for p, _ in runs]
    assert phases[0] == "forward" and phases[-1] == "optimizer", runs
    assert "backward" in phases, runs
    assert dict(ops.groupby("phase").size())["backward"] >= 50
    # the model's matmuls of the training step (inside the closure) are forward
    fwd = ops[ops.phase == "forward"]
    assert (fwd.op_name == "aten.addmm.default").sum() == 8
    assert trace.meta.regular
    plan = make_plan(trace, "70%")
    assert plan.decisions
    rt, its = _train_under_plan(script, plan, 5)
    assert len(its) == 4 and not any(s.diverged for s in its)
    assert all(s.evictions > 0 for s in its)
    assert all(s.peak_bytes <= plan.budget_bytes for s in its), (
        [s.peak_bytes for s in its],
        plan.budget_bytes,
    )


@pytest.mark.slow
def test_lbfgs_phases_and_bitwise_training(tmp_path):
    script = HERE / "lbfgs_mlp.py"
    # LBFGS's first steps fill its history: the iterations become regular after three of them
    trace = load_trace(
        trace_script(
            script, ["--steps", "10"], output=tmp_path / "t.parquet", warmup=3, log=lambda m: None
        )
    )
    runs, _ = _runs(trace)
    # max_iter=3: three closure calls per step, each forward then backward, then the update
    assert [p for p, _ in runs] == ["forward", "backward", "optimizer"] * 3, runs
    assert trace.meta.regular
    # A hand plan that swaps every activation with a back-access: the capuchin policy also picks
    # LBFGS's history (resident at the iteration start, not optimizer state to the tracer), which
    # the runtime refuses to evict (Note [Storage-level eviction] in runtime/state.py).
    problem = Problem.from_trace(trace)
    # The plan's budget is its own predicted peak: late-prefetch feedback may move in-triggers
    # earlier up to the plan's budget (Note [Late prefetch feedback] in runtime/swap.py), and
    # with the trace's peak as the budget, how far it moves them depends on the host's load.
    budget = hand_plan(problem, "swap").predictions.predicted_peak_bytes
    plan = hand_plan(problem, "swap", budget_bytes=budget)
    assert plan.budget_bytes == budget
    assert plan.decisions and budget < 0.9 * problem.peak_bytes
    rt, its = _train_under_plan(script, plan, 7)
    steady = [s for s in its if s.iteration >= 3]
    assert len(steady) == 4 and not any(s.diverged for s in steady)
    assert all(s.evictions == len(plan.decisions) and s.refused == 0 for s in steady)
    assert all(s.peak_bytes <= 1.02 * budget for s in steady), (
        [s.peak_bytes for s in steady],
        budget,
    )
