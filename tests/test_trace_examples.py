"""Integration: the bundled example scripts traced for real, checked against PyTorch's own
measurement of the same iteration and for stable ids; `capuchin show --json` on the result."""

from __future__ import annotations

import json
from pathlib import Path

import capuchin
import pytest
from capuchin.cli import main
from capuchin.runmain import run_as_main
from capuchin.runtime.report import live_bytes_series
from capuchin.tracer.record import Tracer
from capuchin.tracer.schema import Col, Kind, Role
from capuchin.tracer.summary import summarize
from capuchin.tracer.timing import marker_name
from click.testing import CliRunner

TRACES = Path(__file__).resolve().parent.parent / "traces"
EXAMPLES = ["cnn", "transformer", "mlp"]


def _profiler_total_allocated_peak(prof, until_ns: int) -> int:
    """PyTorch's own number: the CPU allocator's live bytes, from the profiler's allocation events
    (each with its address and size), at their highest before ``until_ns``, counting the blocks
    allocated while the profiler ran. The profiler starts at the first op of the first recorded
    iteration, so before the second recorded iteration this is exactly one iteration's window.
    (Not the allocator's own running total: it is process-wide, and drops when a block that an
    earlier test's profiler saw allocated is freed inside this window; runtime/report.py Note
    [Profiler allocation offset].)"""
    from torch._C._profiler import _EventType

    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        n = stack.pop()
        stack.extend(n.children)
        if n.typed[0] == _EventType.Allocation and n.start_time_ns < until_ns:
            events.append((n.start_time_ns, n.typed[1].ptr, n.typed[1].alloc_size))
    _, values = live_bytes_series(events)
    return max(values)


def _range_start_ns(prof, name: str) -> int:
    for e in prof.profiler.kineto_results.events():
        if e.name() == name:
            return e.start_ns()
    raise AssertionError(f"no profiler range {name}")


@pytest.fixture(scope="module", params=EXAMPLES)
def traced(request, tmp_path_factory):
    name = request.param
    out = tmp_path_factory.mktemp(name) / f"{name}.trace.parquet"
    tracer = Tracer(
        out,
        iterations=2,
        warmup=1,
        device="cpu",
        log=None,
        script=str(TRACES / f"{name}.py"),
        argv=["--steps", "3"],
    )
    with tracer:
        run_as_main(TRACES / f"{name}.py", ["--steps", "3"])
    return name, out, tracer


def test_show_json_says_regular(traced):
    name, out, _ = traced
    r = CliRunner().invoke(main, ["show", str(out), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["regular"] is True
    assert data["iterations"] == [1, 2]
    for key in ("ops_per_iteration", "start_bytes", "peak_bytes", "peak_op_index"):
        assert key in data
    assert data["peak_bytes"] > data["start_bytes"] > 0
    assert data["ops_per_iteration"] == sum(data["ops_by_phase"].values()) > 0


def test_steady_peak_matches_the_profiler_within_2_percent(traced):
    _, out, tracer = traced
    trace = capuchin.load_trace(out)
    first, second = trace.meta.iterations
    until = _range_start_ns(tracer.profiler, marker_name(second, 0))
    measured = _profiler_total_allocated_peak(tracer.profiler, until)
    ours = summarize(trace, first).transient_peak_bytes
    assert measured > 1 << 20
    assert abs(ours - measured) <= 0.02 * measured, (ours, measured)


def test_ids_are_stable_across_iterations(traced):
    _, out, _ = traced
    trace = capuchin.load_trace(out)
    acc = trace.accesses
    cols = [Col.OP, Col.OP_NAME, Col.ROLE, Col.ARG, Col.TENSOR, Col.STORAGE, Col.BYTES, Col.KIND]
    a = acc[acc[Col.ITERATION] == 1][cols].reset_index(drop=True)
    b = acc[acc[Col.ITERATION] == 2][cols].reset_index(drop=True)
    assert len(a) > 50 and a.equals(b)
    # no id is an address; every storage id follows Note [Tensor and storage ids]
    ids = set(trace.events[Col.STORAGE])
    assert all(i[0] in "0123456789xr~" for i in ids)
    kinds = set(acc[Col.KIND])
    assert {
        Kind.PARAMETER.value,
        Kind.GRADIENT.value,
        Kind.OPTIMIZER_STATE.value,
        Kind.ACTIVATION.value,
    } <= kinds


def test_memory_events_balance(traced):
    """Every storage allocated in the steady iteration and freed in it is freed once, after its
    last access; the op timeline is monotone on the device clock."""
    _, out, _ = traced
    trace = capuchin.load_trace(out)
    ev = trace.iteration(2)
    allocs = ev[(ev[Col.ROLE] == Role.OUTPUT.value) & ev[Col.ALLOC].fillna(False)]
    assert allocs[Col.STORAGE].is_unique
    frees = ev[ev[Col.ROLE] == Role.FREE.value]
    assert frees[Col.STORAGE].is_unique
    last_access = (
        trace.accesses[trace.accesses[Col.ITERATION] == 2].groupby(Col.STORAGE)[Col.OP].max()
    )
    for sid, k in zip(frees[Col.STORAGE], frees[Col.OP], strict=True):
        if sid in last_access.index:
            assert k >= last_access[sid], sid
    ops = trace.ops[trace.ops[Col.ITERATION] == 2]
    assert (ops[Col.DURATION_NS] >= 0).all() and ops[Col.START_NS].is_monotonic_increasing


def test_bundled_traces_are_current_and_regular():
    """The committed traces load with this reader and are regular (see traces/README.md)."""
    for name in EXAMPLES:
        trace = capuchin.load_trace(TRACES / f"{name}.trace.parquet")
        assert trace.meta.regular and len(trace.meta.iterations) == 3
        assert trace.meta.bandwidth_d2h_bytes_per_s > 0


def test_trace_command_default_output_and_progress(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(
        main,
        ["trace", "--iterations", "1", "--warmup", "1", str(TRACES / "mlp.py"), "--steps", "3"],
    )
    assert r.exit_code == 0, r.output
    out = tmp_path / "mlp.trace.parquet"
    assert out.is_file()
    assert "iteration 0: warm-up" in r.stderr and "recorded 1/1" in r.stderr
    assert "step 0 loss" in r.stdout  # the script's own output still shows
    meta = capuchin.load_trace(out).meta
    assert meta.argv == ["--steps", "3"] and meta.iterations == [1]
    # an existing output is not overwritten without --force
    before = out.stat().st_mtime_ns
    r = CliRunner().invoke(main, ["trace", str(TRACES / "mlp.py"), "--steps", "3"])
    assert r.exit_code != 0 and "--force" in r.stderr
    assert out.stat().st_mtime_ns == before
