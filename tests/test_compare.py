"""`capuchin compare`: every policy x budget through the simulator, and the smallest feasible budget."""

from __future__ import annotations

import json

import pytest
from capuchin.cli import main
from capuchin.planner.build import build_plan
from capuchin.planner.compare import compare_policies, evaluate, format_comparison, records_to_json
from capuchin.planner.problem import Problem
from capuchin.planner.registry import available, get_policy
from capuchin.tracer.reader import write_trace
from capuchin.tracer.synthetic import trace_from_ops, transformer_ops
from click.testing import CliRunner

CHEAP = ["capuchin", "dtr", "checkpoint-sqrt", "vdnn"]


def small_trace():
    ops, sizes, persistent = transformer_ops(2, 12)
    return trace_from_ops(ops, sizes, persistent=persistent)


@pytest.fixture(scope="module")
def problem():
    return Problem.from_trace(small_trace())


@pytest.fixture
def trace_file(tmp_path):
    t = small_trace()
    return write_trace(t.events, t.meta, tmp_path / "small.trace.parquet")


def test_records_are_what_the_builder_and_simulator_say(problem):
    result = compare_policies(problem, "90%,60%", policies=CHEAP, search_smallest=False)
    assert [r.policy for r in result.records] == [p for p in CHEAP for _ in range(2)]
    budgets = sorted({r.budget_bytes for r in result.records}, reverse=True)
    assert budgets == [int(problem.peak_bytes * 0.9), int(problem.peak_bytes * 0.6)]
    for r in result.records:
        ds = get_policy(r.policy)(problem, r.budget_bytes).decisions
        plan, sim = build_plan(problem, ds, policy=r.policy, budget_bytes=r.budget_bytes)
        assert r.feasible == (sim.peak_bytes <= r.budget_bytes)
        assert r.predicted_peak_bytes == sim.peak_bytes
        assert r.predicted_overhead == pytest.approx(sim.overhead)
        assert r.decisions == len(plan.decisions)
        assert r.bytes_swapped == sum(
            d.size_bytes for d in plan.decisions if d.method.value == "swap"
        )


def test_smallest_feasible_budget_is_feasible_and_bounded(problem):
    result = compare_policies(problem, "70%", policies=["dtr", "recompute", "vdnn"])
    found = {r.policy: r.smallest_feasible_bytes for r in result.records}
    for policy, b in found.items():
        assert problem.floor_bytes() <= b <= problem.peak_bytes
        assert evaluate(problem, policy, b)[0].feasible
    # vdnn finds no convolution in a transformer: nothing below the baseline peak fits
    assert found["vdnn"] == problem.peak_bytes
    assert found["dtr"] < problem.peak_bytes * 0.7


def test_default_is_every_registered_policy(problem):
    result = compare_policies(problem, "95%", search_smallest=False, time_limit_s=2.0)
    assert {r.policy for r in result.records} == set(available())
    text = format_comparison(result)
    for name in available():
        assert name in text


def test_json_records_and_ilp_gap(problem):
    result = compare_policies(
        problem, "80%", policies=["ilp", "dtr"], search_smallest=False, time_limit_s=3.0
    )
    recs = json.loads(records_to_json(result))
    keys = {
        "policy",
        "budget_bytes",
        "feasible",
        "predicted_peak_bytes",
        "predicted_overhead",
        "solve_time_s",
    }
    for rec in recs:
        assert keys <= set(rec)
    ilp = next(r for r in recs if r["policy"] == "ilp")
    dtr = next(r for r in recs if r["policy"] == "dtr")
    assert "optimality_gap" in ilp and ilp["optimality_gap"] is not None
    assert "optimality_gap" not in dtr


def test_cli_compare_table_and_json(trace_file):
    r = CliRunner().invoke(
        main,
        ["compare", str(trace_file), "--budget", "80%,60%", "--policies", "dtr,checkpoint-sqrt"],
    )
    assert r.exit_code == 0, r.output
    assert "dtr" in r.output and "checkpoint-sqrt" in r.output and "smallest feasible" in r.output
    r = CliRunner().invoke(
        main,
        [
            "compare",
            str(trace_file),
            "--budget",
            "80%",
            "--policies",
            "dtr",
            "--json",
            "--no-search",
        ],
    )
    assert r.exit_code == 0, r.output
    recs = json.loads(r.output)
    assert len(recs) == 1 and recs[0]["policy"] == "dtr" and "smallest_feasible_bytes" in recs[0]


def test_cli_compare_unknown_policy_lists_the_valid_ones(trace_file):
    r = CliRunner().invoke(
        main, ["compare", str(trace_file), "--budget", "80%", "--policies", "lru"]
    )
    assert r.exit_code != 0
    assert "lru" in r.output and "checkpoint-sqrt" in r.output and "dtr" in r.output


def test_frame_and_plans_are_the_records(problem):
    result = compare_policies(
        problem, "90%,60%", policies=["capuchin", "dtr"], search_smallest=False
    )
    df = result.frame
    assert len(df) == len(result.records) == 4
    for r, row in zip(result.records, df.itertuples(), strict=True):
        assert (row.policy, row.budget_bytes, row.feasible) == (
            r.policy,
            r.budget_bytes,
            r.feasible,
        )
        assert row.budget_fraction == r.budget_bytes / problem.peak_bytes
        plan = result.plans[r.policy, r.budget_bytes]
        assert plan.predictions.predicted_peak_bytes == r.predicted_peak_bytes


def test_cli_compare_plot_draws_every_policy_at_the_smallest_budget(trace_file, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "cmp.png"
    r = CliRunner().invoke(
        main,
        [
            "compare",
            str(trace_file),
            "--budget",
            "90%,60%",
            "--policies",
            "capuchin,dtr",
            "--no-search",
            "--plot",
            str(png),
        ],
    )
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in r.output


@pytest.mark.slow
def test_plan_summary_names_the_overhead_compare_shows():
    # `plan` predicts the simulated time plus the runtime's per-op cost (planner/costs.py);
    # `compare` shows the simulated plan alone. The summary splits the one into the other.
    from pathlib import Path

    from capuchin.planner.build import run_policy
    from capuchin.planner.report import format_summary
    from capuchin.tracer.reader import load_trace

    path = Path(__file__).resolve().parent.parent / "traces" / "transformer.trace.parquet"
    p = Problem.from_trace(load_trace(path))
    budget = p.peak_bytes // 2
    plan, _, _ = run_policy(p, "capuchin", budget)
    cost = plan.predictions.runtime_cost_ns
    assert cost > 0  # a CPU trace: the runtime's per-op cost is charged
    (rec,) = compare_policies(p, [budget], policies=["capuchin"], search_smallest=False).records
    lines = format_summary(plan).splitlines()
    assert f"{100 * plan.predictions.predicted_overhead:.2f}%" in lines[2]
    assert lines[3].startswith(f"  = the simulated plan {100 * rec.predicted_overhead:+.2f}%")
    assert f"per-op cost {cost / 1e6:.3f} ms" in lines[3]
    assert "the simulated plan's extra time alone" in format_comparison(
        compare_policies(p, [budget], policies=["capuchin"], search_smallest=False)
    )
