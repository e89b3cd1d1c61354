"""The runtime's host costs measured in the script when it is traced (Note [Calibrated host
costs] in planner/costs.py; Note [Calibration of the runtime's slow path] in
runtime/calibrate.py): the trace field, the tracer's measurements (injected clocks and figures:
no wall-clock time in any premise), and what the planner charges with them."""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from capuchin import tracing
from capuchin.cli import main
from capuchin.errors import TraceFormatError
from capuchin.planner.api import make_plan
from capuchin.planner.costs import (
    CPU,
    CUDA,
    LOOP_HOT_KEY,
    NO_HOST_COST,
    SCRIPT_SLOW_KEY,
    HostCost,
    action_ops,
    calibrated,
    costs_for,
    host_cost,
    naming_ops,
    runtime_cost_ns,
    runtime_cost_parts,
    simulated_host_ns,
)
from capuchin.planner.problem import Problem
from capuchin.runtime import calibrate
from capuchin.runtime.calibrate import figures, host_calibration
from capuchin.tracer import record
from capuchin.tracer.reader import load_trace, write_trace
from capuchin.tracer.schema import TraceMeta
from capuchin.tracer.synthetic import trace_from_ops
from click.testing import CliRunner

from .test_plain_baseline import (  # a chain whose backward reads the forward's activations again
    OPS,
    SIZES,
)

TRACES = Path(__file__).resolve().parent.parent / "traces"


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


def test_calibrated_replaces_each_measured_constant_and_only_those():
    c = calibrated({"hot_op_ns": 17_000})
    assert c == replace(CPU, hot_op_ns=17_000)
    for unusable in (None, {}, {"hot_op_ns": 0}, {"other": 5}, {"hot_op_ns": "x"}):
        assert calibrated(unusable) is None
        assert costs_for("cpu", unusable) is CPU
    # on CUDA the script's measured per-op figures, not floored (Note [Host work on CUDA])
    assert costs_for("cuda", {"hot_op_ns": 17_000}) == replace(CUDA, hot_op_ns=17_000)
    assert costs_for("cuda", {"swap_action_ns": 90_000, "hot_op_ns": 0}) is CUDA
    assert host_cost("cpu", "capuchin", {"hot_op_ns": 17_000}) == host_cost("cpu")
    every = {
        "hot_op_ns": 1_100,
        "slow_op_ns": 22_000,
        "swap_action_ns": 330_000,
        "replay_op_ns": 440_000,
        "drop_action_ns": 550_000,
    }
    assert calibrated(every) == replace(CPU, **every)
    # a figure without the hot path's is used too; an unusable one keeps its constant
    assert calibrated({"slow_op_ns": 9_000, "replay_op_ns": 0}) == replace(CPU, slow_op_ns=9_000)
    # the loops' figures are charged at least at their constants (the hot path's as measured)
    low = {
        "hot_op_ns": 11,
        "slow_op_ns": 22,
        "swap_action_ns": 33,
        "replay_op_ns": 44,
        "drop_action_ns": 55,
    }
    assert calibrated(low) == replace(CPU, hot_op_ns=11)
    # the simulator's host work on the compute stream is charged at the measured figures
    assert host_cost("cpu", "capuchin", every) == HostCost(330_000, 440_000, 22_000, 550_000)
    assert host_cost("cpu", "synthetic", every) == NO_HOST_COST
    assert host_cost("cuda", "capuchin", every) == NO_HOST_COST


def test_the_loops_per_op_figures_are_scaled_to_the_scripts_hot_path():
    loops = {
        "slow_op_ns": 4_000,
        "swap_action_ns": 100_000,
        "replay_op_ns": 50_000,
        "drop_action_ns": 20_000,
    }
    # the script's dispatch mode cost 2.5x the loop's: its slow path, replays and drops alike,
    # the swap's handoff not
    c = calibrated({**loops, "hot_op_ns": 7_500, LOOP_HOT_KEY: 3_000})
    assert c == replace(
        CPU,
        hot_op_ns=7_500,
        slow_op_ns=10_000,
        swap_action_ns=100_000,
        replay_op_ns=125_000,
        drop_action_ns=50_000,
    )
    # never scaled down; without either hot path, not scaled
    assert calibrated({**loops, "hot_op_ns": 1_000, LOOP_HOT_KEY: 3_000}).slow_op_ns == 4_000
    assert calibrated(loops).replay_op_ns == 50_000
    assert calibrated({**loops, LOOP_HOT_KEY: 3_000}).slow_op_ns == 4_000


