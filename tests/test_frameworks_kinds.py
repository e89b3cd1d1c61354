"""Iterations of several kinds (Note [Iteration kinds] in planner/api.py and runtime/tracker.py):
a loop that evaluates every other step is planned kind by kind, the runtime follows each
iteration's kind, and training stays bitwise identical within the budget."""

from __future__ import annotations

from pathlib import Path

import pytest
from capuchin.cli import main
from capuchin.planner.api import iteration_kinds, make_plan
from capuchin.planner.plan import load_plan
from capuchin.runtime.engine import Runtime
from capuchin.testing.training import run_example, state_mismatches
from capuchin.tracer.reader import load_trace
from capuchin.tracer.script import trace_script
from click.testing import CliRunner

HERE = Path(__file__).resolve().parent / "frameworks"


@pytest.mark.slow
def test_evaluation_every_other_step_is_planned_and_run_kind_by_kind(tmp_path):
    script = HERE / "eval_loop.py"
    trace = load_trace(
        trace_script(script, ["--steps", "8"], output=tmp_path / "t.parquet", log=lambda m: None)
    )
    assert not trace.meta.regular
    # iteration 2 also runs the evaluation pass of step 1; 1 and 3 only train
    assert iteration_kinds(trace) == [("train", [1, 3]), ("kind1", [2])]
    shown = CliRunner().invoke(main, ["show", str(tmp_path / "t.parquet")])
    assert "kinds      train: iterations [1, 3]; kind1: iterations [2]" in shown.output
    plan = make_plan(trace, "75%")
    assert plan.kind == "train" and [k.kind for k in plan.kinds] == ["kind1"]
    assert plan.decisions and plan.kinds[0].decisions
    path = plan.save(tmp_path / "p.json")
    again = load_plan(path)
    assert [(k.kind, k.provenance.iteration) for k in again.kinds] == [("kind1", 2)]
    shown = CliRunner().invoke(main, ["show", str(path)])
    assert shown.exit_code == 0 and "kind1: iteration 2" in shown.output, shown.output

    rt = Runtime(again)
    got = run_example(script, ["--steps", "8"], rt)
    assert state_mismatches(run_example(script, ["--steps", "8"]), got) == []
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
    assert [s.kind for s in its] == ["train", "kind1"] * 3 + ["train"]
    assert not any(s.diverged for s in its)
    assert all(s.evictions == len(plan.decisions) for s in its if s.kind == "train")
    assert all(s.evictions == len(plan.kinds[0].decisions) for s in its if s.kind == "kind1")
    assert all(s.peak_bytes <= plan.budget_bytes for s in its), (
        [s.peak_bytes for s in its],
        plan.budget_bytes,
    )


def test_iterations_that_all_differ_are_still_refused(tmp_path):
    """Every recorded iteration of its own kind: no kind stands for the others."""
    from capuchin.planner.problem import IrregularTraceError

    script = HERE / "eval_loop.py"
    trace = trace_script(
        script,
        ["--steps", "8", "--eval-every", "1"],
        output=tmp_path / "t.parquet",
        iterations=2,
        warmup=0,
        log=lambda m: None,
    )
    kinds = iteration_kinds(load_trace(trace))
    assert [len(its) for _, its in kinds] == [1, 1]
    with pytest.raises(IrregularTraceError, match="--iteration"):
        make_plan(trace, "75%")


@pytest.mark.slow
def test_hugging_face_trainer_with_evaluation_steps(tmp_path):
    """Trainer(eval_strategy="steps", eval_steps=2): the iteration after every second step also
    evaluates; both kinds are planned and followed, training bitwise identical (every
    parameter, gradient, optimizer state and buffer)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    script = HERE / "hf_trainer_eval.py"
    trace = load_trace(
        trace_script(script, ["--steps", "8"], output=tmp_path / "t.parquet", log=lambda m: None)
    )
    assert iteration_kinds(trace) == [("train", [1, 3]), ("kind1", [2])]
    plan = make_plan(trace, "70%")
    assert plan.decisions and plan.kinds[0].decisions
    rt = Runtime(plan)
    got = run_example(script, ["--steps", "7"], rt)
    ref = run_example(script, ["--steps", "7"])
    assert len(ref) > 100 and state_mismatches(ref, got) == []
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
    assert [s.kind for s in its] == ["train", "kind1"] * 3
    assert not any(s.diverged for s in its) and all(s.evictions > 0 for s in its)
    assert all(s.peak_bytes <= plan.budget_bytes for s in its), (
        [s.peak_bytes for s in its],
        plan.budget_bytes,
    )


@pytest.mark.slow
def test_a_budget_one_kind_cannot_meet_names_the_kind(tmp_path):
    from capuchin.errors import InfeasibleBudgetError

    script = HERE / "eval_loop.py"
    trace = trace_script(
        script, ["--steps", "8"], output=tmp_path / "t.parquet", log=lambda m: None
    )
    with pytest.raises(InfeasibleBudgetError, match=r"^iteration kind 'train' \(iteration 3\): "):
        make_plan(trace, "10%")
