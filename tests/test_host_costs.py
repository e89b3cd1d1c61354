"""The runtime's hot-path cost measured in the script when it is traced (Note [Calibrated host
costs] in planner/costs.py): the trace field, the tracer's measurement (an injected clock: no
wall-clock time in any premise), and what the planner charges with it."""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, replace

import pytest
from capuchin.cli import main
from capuchin.errors import TraceFormatError
from capuchin.planner.api import make_plan
from capuchin.planner.costs import CPU, calibrated, costs_for, host_cost, runtime_cost_ns
from capuchin.planner.problem import Problem
from capuchin.tracer import record
from capuchin.tracer.reader import load_trace, write_trace
from capuchin.tracer.schema import TraceMeta
from capuchin.tracer.synthetic import trace_from_ops
from click.testing import CliRunner

OPS = [  # a chain whose backward reads the forward's activations again
    ("f1", 1_000_000, ["X"], ["A"]),
    ("f2", 3_000_000, ["A"], ["B"]),
    ("f3", 2_000_000, ["B"], ["C"]),
    ("b3", 2_000_000, ["C", "B"], ["D"]),
    ("b2", 1_500_000, ["D", "A"], ["E"]),
    ("b1", 500_000, ["E", "X"], ["F"]),
]
SIZES = {"X": 1 << 20, "A": 4 << 20, "B": 4 << 20, "C": 4 << 20, "D": 1 << 20, "E": 1 << 20}
SIZES["F"] = 1 << 20


def _trace(host_costs=None, device="cpu"):
    tr = trace_from_ops(OPS, SIZES)
    tr.meta.source = "capuchin"  # a recorded trace: the runtime's host costs apply
    tr.meta.device = device
    tr.meta.plain_iteration_ns = 10_000_000
    tr.meta.host_costs = host_costs
    return tr


def test_field_round_trips_old_traces_load_and_bad_values_are_refused(tmp_path):
    tr = _trace({"hot_op_ns": 12_345})
    write_trace(tr.events, tr.meta, tmp_path / "new.parquet")
    assert load_trace(tmp_path / "new.parquet").meta.host_costs == {"hot_op_ns": 12_345}
    doc = asdict(tr.meta)
    del doc["host_costs"]  # a trace written before the field
    old = TraceMeta.from_bytes(json.dumps(doc).encode())
    write_trace(tr.events, old, tmp_path / "old.parquet")
    assert load_trace(tmp_path / "old.parquet").meta.host_costs is None
    for bad in ({"hot_op_ns": -1}, {"hot_op_ns": 1.5}, [1]):
        tr.meta.host_costs = bad
        write_trace(tr.events, tr.meta, tmp_path / "bad.parquet", force=True)
        with pytest.raises(TraceFormatError, match="host_costs"):
            load_trace(tmp_path / "bad.parquet")


def test_calibrated_replaces_the_hot_path_constant_only():
    c = calibrated({"hot_op_ns": 17_000})
    assert c == replace(CPU, hot_op_ns=17_000)
    for unusable in (None, {}, {"hot_op_ns": 0}, {"other": 5}, {"hot_op_ns": "x"}):
        assert calibrated(unusable) is None
        assert costs_for("cpu", unusable) is CPU
    assert costs_for("cuda", {"hot_op_ns": 17_000}).hot_op_ns == 0
    assert host_cost("cpu", "capuchin", {"hot_op_ns": 17_000}) == host_cost("cpu")


def test_the_plan_charges_the_measured_hot_path_and_says_so():
    quiet = make_plan(_trace(), budget=10 << 20)
    p = Problem.from_trace(_trace({"hot_op_ns": 40_000}))
    plan = make_plan(_trace({"hot_op_ns": 40_000}), budget=10 << 20)
    assert plan.decisions and [d.storage_id for d in plan.decisions] == [
        d.storage_id for d in quiet.decisions
    ]
    want = runtime_cost_ns(p, plan.decisions, replace(CPU, hot_op_ns=40_000))
    assert plan.predictions.runtime_cost_ns == want
    # every op of the iteration pays the measured cost instead of the constant's
    assert want - quiet.predictions.runtime_cost_ns == len(OPS) * (40_000 - CPU.hot_op_ns)
    notes = " ".join(plan.predictions.notes)
    assert "40.0 us an op, measured in the script" in notes
    assert "measured in the script" not in " ".join(quiet.predictions.notes)
    # on CUDA the host runs ahead: nothing is charged, measured or not
    gpu = make_plan(_trace({"hot_op_ns": 40_000}, device="cuda"), budget=10 << 20)
    assert gpu.predictions.runtime_cost_ns == 0


_TRAIN = """
import sys
import torch
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
for step in range(int(sys.argv[1])):
    opt.zero_grad()
    model(torch.randn(8, 16)).square().mean().backward()
    opt.step()
"""


def _traced(tmp_path, monkeypatch, plain_ms, moded_ms, steps=50):
    """Trace the script with a clock that makes each plain step ``plain_ms`` and each step
    through the counting mode ``moded_ms`` long."""
    t = [0.0]

    def now(self):
        t[0] += (moded_ms if self._plain_state == "mode-timing" else plain_ms) / 1e3
        return t[0]

    monkeypatch.setattr(record.Tracer, "_now", now)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_TRAIN))
    out = tmp_path / "o.parquet"
    r = CliRunner().invoke(
        main,
        ["trace", "--iterations", "2", "--warmup", "1", "-o", str(out), str(script), str(steps)],
    )
    assert r.exit_code == 0, r.output
    return load_trace(out), r


def test_the_tracer_measures_a_dispatch_mode_per_op_after_the_plain_steps(tmp_path, monkeypatch):
    trace, r = _traced(tmp_path, monkeypatch, plain_ms=10, moded_ms=13)
    meta = trace.meta
    assert meta.plain_iteration_ns == 10_000_000
    assert meta.extra["mode_iteration_wall_s"] == [0.013] * 3
    # every call of a step passed through the mode (a few more than the trace indexes: the
    # runtime's mode sees them too); the cost is per op the planner charges, the iteration's
    ops = len(Problem.from_trace(trace).ops)
    assert meta.extra["mode_iteration_calls"] >= ops
    assert meta.host_costs == {"hot_op_ns": round(3_000_000 / ops)}
    assert "a dispatch mode costs" in r.stderr


def test_a_mode_step_no_longer_than_the_plain_one_is_not_used(tmp_path, monkeypatch):
    trace, _ = _traced(tmp_path, monkeypatch, plain_ms=10, moded_ms=9)
    assert trace.meta.host_costs is None and "noise" in trace.meta.extra["host_costs_note"]
    assert Problem.from_trace(trace).host_costs is None


def test_a_script_that_ends_before_the_mode_steps_keeps_its_plain_step(tmp_path, monkeypatch):
    # 1 warm-up + 2 recorded + 1 plain warm-up + 3 plain: the mode is pushed at the last
    # plain step and the script ends under it, before one step through it was timed
    trace, _ = _traced(tmp_path, monkeypatch, plain_ms=10, moded_ms=13, steps=7)
    assert trace.meta.plain_iteration_ns == 10_000_000
    assert trace.meta.host_costs is None
    assert "ended before" in trace.meta.extra["host_costs_note"]