def test_the_plan_charges_the_measured_slow_path_swaps_and_replays():
    measured = {
        "slow_op_ns": 50_000,
        "swap_action_ns": 400_000,
        "replay_op_ns": 120_000,
        "drop_action_ns": 70_000,
    }
    tr = _trace(measured)
    p = Problem.from_trace(tr)
    assert p.host == HostCost(400_000, 120_000, 50_000, 70_000)
    plan = make_plan(_trace(measured), budget=10 << 20)
    assert plan.decisions
    # what the plan predicts is charged at the measured figures, not the constants
    assert plan.predictions.runtime_cost_ns == runtime_cost_ns(
        p, plan.decisions, replace(CPU, **measured)
    )
    quiet = Problem.from_trace(_trace())
    assert simulated_host_ns(p, plan.decisions) > simulated_host_ns(quiet, plan.decisions)
    notes = " ".join(plan.predictions.notes)
    assert "400.0 us a swap and direction (90.0)" in notes
    assert "120.0 us a replayed op (40.0)" in notes
    assert "70.0 us a recompute decision's drop (40.0)" in notes


def test_each_recompute_decision_is_charged_its_drop():
    # Note [Recompute decisions on the host]: a drop costs the runtime host work beyond its
    # replayed ops; the plan's predicted time grows by the figure once per recompute decision
    quiet = make_plan(_trace(), budget=10 << 20, policy="recompute")
    dear = make_plan(_trace({"drop_action_ns": 1_040_000}), budget=10 << 20, policy="recompute")
    drops = [d for d in dear.decisions if d.method.value == "recompute"]
    assert drops and dear.decisions == quiet.decisions
    grown = dear.predictions.predicted_time_ns - quiet.predictions.predicted_time_ns
    assert grown == len(drops) * (1_040_000 - CPU.drop_action_ns)
    # charged on the compute stream by the simulator, not again in the runtime's cost
    p = Problem.from_trace(_trace({"drop_action_ns": 1_040_000}))
    assert p.host.drop_ns == 1_040_000
    assert dear.predictions.runtime_cost_ns == quiet.predictions.runtime_cost_ns
    assert simulated_host_ns(p, dear.decisions) - simulated_host_ns(
        Problem.from_trace(_trace()), quiet.decisions
    ) == len(drops) * (1_040_000 - CPU.drop_action_ns)


def test_the_calibration_figures_are_the_differences_of_its_lines():
    lines = {
        "no mode": 1_000,
        "hot path": 4_000,
        "slow path": 9_500,
        "passive mode": 31_000,
        "recompute drop": 13_000,
    }
    # 2 x 1 MiB of copies at 0.1 ns a byte each way, charged as the planner charges them
    got = figures(lines, cycle_ns=1_000_000, nbytes=1 << 20, ns_per_byte=(0.1, 0.1))
    assert got == {
        "slow_op_ns": 5_500,
        "replay_op_ns": 30_000,
        "swap_action_ns": round((1_000_000 - 2 * 0.1 * (1 << 20)) / 2),
        "loop_hot_op_ns": 3_000,
        "drop_action_ns": 12_000,
    }
    # a copy cost below the runtime's own is charged at the runtime's (``copy_ns_per_byte``)
    slow_bw = figures(lines, 1_000_000, 1 << 20, (0.0, 0.0))["swap_action_ns"]
    assert slow_bw == round((1_000_000 - 2 * CPU.copy_ns_per_byte * (1 << 20)) / 2)
    # figures at 0 or below are left out: the planner keeps the constants for them
    flat = {k: 1_000 for k in lines}
    assert figures(flat, cycle_ns=10, nbytes=1 << 20, ns_per_byte=(1.0, 1.0)) == {}


