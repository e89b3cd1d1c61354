"""`capuchin plan` and `capuchin show PLAN` through click's CliRunner, on synthetic trace files."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from capuchin.cli import main
from capuchin.planner.plan import load_plan
from capuchin.planner.simulator import simulate_plan
from capuchin.tracer.reader import write_trace
from capuchin.tracer.synthetic import trace_from_ops, transformer_ops
from click.testing import CliRunner


@pytest.fixture
def trace_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ops, sizes, persistent = transformer_ops(2, 12, hidden_bytes=1 << 16)
    tr = trace_from_ops(ops, sizes, persistent=persistent, bandwidth_bytes_per_s=12e9, iterations=2)
    path = tmp_path / "traces" / "tf.trace.parquet"
    write_trace(tr.events, tr.meta, path)
    return path


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_plan_writes_default_output_and_summary(trace_file):
    r = run("plan", trace_file, "--budget", "50%")
    assert r.exit_code == 0, r.output
    assert "peak" in r.output and "fits" in r.output and "tf.plan.json" in r.output
    plan = load_plan("tf.plan.json")  # <trace stem>.plan.json in the current directory
    assert plan.predictions.feasible and plan.decisions
    assert plan.provenance.iteration == 1  # the steady (last) iteration


def test_plan_json_keys_and_force(trace_file):
    r = run("plan", trace_file, "--budget", "60%", "-o", "p.json", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    for key in (
        "policy",
        "budget_bytes",
        "baseline_peak_bytes",
        "predicted_peak_bytes",
        "predicted_overhead",
        "swap_count",
        "recompute_count",
    ):
        assert key in doc
    assert doc["predicted_peak_bytes"] <= doc["budget_bytes"] < doc["baseline_peak_bytes"]
    assert (
        doc["predicted_overhead"] >= 0
    )  # includes the runtime's per-op cost: large on a tiny trace
    r = run("plan", trace_file, "--budget", "60%", "-o", "p.json")
    assert r.exit_code == 1 and "--force" in r.output
    r = run(
        "plan",
        trace_file,
        "--budget",
        "70%",
        "-o",
        "p.json",
        "--force",
        "--policy",
        "recompute",
        "--json",
    )
    assert r.exit_code == 0 and json.loads(r.output)["swap_count"] == 0


def test_infeasible_budget_exits_2_naming_smallest(trace_file):
    r = run("plan", trace_file, "--budget", "1K", "-o", "p.json")
    assert r.exit_code == 2
    assert "smallest budget" in r.output
    assert not (trace_file.parent.parent / "p.json").exists()


def test_budget_above_peak_says_nothing_to_evict(trace_file):
    r = run("plan", trace_file, "--budget", "8GiB", "-o", "p.json")
    assert r.exit_code == 0 and "nothing to evict" in r.output
    assert load_plan("p.json").decisions == []


def test_unknown_policy_and_bad_budget(trace_file):
    r = run("plan", trace_file, "--budget", "50%", "--policy", "nope")
    assert r.exit_code == 1 and "capuchin" in r.output and "recompute" in r.output
    r = run("plan", trace_file, "--budget", "lots")
    assert r.exit_code == 1 and "budget" in r.output


def test_bandwidth_override_is_recorded(trace_file):
    r = run("plan", trace_file, "--budget", "50%", "--bandwidth", "1GB/s", "-o", "p.json")
    assert r.exit_code == 0, r.output
    assert load_plan("p.json").provenance.bandwidth_h2d_bytes_per_s == 1e9


def test_irregular_trace_needs_iteration(trace_file, tmp_path):
    from capuchin.tracer.reader import load_trace

    tr = load_trace(trace_file)
    bad = tmp_path / "irr.trace.parquet"
    write_trace(
        tr.events,
        replace(
            tr.meta,
            regular=False,
            first_divergence={"iteration": 1, "op_index": 3, "expected": "a", "got": "b"},
        ),
        bad,
    )
    r = run("plan", bad, "--budget", "50%")
    assert r.exit_code == 1 and "--iteration" in r.output and "differ" in r.output
    r = run("plan", bad, "--budget", "50%", "--iteration", "0")
    assert r.exit_code == 0, r.output
    r = run("plan", bad, "--budget", "50%", "--iteration", "7", "--force")
    assert r.exit_code == 1 and "no iteration 7" in r.output


def test_show_plan_plot_and_chrome(trace_file):
    assert run("plan", trace_file, "--budget", "50%").exit_code == 0
    r = run("show", "tf.plan.json", "--plot", "m.png", "--chrome", "c.json")
    assert r.exit_code == 0, r.output
    with open("m.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open("c.json") as f:
        doc = json.load(f)
    ev = doc["traceEvents"]
    threads = {e["args"]["name"] for e in ev if e.get("name") == "thread_name"}
    assert len(threads) == 3
    assert any(e["ph"] == "C" for e in ev)
    assert any(e["ph"] == "X" and e["tid"] == 2 for e in ev)  # a swap-out on the d2h stream
    r = run("show", "tf.plan.json", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["policy"] == "capuchin"


def test_planning_imports_neither_torch_nor_matplotlib():
    import subprocess
    import sys

    code = (
        "import sys, capuchin.planner.api, capuchin.planner.report, capuchin.planner.registry"
        " as r; r.available(); print('torch' in sys.modules, 'matplotlib' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True
    ).stdout.strip()
    assert out == "False False"


BUNDLED = sorted((Path(__file__).resolve().parent.parent / "traces").glob("*.trace.parquet"))


def test_bundled_traces_exist():
    assert {p.name for p in BUNDLED} >= {
        "cnn.trace.parquet",
        "mlp.trace.parquet",
        "transformer.trace.parquet",
    }


@pytest.mark.parametrize(
    "trace",
    [
        pytest.param(p, marks=pytest.mark.slow) if p.name.startswith("transformer") else p
        for p in BUNDLED
    ],
    ids=lambda p: p.name,
)
def test_plan_bundled_trace_at_half_peak(trace, tmp_path):
    r = run("plan", trace, "--budget", "50%", "-o", tmp_path / "p.json", "--json")
    assert r.exit_code in (0, 2), r.output
    if r.exit_code == 2:  # the message names a budget that then works
        import re

        best = re.search(r"smallest budget it reaches is [^(]*\((\d+) B\)", r.output)
        assert best, r.output
        r = run("plan", trace, "--budget", best.group(1), "-o", tmp_path / "p.json", "--json")
        assert r.exit_code == 0, r.output
        return
    doc = json.loads(r.output)
    assert doc["predicted_peak_bytes"] <= doc["budget_bytes"] == doc["baseline_peak_bytes"] // 2
    plan = load_plan(tmp_path / "p.json")
    assert simulate_plan(plan, trace).peak_bytes == doc["predicted_peak_bytes"]
