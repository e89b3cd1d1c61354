"""Predictions against the plain step (Note [Plain step] in tracer/record.py, Note [Plain
baseline] in planner/problem.py): the trace field, the scaling of op times, the plan's record of
its basis and the printed lines. Synthetic traces: no wall-clock time in any premise."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from capuchin.cli import main
from capuchin.planner.api import make_plan
from capuchin.planner.compare import compare_policies, format_comparison, records_to_json
from capuchin.planner.plan import Plan, Predictions, load_plan
from capuchin.planner.problem import Problem
from capuchin.planner.report import format_summary
from capuchin.tracer.reader import load_trace, write_trace
from capuchin.tracer.schema import TraceMeta
from capuchin.tracer.synthetic import trace_from_ops, transformer_ops
from click.testing import CliRunner

# a chain whose backward reads the forward's activations again: evictions are possible
OPS = [
    ("f1", 1_000_000, ["X"], ["A"]),
    ("f2", 3_000_000, ["A"], ["B"]),
    ("f3", 2_000_000, ["B"], ["C"]),
    ("b3", 2_000_000, ["C", "B"], ["D"]),
    ("b2", 1_500_000, ["D", "A"], ["E"]),
    ("b1", 500_000, ["E", "X"], ["F"]),
]
SIZES = {"X": 1 << 20, "A": 4 << 20, "B": 4 << 20, "C": 4 << 20, "D": 1 << 20, "E": 1 << 20}
SIZES["F"] = 1 << 20
TRACED_NS = sum(o[1] for o in OPS)  # 10 ms


def _trace(plain_ns=None, device="cpu", **kw):
    tr = trace_from_ops(OPS, SIZES, **kw)
    tr.meta.plain_iteration_ns = plain_ns
    tr.meta.device = device
    return tr


def test_trace_field_round_trips_and_old_traces_load(tmp_path):
    tr = _trace(plain_ns=4_321_987)
    write_trace(tr.events, tr.meta, tmp_path / "new.parquet")
    assert load_trace(tmp_path / "new.parquet").meta.plain_iteration_ns == 4_321_987
    # a trace written before the field existed: its metadata JSON has no such key
    doc = asdict(tr.meta)
    del doc["plain_iteration_ns"]
    old = TraceMeta.from_bytes(json.dumps(doc).encode())
    assert old.plain_iteration_ns is None
    write_trace(tr.events, old, tmp_path / "old.parquet")
    loaded = load_trace(tmp_path / "old.parquet")
    assert loaded.meta.plain_iteration_ns is None
    p = Problem.from_trace(loaded)
    assert (p.time_basis, p.plain_time_ns, p.duration_scale) == ("traced", None, 1.0)
    assert p.time_ns == TRACED_NS


@pytest.mark.parametrize("plain_ns", [4_000_000, 3_333_333])
def test_cpu_op_times_scaled_to_the_plain_step(plain_ns):
    p = Problem.from_trace(_trace(plain_ns=plain_ns))
    factor = plain_ns / TRACED_NS
    assert p.time_basis == "plain-scaled" and p.duration_scale == pytest.approx(factor)
    assert [o.duration_ns for o in p.ops] == [int(round(o[1] * factor)) for o in OPS]
    assert abs(p.time_ns - plain_ns) <= len(OPS)  # one rounding per op
    assert p.overhead_base_ns == plain_ns
    # the baseline timeline follows the scaled durations
    assert list(p.start_ns) == [sum(o.duration_ns for o in p.ops[:k]) for k in range(len(OPS))]


def test_cpu_plain_step_longer_than_the_ops_keeps_them():
    p = Problem.from_trace(_trace(plain_ns=2 * TRACED_NS))
    assert (p.time_basis, p.duration_scale, p.time_ns) == ("plain", 1.0, TRACED_NS)
    assert p.overhead_base_ns == 2 * TRACED_NS


def test_cuda_device_times_are_kept():
    p = Problem.from_trace(_trace(plain_ns=4_000_000, device="cuda"))
    assert (p.time_basis, p.duration_scale, p.time_ns) == ("plain", 1.0, TRACED_NS)
    assert [o.duration_ns for o in p.ops] == [o[1] for o in OPS]


def test_overhead_is_a_fraction_of_the_plain_step():
    kw = dict(baseline_peak_bytes=1, predicted_peak_bytes=1, baseline_time_ns=1000)
    assert Predictions(**kw, predicted_time_ns=1300).predicted_overhead == pytest.approx(0.3)
    pr = Predictions(**kw, predicted_time_ns=1300, time_basis="plain", plain_time_ns=3000)
    assert pr.predicted_overhead == pytest.approx(0.1)


def _tf(plain_ns=None, device="cpu", bandwidth=12e9):
    ops, sizes, persistent = transformer_ops(2, 12, hidden_bytes=1 << 16)
    tr = trace_from_ops(ops, sizes, persistent=persistent, bandwidth_bytes_per_s=bandwidth)
    tr.meta.device = device
    tr.meta.plain_iteration_ns = plain_ns
    return tr


TF_NS = Problem.from_trace(_tf()).time_ns
TF_PLAIN = round(0.4 * TF_NS)


@pytest.mark.parametrize(
    "plain_ns, device, basis",
    [(None, "cpu", "traced"), (TF_PLAIN, "cpu", "plain-scaled"), (TF_PLAIN, "cuda", "plain")],
)
def test_plan_records_its_basis_and_the_summary_names_it(plain_ns, device, basis):
    # on CUDA the copies overlap compute: a slow link so that the plan costs time there too
    bandwidth = 2e8 if device == "cuda" else 12e9
    plan = make_plan(_tf(plain_ns, device, bandwidth), "60%", policy="capuchin")
    pr = plan.predictions
    assert plan.decisions and pr.time_basis == basis and pr.plain_time_ns == plain_ns
    extra = pr.predicted_time_ns - pr.baseline_time_ns
    assert extra > 0
    base = plain_ns if plain_ns is not None else pr.baseline_time_ns
    assert pr.predicted_overhead == pytest.approx(extra / base)
    if basis == "plain-scaled":
        assert abs(pr.baseline_time_ns - TF_PLAIN) <= len(plan.ops)
    else:
        assert pr.baseline_time_ns == TF_NS
    # the JSON keeps the basis; a plan document from before the fields loads as "traced"
    again = Plan.from_json(plan.to_json())
    assert asdict(again.predictions) == asdict(pr)
    doc = json.loads(plan.to_json())
    for k in ("time_basis", "plain_time_ns", "duration_scale"):
        del doc["predictions"][k]
    old = Plan.from_json(json.dumps(doc))
    assert old.predictions.time_basis == "traced" and old.predictions.plain_time_ns is None
    (line,) = [x for x in format_summary(plan).splitlines() if "predicted overhead" in x]
    assert f"{100 * pr.predicted_overhead:.2f}%" in line and "per-op cost" in line
    if basis == "traced":
        assert "of the traced iteration" in line and "no plain step" in line
    else:
        assert f"of the plain step {TF_PLAIN / 1e6:.3f} ms" in line
        assert ("scaled by 0.400" in line) == (basis == "plain-scaled")
        assert any("plain step" in n for n in pr.notes)


@pytest.mark.slow
def test_plan_and_compare_cli_name_the_baseline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tr = _tf(TF_PLAIN)
    write_trace(tr.events, tr.meta, tmp_path / "tf.trace.parquet")
    r = CliRunner().invoke(main, ["plan", "tf.trace.parquet", "--budget", "60%", "-o", "p.json"])
    assert r.exit_code == 0, r.output
    assert f"of the plain step {TF_PLAIN / 1e6:.3f} ms" in r.output
    assert "runtime's per-op cost" in r.output
    plan = load_plan("p.json")
    assert plan.predictions.plain_time_ns == TF_PLAIN
    assert plan.predictions.time_basis == "plain-scaled"
    cmp = compare_policies(tmp_path / "tf.trace.parquet", "60%", policies=["capuchin"])
    text = format_comparison(cmp)
    assert f"overhead: simulated, of the plain step {TF_PLAIN / 1e6:.2f} ms" in text
    assert "without the runtime's per-op cost" in text
    (rec,) = cmp.records
    sim_extra = rec.predicted_overhead * TF_PLAIN
    # the same plan's simulated time, without the runtime cost `plan` adds
    assert sim_extra == pytest.approx(
        plan.predictions.predicted_time_ns
        - plan.predictions.runtime_cost_ns
        - plan.predictions.baseline_time_ns,
        abs=1,
    )


def test_compare_prints_both_figures_and_names_them(tmp_path, monkeypatch):
    # the same plan: 'sim overhead' is the simulated plan alone, 'with runtime' what `capuchin
    # plan` prints (the runtime's per-op cost added)
    monkeypatch.chdir(tmp_path)
    tr = _tf(TF_PLAIN)
    write_trace(tr.events, tr.meta, tmp_path / "tf.trace.parquet")
    cmp = compare_policies(tmp_path / "tf.trace.parquet", "60%", policies=["capuchin"])
    (rec,) = cmp.records
    pr = cmp.plans["capuchin", rec.budget_bytes].predictions
    assert pr.runtime_cost_ns > 0
    assert rec.overhead_with_runtime == pytest.approx(pr.predicted_overhead)
    assert rec.overhead_with_runtime == pytest.approx(
        rec.predicted_overhead + pr.runtime_cost_ns / TF_PLAIN
    )
    lines = format_comparison(cmp).splitlines()
    assert "'with runtime' adds the runtime's per-op cost (what `capuchin plan` prints)" in lines[1]
    header = next(x for x in lines if x.startswith("policy"))
    row = next(x for x in lines if x.startswith("capuchin"))
    assert header.index("sim overhead") < header.index("with runtime")
    assert f"{rec.predicted_overhead:+.1%}" in row and f"{rec.overhead_with_runtime:+.1%}" in row
    recs = json.loads(records_to_json(cmp))
    assert recs[0]["overhead_with_runtime"] == pytest.approx(pr.predicted_overhead)


def test_compare_overhead_is_of_the_plain_step_without_runtime_cost():
    # CUDA (a slow link, so that the simulated plan costs time): durations kept, the overhead
    # of the plain step
    tr = _tf(2 * TF_NS, "cuda", 2e8)
    cmp = compare_policies(tr, "60%", policies=["capuchin"], search_smallest=False)
    (rec,) = cmp.records
    plan = cmp.plans["capuchin", rec.budget_bytes]
    pr = plan.predictions
    assert cmp.time_basis == pr.time_basis == "plain" and cmp.baseline_time_ns == TF_NS
    sim_extra = pr.predicted_time_ns - pr.runtime_cost_ns - pr.baseline_time_ns
    assert sim_extra > 0
    assert rec.predicted_overhead == pytest.approx(sim_extra / (2 * TF_NS))
    assert "traced iteration (op times as traced)" in format_comparison(cmp)


@pytest.mark.parametrize("bad", ["fast", 0, -5, 1.5, True])
def test_bad_plain_step_in_metadata_is_refused_at_load(tmp_path, bad):
    from capuchin.errors import CapuchinError

    tr = _trace()
    tr.meta.plain_iteration_ns = bad
    write_trace(tr.events, tr.meta, tmp_path / "bad.parquet")
    with pytest.raises(CapuchinError, match=r"bad\.parquet.*plain_iteration_ns"):
        load_trace(tmp_path / "bad.parquet")


def test_show_states_op_times_and_the_plain_step():
    from capuchin.tracer.summary import format_summary as trace_summary
    from capuchin.tracer.summary import summarize

    timed = trace_summary(summarize(_trace(plain_ns=4_000_000)))
    assert "time       10.00 ms of op times" in timed and "plain step 4.00 ms" in timed
    tr = _trace()
    tr.meta.extra["plain_iteration_note"] = "the script ended before ..."
    assert "plain step not timed (the script ended before ...)" in trace_summary(summarize(tr))


@pytest.mark.parametrize(
    "device, plain_ns, says",
    [
        (
            "cuda",
            4 * TRACED_NS,
            "kernels take 25% of its plain step (10.000 of 40.000 ms): it is host-bound",
        ),
        ("cuda", TRACED_NS, "kernels take 100% of its plain step"),
        ("cuda", None, "a script whose steps are host-bound (short kernels) runs slower"),
        ("cpu", 4 * TRACED_NS, None),
    ],
)
def test_a_cuda_plan_says_the_host_work_is_not_charged(device, plain_ns, says):
    """On the H200 the bundled examples were host-bound and their managed steps took 3.6-11x the
    plain step where plans predicted 1.03-1.15x: on CUDA nothing of the runtime's host work is
    charged (Note [Runtime cost model]), and a CUDA plan says so, with how busy the trace shows
    the device (its kernels against the plain step) where the plain step was timed."""
    plan = make_plan(_trace(plain_ns=plain_ns, device=device), budget=10 << 20)
    assert plan.decisions
    notes = [n for n in plan.predictions.notes if "charged nothing" in n]
    if says is None:
        assert notes == []
    else:
        assert len(notes) == 1 and says in notes[0], notes
        assert ("host-bound there" in notes[0]) == (plain_ns == 4 * TRACED_NS)