def test_the_calibration_runs_the_runtime_paths_with_an_injected_clock():
    t = [0.0]

    def clock():
        t[0] += 1e-3  # every timed loop, whatever runs in it, takes 1 ms
        return t[0]

    found, lines = host_calibration(256 << 10, (0.0, 0.0), clock=clock, n=50, reps=1)
    assert set(lines) == {
        "no mode ns/op",
        "hot path ns/op",
        "slow path ns/op",
        "passive mode ns/op",
        "recompute drop ns/op",
        f"swap cycle {256 << 10} B ns",
    }
    assert all(v == 1e6 / 50 for k, v in lines.items() if k.endswith("ns/op"))
    # equal lines: no slow path or replay figure; the swap cycle's 1 ms less its copies
    assert found == {"swap_action_ns": round((1e6 - 2 * CPU.copy_ns_per_byte * (256 << 10)) / 2)}


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
    assert "measured in the script" in notes and "40.0 us an op (3.4)" in notes
    assert "measured in the script" not in " ".join(quiet.predictions.notes)
    # on CUDA nothing is charged without a measurement (the host is taken to run ahead) ...
    assert make_plan(_trace(device="cuda"), budget=10 << 20).predictions.runtime_cost_ns == 0


def test_a_cuda_plan_charges_what_the_scripts_steps_measured():
    """Note [Host work on CUDA]: the probe's differences on CUDA are what the runtime's host
    work added to the script's steps after the kernels hid what they could: charged per op as
    measured, not floored at the CPU constants, on top of the simulated time (nothing on the
    simulator's compute stream); a figure of 0 is no measurement."""
    measured = {"hot_op_ns": 40_000, "slow_op_script_ns": 1_000, "guarded_op_ns": 0}
    tr = _trace(measured, device="cuda")
    p = Problem.from_trace(tr)
    plan = make_plan(tr, budget=10 << 20)
    want = runtime_cost_ns(p, plan.decisions, replace(CUDA, hot_op_ns=40_000, slow_op_ns=1_000))
    assert plan.decisions and plan.predictions.runtime_cost_ns == want
    assert want >= len(OPS) * 40_000
    assert not p.host  # nothing charged on the compute stream
    notes = " ".join(plan.predictions.notes)
    assert "40.0 us an op, 1.0 us more an op on the slow path" in notes
    assert "a swap's own host calls are not charged" in notes


calls: list = []

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


def _traced(
    tmp_path,
    monkeypatch,
    plain_ms,
    moded_ms,
    steps=50,
    measured=None,
    slow_ms=None,
    guarded_ms=None,
):
    """Trace the script with a clock that makes each plain step ``plain_ms`` long, each step
    under the runtime without actions (or through the counting mode, where the runtime probe
    is off) ``moded_ms``, each on its guarded hot path ``guarded_ms`` and each with an action
    at every op ``slow_ms`` (default: the same as ``moded_ms``), and a runtime calibration that returns ``measured`` (its calls in
    ``calls``)."""
    t = [0.0]
    ms = {
        "plain": plain_ms,
        "count": moded_ms,
        "hot": moded_ms,
        "guarded": guarded_ms or moded_ms,
        "slow": slow_ms or moded_ms,
    }

    def now(self):  # a step's start reads the clock; its end moves it by the step's length
        if self._timing_phase is not None:
            t[0] += ms[self._timing_phase.rstrip("~")] / 1e3
        return t[0]

    def calibration(nbytes, ns_per_byte):
        calls.append((nbytes, ns_per_byte))
        return dict(measured or {}), {"line": 1.0}

    calls.clear()
    monkeypatch.setattr(record.Tracer, "_now", now)
    monkeypatch.setattr(tracing, "host_calibration", calibration)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_TRAIN))
    out = tmp_path / "o.parquet"
    r = CliRunner().invoke(
        main,
        ["trace", "--iterations", "2", "--warmup", "1", "-o", str(out), str(script), str(steps)],
    )
    assert r.exit_code == 0, r.output
    return load_trace(out), r


