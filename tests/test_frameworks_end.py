"""The end of a run: the ops a script runs after its last optimizer step (a final evaluation, a
checkpoint, a printed metric) are no divergence (Note [End of run] in runtime/tracker.py)."""

from __future__ import annotations

from pathlib import Path

from capuchin.planner.api import make_plan
from capuchin.runtime.engine import Runtime
from capuchin.testing.training import run_example, state_mismatches
from capuchin.tracer.script import trace_script

HERE = Path(__file__).resolve().parent / "frameworks"


def test_code_after_the_last_step_is_not_a_divergence(tmp_path, capsys):
    script = HERE / "tail_eval.py"
    trace = trace_script(
        script, ["--steps", "6"], output=tmp_path / "t.parquet", log=lambda m: None
    )
    plan = make_plan(trace, "70%", policy="swap")
    assert plan.decisions, "the plan evicts something"
    capsys.readouterr()
    rt = Runtime(plan)
    got = run_example(script, ["--steps", "4"], rt)
    assert state_mismatches(run_example(script, ["--steps", "4"]), got) == []
    err = capsys.readouterr().err
    assert "diverge" not in err, err
    its = rt.report.iterations
    assert [s.complete for s in its] == [True] * 4 + [False], "the tail is the incomplete last one"
    assert not any(s.diverged for s in its[1:]), [(s.iteration, s.diverged_at) for s in its]
    assert all(s.evictions > 0 for s in its[1:4]), "the plan was followed"
    assert "diverged from the plan: 0" in rt.report.summary()
    assert all(s.peak_bytes <= plan.budget_bytes for s in its[1:4]), (
        [s.peak_bytes for s in its],
        plan.budget_bytes,
    )


def test_a_real_divergence_still_warns_when_its_step_ends_it(tmp_path, capsys):
    """Control: a plan altered to expect another op in the middle of the iteration diverges in
    every steady iteration; the warning comes (once) at the step that ends the first of them."""
    script = HERE / "tail_eval.py"
    trace = trace_script(
        script, ["--steps", "6"], output=tmp_path / "t.parquet", log=lambda m: None
    )
    plan = make_plan(trace, "70%", policy="swap")
    k = len(plan.ops) // 2
    plan.ops[k] = ("aten.sin.default", plan.ops[k][1])  # the plan now expects another op k
    capsys.readouterr()
    rt = Runtime(plan, measure_memory=False)
    got = run_example(script, ["--steps", "4"], rt)
    assert state_mismatches(run_example(script, ["--steps", "4"]), got) == []
    err = capsys.readouterr().err
    assert err.count("diverges from the plan") == 1, err
    assert [s.diverged for s in rt.report.iterations[1:4]] == [True] * 3


def test_a_foreign_plan_is_still_refused(tmp_path):
    """A plan whose first ops differ is refused (at the step that ends the first checked
    iteration, so that a script ending right after its first step is not refused)."""
    import pytest
    from capuchin.errors import PlanFormatError

    script = HERE / "tail_eval.py"
    trace = trace_script(
        script, ["--steps", "6"], output=tmp_path / "t.parquet", log=lambda m: None
    )
    plan = make_plan(trace, "70%", policy="swap")
    plan.ops[1] = ("aten.sin.default", plan.ops[1][1])
    with pytest.raises(PlanFormatError, match="another script"):
        run_example(script, ["--steps", "4"], Runtime(plan, measure_memory=False))
    # one step and then the tail: iteration 1 is the tail only, and nothing is refused
    rt = Runtime(plan, measure_memory=False)
    run_example(script, ["--steps", "1"], rt)
    assert [s.complete for s in rt.report.iterations] == [True, False]