@pytest.mark.parametrize("name", ["mlp", pytest.param("transformer", marks=pytest.mark.slow)])
def test_the_model_counts_the_ops_the_runtime_sends_down_its_slow_path(name):
    # Note [Runtime cost model]: the ops of the runtime's action table (runtime/actions.py) are
    # its slow path; the model's count is the same set, the ops that only name a storage too
    from capuchin.runtime.actions import compile_plan

    plan = make_plan(TRACES / f"{name}.trace.parquet", budget="50%")
    acting = action_ops(plan.decisions, out_done=True)
    naming = naming_ops(plan.decisions)
    assert set(compile_plan(plan).ops) == acting | naming
    assert naming - acting  # producers named before their storage's eviction, on these plans
    # and charged: each at slow_op_ns, beside the in-place ops inside a window
    p = Problem.from_trace(load_trace(TRACES / f"{name}.trace.parquet"))
    parts = runtime_cost_parts(p, plan.decisions, CPU)
    assert parts["slow"] >= len(acting | naming) * CPU.slow_op_ns


def test_the_slow_path_timed_in_the_script_is_charged_in_place_of_the_loops():
    # Note [Calibrated host costs]: the loop's figure is scaled by the hot paths' ratio; the
    # script's own is charged as it is, never below the constant
    loops = {"slow_op_ns": 30_000, "hot_op_ns": 9_000, LOOP_HOT_KEY: 3_000}
    assert calibrated(loops).slow_op_ns == 90_000
    assert calibrated({**loops, SCRIPT_SLOW_KEY: 50_000}).slow_op_ns == 50_000
    assert calibrated({**loops, SCRIPT_SLOW_KEY: 1}).slow_op_ns == CPU.slow_op_ns
    assert calibrated({SCRIPT_SLOW_KEY: 50_000}) == replace(CPU, slow_op_ns=50_000)
    assert calibrated({**loops, SCRIPT_SLOW_KEY: 0}).slow_op_ns == 90_000  # 0: not measured


def test_the_tracer_times_the_runtime_in_the_scripts_steps(tmp_path, monkeypatch):
    # Note [The runtime in the script's steps] in runtime/calibrate.py
    trace, r = _traced(tmp_path, monkeypatch, plain_ms=10, moded_ms=13, slow_ms=20, guarded_ms=15)
    meta = trace.meta
    assert meta.plain_iteration_ns == 10_000_000
    assert meta.extra["plain_iteration_wall_s"] == [0.01] * 3
    # three rounds timed; the warm-ups of the runtime are not
    assert meta.extra["runtime_probe_wall_s"] == [0.013] * 3
    assert meta.extra["runtime_probe_slow_wall_s"] == [0.02] * 3
    assert "mode_iteration_wall_s" not in meta.extra and "runtime_probe_note" not in meta.extra
    # per op the planner charges: the iteration's
    ops = len(Problem.from_trace(trace).ops)
    # the guarded path: 2 ms a step more, less the ops that write in place, which leave it for
    # the slow path (the SGD update's), per op that stays on it
    slow_ns = round(7_000_000 / ops)
    ((hot_calls, guarded_calls),) = set(map(tuple, meta.extra["runtime_probe_slow_calls"]))
    moved = guarded_calls - hot_calls
    assert moved > 0
    assert meta.host_costs == {
        "hot_op_ns": round(3_000_000 / ops),
        "slow_op_script_ns": slow_ns,
        "guarded_op_ns": round((2_000_000 - moved * slow_ns) / (ops - moved)),
    }
    assert "the runtime without actions costs" in r.stderr
    assert "the runtime's slow path costs" in r.stderr


def _trace_with_clock(tmp_path, monkeypatch, now):
    """``capuchin trace --iterations 2`` of the 50-step script with the tracer's clock ``now``;
    the trace (written to ``tmp_path / "o.parquet"``)."""
    monkeypatch.setattr(record.Tracer, "_now", now)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_TRAIN))
    out = tmp_path / "o.parquet"
    r = CliRunner().invoke(main, ["trace", "--iterations", "2", "-o", str(out), str(script), "50"])
    assert r.exit_code == 0, r.output
    return load_trace(out)


def test_the_rounds_take_the_median_difference(tmp_path, monkeypatch):
    """Load that changes between steps moves one round's difference, not the figure."""
    t = [0.0]
    hot_steps = [0]

    def now(self):
        phase = self._timing_phase
        if phase is not None:
            if phase == "hot":
                hot_steps[0] += 1
            # from the second round's hot step on, another job adds 10 ms to every step
            t[0] += ({"plain": 10}.get(phase, 13) + (10 if hot_steps[0] >= 2 else 0)) / 1e3
        return t[0]

    trace = _trace_with_clock(tmp_path, monkeypatch, now)
    meta = trace.meta
    assert meta.extra["plain_iteration_wall_s"] == [0.01] * 3  # before the probe
    assert meta.extra["plain_after_probe_wall_s"] == [0.01, 0.02]
    assert meta.extra["runtime_probe_wall_s"] == [0.013, 0.023, 0.023]
    # the rounds' differences are 3, 13 and 3 ms: the figure is their median, 3 ms a step
    # (the difference of the two medians, 23 - 10, or the mean difference would count the load)
    ops = len(Problem.from_trace(trace).ops)
    assert meta.host_costs["hot_op_ns"] == round(3_000_000 / ops)


def test_the_plain_steps_after_the_probe_are_not_the_baseline(tmp_path, monkeypatch):
    """Note [Plain step]: on T5 the first plain step after a probe step ran up to 10% slower
    than the plain steps before the probe; the baseline is the consecutive plain steps before
    the first probe step (9-11 ms here, 13 ms after it), the later rounds' plain steps serve
    their rounds' differences (3 ms a round)."""
    t = [0.0]
    probed = [False]
    before = iter([9, 10, 11])  # the median of all five plain steps would be 11

    def now(self):
        phase = self._timing_phase
        if phase is not None:
            if phase.rstrip("~") != "plain":
                probed[0] = True
            if phase == "plain":
                t[0] += (13 if probed[0] else next(before)) / 1e3
            elif phase != "plain~":
                t[0] += 16 / 1e3
            else:
                t[0] += 10 / 1e3
        return t[0]

    trace = _trace_with_clock(tmp_path, monkeypatch, now)
    meta = trace.meta
    assert meta.plain_iteration_ns == 10_000_000
    assert meta.extra["plain_iteration_wall_s"] == [0.009, 0.01, 0.011]
    assert meta.extra["plain_after_probe_wall_s"] == [0.013, 0.013]
    ops = len(Problem.from_trace(trace).ops)
    assert meta.host_costs["hot_op_ns"] == round(3_000_000 / ops)  # rounds 2 and 3: 16 - 13


def test_the_first_step_without_the_mode_is_not_timed(tmp_path, monkeypatch):
    """Note [Plain step]: the first step after the tracer's mode leaves is slower than the
    steady ones (30 ms here against 10); it is an untimed warm-up, neither in the plain step
    nor in the first round's difference."""
    t = [0.0]
    plain_seen = [0]

    def now(self):
        phase = self._timing_phase
        if phase is not None:
            if phase.rstrip("~") == "plain":
                plain_seen[0] += 1
                t[0] += (30 if plain_seen[0] == 1 else 10) / 1e3
            else:
                t[0] += 13 / 1e3
        return t[0]

    trace = _trace_with_clock(tmp_path, monkeypatch, now)
    meta = trace.meta
    assert meta.extra["plain_iteration_wall_s"] == [0.01] * 3
    assert meta.plain_iteration_ns == 10_000_000
    assert meta.extra["plain_warmup_wall_s"] == 0.03  # shown, not used
    ops = len(Problem.from_trace(trace).ops)
    assert meta.host_costs["hot_op_ns"] == round(3_000_000 / ops)


def test_without_the_runtime_probe_a_dispatch_mode_is_timed(tmp_path, monkeypatch):
    monkeypatch.setattr(tracing, "runtime_probe", None)
    trace, r = _traced(tmp_path, monkeypatch, plain_ms=10, moded_ms=13)
    meta = trace.meta
    assert meta.extra["mode_iteration_wall_s"] == [0.013] * 3
    # every call of a step passed through the mode (a few more than the trace indexes: the
    # runtime's mode sees them too); the cost is per op the planner charges, the iteration's
    ops = len(Problem.from_trace(trace).ops)
    assert meta.extra["mode_iteration_calls"] >= ops
    assert meta.host_costs == {"hot_op_ns": round(3_000_000 / ops)}
    assert "a dispatch mode costs" in r.stderr


def test_a_probe_that_does_not_follow_falls_back_to_a_dispatch_mode(tmp_path, monkeypatch):
    # an iteration of another kind under the probe: its ops leave the planned path, so its
    # time says nothing of the hot path; the steps still to run time the passthrough mode
    monkeypatch.setattr(calibrate.RuntimeProbe, "steady", lambda self, n: False)
    trace, _ = _traced(tmp_path, monkeypatch, plain_ms=10, moded_ms=13)
    meta = trace.meta
    assert "did not follow" in meta.extra["runtime_probe_note"]
    assert "runtime_probe_wall_s" not in meta.extra
    assert meta.extra["mode_iteration_wall_s"] == [0.013] * 3
    ops = len(Problem.from_trace(trace).ops)
    assert meta.host_costs == {"hot_op_ns": round(3_000_000 / ops)}


def test_the_traced_script_carries_the_runtimes_calibration(tmp_path, monkeypatch):
    measured = {"slow_op_ns": 20_000, "swap_action_ns": 150_000, "replay_op_ns": 0}
    trace, r = _traced(tmp_path, monkeypatch, plain_ms=10, moded_ms=13, measured=measured)
    ops = len(Problem.from_trace(trace).ops)
    # the hot path and the calibration's usable figures; its 0 is left out, and so is the
    # slow path in the script, which took no longer than the hot one (noise)
    assert trace.meta.host_costs == {
        "hot_op_ns": round(3_000_000 / ops),
        "slow_op_ns": 20_000,
        "swap_action_ns": 150_000,
    }
    assert "noise" in trace.meta.extra["runtime_probe_note"]
    assert trace.meta.extra["host_calibration_ns"] == {"line": 1.0}
    assert "host costs measured now" in r.stderr
    # called once, after the steps, with a size within its bounds and the trace's copy costs
    ((nbytes, per_byte),) = calls
    assert 64 << 10 <= nbytes <= 64 << 20
    bw = (trace.meta.bandwidth_d2h_bytes_per_s, trace.meta.bandwidth_h2d_bytes_per_s)
    assert per_byte == pytest.approx(tuple(1e9 / b for b in bw))
    # the tracer alone (no runtime composed in) calibrates nothing
    assert record.Tracer(tmp_path / "x.parquet").calibrate_host is None
    assert record.Tracer(tmp_path / "x.parquet").runtime_probe is None
    assert tracing.Tracer(tmp_path / "y.parquet").calibrate_host is not None
    assert tracing.Tracer(tmp_path / "y.parquet").runtime_probe is not None


def test_a_calibration_without_the_hot_path_is_kept(tmp_path, monkeypatch):
    trace, _ = _traced(
        tmp_path, monkeypatch, plain_ms=10, moded_ms=9, measured={"slow_op_ns": 7_000}
    )
    assert trace.meta.host_costs == {"slow_op_ns": 7_000}
    assert "noise" in trace.meta.extra["host_costs_note"]


def test_a_mode_step_no_longer_than_the_plain_one_is_not_used(tmp_path, monkeypatch):
    trace, _ = _traced(tmp_path, monkeypatch, plain_ms=10, moded_ms=9)
    assert calls  # the calibration ran and measured nothing usable
    assert trace.meta.host_costs is None and "noise" in trace.meta.extra["host_costs_note"]


def test_a_script_that_ends_before_the_mode_steps_keeps_its_plain_step(tmp_path, monkeypatch):
    # 1 warm-up + 2 recorded + 1 plain warm-up + 1 plain + the runtime's warm-up: the script
    # ends under the runtime's next step, before one step under it was timed
    trace, _ = _traced(tmp_path, monkeypatch, plain_ms=10, moded_ms=13, steps=6)
    assert trace.meta.plain_iteration_ns == 10_000_000
    assert trace.meta.host_costs is None
    assert "ended before" in trace.meta.extra["host_costs_note"]
    # the step it ended in is no step that did not follow the plan
    assert "runtime_probe_note" not in trace.meta.extra


@pytest.mark.slow
def test_the_slow_probe_does_an_action_ops_bookkeeping_and_moves_no_byte(monkeypatch):
    # Note [The runtime in the script's steps] in runtime/calibrate.py: every op of the slow
    # probe names its first input and output and tries its output's eviction (no decision: none
    # happens), and every op's inputs are looked up among the evicted storages; training stays
    # bitwise and nothing is evicted or refused
    from capuchin.runtime import residency
    from capuchin.testing.training import train_mismatches

    ops = Problem.from_trace(load_trace(TRACES / "mlp.trace.parquet")).op_signatures()
    evicts: list = []
    looked_up = [0]
    evict, restore_inputs = (
        residency.StorageResidency._evict,
        residency.StorageResidency.restore_inputs,
    )

    def spy_evict(self, step, sid, d):
        ref = self.live.get(sid)
        evicts.append((sid, d, ref is not None and ref() is not None))
        return evict(self, step, sid, d)

    def spy_lookups(self, keys):
        looked_up[0] += len(keys)
        return restore_inputs(self, keys)

    monkeypatch.setattr(residency.StorageResidency, "_evict", spy_evict)
    monkeypatch.setattr(residency.StorageResidency, "restore_inputs", spy_lookups)
    probe = calibrate.RuntimeProbe(ops, None, "slow")
    assert train_mismatches("mlp", probe) == []
    its = [s for s in probe.rt.report.iterations if s.complete]
    assert probe.steady(len(its) - 1)  # iteration 0 builds the model: it follows no plan
    assert all(s.evictions == 0 and s.refused == 0 for s in its)
    steady_ops = sum(s.ops for s in its[1:])
    assert len(evicts) >= steady_ops and all(d is None for _, d, _ in evicts)
    assert sum(named for *_, named in evicts) >= steady_ops // 2  # outputs named as planned
    assert looked_up[0] >= steady_ops


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_probe_runs_over_the_scripts_steps_on_cuda_too(tmp_path, device):
    """Note [Host work on CUDA]: on CUDA the probe's steps measure what the runtime's host work
    adds to a step after the kernels hid what they could, so the tracer runs them there as on
    CPU, with the traced device's runtime."""
    from capuchin.testing.emulated import emulated_cuda
    from capuchin.tracer.record import Tracer

    with emulated_cuda():  # the probe's runtime is the traced device's
        probe = calibrate.runtime_probe([["aten.add.Tensor", "16;16"]], None, "slow", device)
        assert probe.rt.device.type == device
    t = Tracer(tmp_path / "t.parquet", device=device, log=None)
    t.runtime_probe, t.recorded = object(), [1]
    schedule = t._steps_schedule()
    assert schedule[:4] == ["plain~", "plain", "plain", "plain"]
    assert [p for p in schedule if p in ("hot", "guarded", "slow")] == [
        "hot",
        "guarded",
        "slow",
    ] * 3
