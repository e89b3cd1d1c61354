"""Importing DTR logs: every log converts, and the trace's memory matches an independent replay.

The replay below is written from the format description (../shared/data/README.md), not from
the converter: names are references, COPY adds one, COPY_FROM moves one, views keep their base's
storage alive, a storage is free when no reference to it or to a view of it is left, constants
exist from the iteration start.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from capuchin.cli import main
from capuchin.planner.problem import Problem
from capuchin.tracer.dtr_import import (
    DtrLogError,
    dtr_log_events,
    dtr_logs_path,
    import_dtr_log,
    list_dtr_logs,
)
from capuchin.tracer.reader import load_trace
from capuchin.tracer.schema import Col, Kind, Phase, Role
from click.testing import CliRunner

DTR_ZIP = dtr_logs_path()
needs_zip = pytest.mark.skipif(
    not DTR_ZIP.exists(), reason="the DTR logs zip is not on this machine"
)


# ---- the independent replay ------------------------------------------------------------------
def replay_peak_bytes(lines: list[str]) -> tuple[int, int]:
    """(peak bytes while an op runs, number of ops) by replaying the log's own semantics.

    An op's memory is what is live once its results are allocated, before the releases that follow
    it. Constants count from the start unless every reference to them goes before the first op.
    """
    instrs = [json.loads(ln) for ln in lines if ln.strip()]
    ref_of: dict[str, str] = {}  # name -> tensor key
    base_of: dict[str, str] = {}  # tensor key -> storage key
    size_of: dict[str, int] = {}  # storage key -> bytes
    refs: dict[str, int] = {}  # storage key -> live references
    const_storages: set[str] = set()
    pre_op_released: set[str] = set()
    live = 0
    ops = 0
    peak = 0
    pending_results: list[tuple[str, str]] = []
    memory: dict[str, int] = {}
    for d in instrs:
        kind = d["INSTRUCTION"]
        if kind == "MEMORY":
            memory[d["NAME"]] = int(d["MEMORY"])
    it = iter(instrs)
    events = []  # ("alloc", storage) | ("free", storage) | ("op",)
    for d in it:
        kind = d["INSTRUCTION"]
        if kind == "CONSTANT":
            key = "c:" + d["NAME"]
            ref_of[d["NAME"]] = key
            base_of[key] = key
            size_of[key] = memory[d["NAME"]]
            refs[key] = 1
            const_storages.add(key)
        elif kind == "COPY":
            ref_of[d["DST"]] = ref_of[d["SRC"]]
            refs[base_of[ref_of[d["SRC"]]]] += 1
        elif kind == "COPY_FROM":
            old = base_of[ref_of[d["DST"]]]
            refs[old] -= 1
            if refs[old] == 0:
                events.append(("free", old))
            ref_of[d["DST"]] = ref_of[d["SRC"]]
            refs[base_of[ref_of[d["SRC"]]]] += 1
        elif kind == "RELEASE":
            if d["NAME"] in ref_of:
                s = base_of[ref_of.pop(d["NAME"])]
                refs[s] -= 1
                if refs[s] == 0:
                    events.append(("free", s))
        elif kind in ("CALL", "MUTATE"):
            events.append(("op",))
            ops += 1
            if kind == "CALL":
                pending_results = [(r, d["ARGS"]) for r in d["RESULT"]]
        elif kind == "ALIAS":
            name = d["NAME"]
            args = next(a for r, a in pending_results if r == name)
            key = f"t:{name}"
            ref_of[name] = key
            k = int(d["ALIAS"])
            if k >= 0:
                base_of[key] = base_of[ref_of[args[k]]]
            else:
                base_of[key] = key
                size_of[key] = memory[name]
                events.append(("alloc", key))
                refs[key] = 0
            refs[base_of[key]] += 1
    # Constants freed before the first op never coexist with an op.
    seen_op = False
    for e in events:
        if e[0] == "op":
            seen_op = True
        elif e[0] == "free" and not seen_op and e[1] in const_storages:
            pre_op_released.add(e[1])
    live = sum(size_of[s] for s in const_storages - pre_op_released)
    in_op = False
    for e in events:
        if e[0] == "op":
            if in_op:
                peak = max(peak, live)
            in_op = True
        elif e[0] == "alloc":
            live += size_of[e[1]]
        elif e[0] == "free" and e[1] not in pre_op_released:
            if in_op:
                peak = max(peak, live)
                in_op = False
            live -= size_of[e[1]]
    if in_op:
        peak = max(peak, live)
    return peak, ops


def trace_peak_bytes(trace) -> int:
    """Peak while an op runs, from the trace: live after the op plus what is freed right after it."""
    ev = trace.events
    mem = trace.memory.set_index(Col.OP)["live_bytes"]
    freed = ev[ev[Col.ROLE] == Role.FREE.value].groupby(Col.OP)[Col.STORAGE_BYTES].sum()
    return int((mem + freed.reindex(mem.index, fill_value=0)).max())


# ---- all eight logs, converted once per session ------------------------------------------------
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("dtr")
    result = {}
    with zipfile.ZipFile(DTR_ZIP) as zf:
        for member in list_dtr_logs(DTR_ZIP):
            lines = zf.read(member).decode().splitlines()
            path = import_dtr_log(
                f"{DTR_ZIP}/{member}", out / (Path(member).stem + ".trace.parquet")
            )
            result[Path(member).name] = (load_trace(path), lines)
    return result


@needs_zip
def test_all_eight_logs_convert(converted):
    assert len(converted) == 8
    for name, (trace, lines) in converted.items():
        assert trace.meta.source == "dtr-log", name
        assert trace.meta.device == "cuda"
        assert trace.meta.bandwidth_h2d_bytes_per_s == 12e9 == trace.meta.bandwidth_d2h_bytes_per_s
        n_ops = sum(1 for ln in lines if '"CALL"' in ln or '"MUTATE"' in ln)
        assert len(trace.ops) == n_ops, name
        assert Phase.OPTIMIZER.value not in set(trace.ops[Col.PHASE]), name


@needs_zip
def test_peak_equals_independent_replay(converted):
    for name, (trace, lines) in converted.items():
        peak, ops = replay_peak_bytes(lines)
        assert ops == len(trace.ops), name
        assert trace_peak_bytes(trace) == peak, name
        assert Problem.from_trace(trace).peak_bytes == peak, name  # the planner's one definition


@needs_zip
def test_op_times_are_the_logs(converted):
    for name, (trace, lines) in converted.items():
        times = [int(json.loads(ln)["TIME"]) for ln in lines if '"TIME"' in ln]
        ops = trace.ops
        assert ops[Col.DURATION_NS].tolist() == times, name
        starts = ops[Col.START_NS].tolist()
        assert starts[0] == 0 and all(
            starts[i + 1] == starts[i] + times[i] for i in range(len(times) - 1)
        )


@needs_zip
def test_backward_phase_follows_the_marker(converted):
    trace, lines = converted[next(n for n in converted if n.startswith("resnet32"))]
    marker = next(i for i, ln in enumerate(lines) if '"BACKWARD"' in ln)
    fwd_ops = sum(1 for ln in lines[:marker] if '"CALL"' in ln or '"MUTATE"' in ln)
    phases = trace.ops[Col.PHASE].tolist()
    assert phases == [Phase.FORWARD.value] * fwd_ops + [Phase.BACKWARD.value] * (
        len(phases) - fwd_ops
    )
    assert trace.meta.extra["backward_marker"] is True


# ---- small handmade logs --------------------------------------------------------------------
def J(**kw) -> str:
    return json.dumps(kw)


def call(op, args, results, time, sizes, aliases):
    out = [J(INSTRUCTION="CALL", NAME=op, ARGS=args, RESULT=results, TIME=str(time))]
    for r, s, a in zip(results, sizes, aliases, strict=True):
        out += [
            J(INSTRUCTION="MEMORY", NAME=r, MEMORY=str(s)),
            J(INSTRUCTION="ALIAS", NAME=r, ALIAS=str(a)),
        ]
    return out


def small_log() -> list[str]:
    return [
        J(INSTRUCTION="ANNOTATE", ANNOTATION="START"),
        J(INSTRUCTION="CONSTANT", NAME="w"),
        J(INSTRUCTION="MEMORY", NAME="w", MEMORY="100"),
        J(INSTRUCTION="CONSTANT", NAME="x"),
        J(INSTRUCTION="MEMORY", NAME="x", MEMORY="40"),
        J(INSTRUCTION="CONSTANT", NAME="junk"),
        J(INSTRUCTION="MEMORY", NAME="junk", MEMORY="7"),
        J(INSTRUCTION="RELEASE", NAME="junk"),  # released before any op: left out
        J(INSTRUCTION="COPY", DST="w2", SRC="w"),
        J(INSTRUCTION="RELEASE", NAME="w"),
        *call("mm", ["x", "w2"], ["y"], 1000, [400], [-1]),  # op 0
        J(INSTRUCTION="RELEASE", NAME="x"),  # x's storage freed after op 0
        *call("view", ["y"], ["v"], 5, [400], [0]),  # op 1: a view of y
        J(INSTRUCTION="RELEASE", NAME="y"),  # y's storage lives on through v
        J(INSTRUCTION="MUTATE", NAME="relu_", ARGS=["v"], MUTATE=[0], TIME="20"),  # op 2
        J(INSTRUCTION="ANNOTATE", ANNOTATION="BACKWARD"),
        *call("mm_backward", ["v", "w2"], ["g"], 2000, [100], [-1]),  # op 3
        J(INSTRUCTION="RELEASE", NAME="v"),  # now y's storage is free, after op 3
    ]


def test_small_log_rows():
    ev, marker = dtr_log_events(small_log(), "small.log")
    assert marker
    res = ev[ev[Col.ROLE] == Role.RESIDENT.value]
    assert sorted(res[Col.STORAGE]) == ["x0:0", "x0:1"]  # named after their first access
    assert set(res[Col.STORAGE_BYTES]) == {100, 40}
    kinds = dict(zip(res[Col.STORAGE], res[Col.KIND], strict=True))
    assert kinds == {"x0:0": Kind.INPUT.value, "x0:1": Kind.PARAMETER.value}
    out = ev[ev[Col.ROLE] == Role.OUTPUT.value].set_index(Col.TENSOR)
    assert bool(out.loc["0:0", Col.ALLOC]) and out.loc["0:0", Col.STORAGE] == "0:0"
    assert not out.loc["1:0", Col.ALLOC] and out.loc["1:0", Col.STORAGE] == "0:0"
    assert out.loc["1:0", Col.VIEW_OF] == "0:0" and out.loc["1:0", Col.ALIASES] == 0
    assert out.loc["3:0", Col.KIND] == Kind.GRADIENT.value
    writes = ev[ev[Col.ROLE] == Role.WRITE.value]
    assert writes[[Col.OP, Col.TENSOR, Col.STORAGE]].values.tolist() == [[2, "1:0", "0:0"]]
    frees = ev[ev[Col.ROLE] == Role.FREE.value]
    assert frees[[Col.OP, Col.STORAGE]].values.tolist() == [[0, "x0:0"], [3, "0:0"]]
    ops = ev[ev[Col.OP] >= 0].drop_duplicates(Col.OP)
    assert ops[Col.PHASE].tolist()[:4] == ["forward"] * 3 + ["backward"]
    peak, _ = replay_peak_bytes(small_log())
    assert peak == 100 + 40 + 400 + 100 - 40  # during op 3: w, y's storage, g (x freed after op 0)


def test_copy_from_rebinds_and_frees_the_old_tensor():
    lines = [
        J(INSTRUCTION="CONSTANT", NAME="p"),
        J(INSTRUCTION="MEMORY", NAME="p", MEMORY="8"),
        *call("neg", ["p"], ["q"], 3, [8], [-1]),
        J(INSTRUCTION="COPY_FROM", DST="p", SRC="q"),  # p now names q's tensor; the old p is free
        J(INSTRUCTION="RELEASE", NAME="q"),
        *call("neg", ["p"], ["r"], 3, [8], [-1]),
    ]
    ev, marker = dtr_log_events(lines, "cf.log")
    assert not marker
    frees = ev[ev[Col.ROLE] == Role.FREE.value]
    assert frees[[Col.OP, Col.STORAGE]].values.tolist() == [[0, "x0:0"]]
    inputs = ev[(ev[Col.ROLE] == Role.INPUT.value) & (ev[Col.OP] == 1)]
    assert inputs[Col.STORAGE].tolist() == ["0:0"]


def test_malformed_logs_name_the_line():
    with pytest.raises(DtrLogError, match=r"bad\.log:2: name nope is used but not defined"):
        dtr_log_events(
            [
                J(INSTRUCTION="ANNOTATE", ANNOTATION="START"),
                *call("neg", ["nope"], ["q"], 3, [8], [-1]),
            ],
            "bad.log",
        )
    with pytest.raises(DtrLogError, match=r"bad\.log:1: not a JSON line"):
        dtr_log_events(["{oops"], "bad.log")
    with pytest.raises(DtrLogError, match=r"bad\.log:2: expected MEMORY for a"):
        dtr_log_events(
            [J(INSTRUCTION="CONSTANT", NAME="a"), J(INSTRUCTION="RELEASE", NAME="a")], "bad.log"
        )
    with pytest.raises(DtrLogError, match="log ends where a MEMORY line"):
        dtr_log_events([J(INSTRUCTION="CONSTANT", NAME="a")], "bad.log")


# ---- the command -------------------------------------------------------------------------------
def test_cli_import_dtr(tmp_path):
    log = tmp_path / "small-1-5.log"
    log.write_text("\n".join(small_log()) + "\n")
    out = tmp_path / "small.trace.parquet"
    r = CliRunner().invoke(main, ["import-dtr", str(log), "-o", str(out), "--bandwidth", "16GB/s"])
    assert r.exit_code == 0, r.output
    t = load_trace(out)
    assert t.meta.bandwidth_h2d_bytes_per_s == 16e9 and t.meta.source == "dtr-log"
    r = CliRunner().invoke(main, ["import-dtr", str(log), "-o", str(out)])
    assert r.exit_code != 0 and "--force" in r.output
    r = CliRunner().invoke(main, ["import-dtr", str(log), "-o", str(out), "--force"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["import-dtr", str(tmp_path / "missing.log"), "-o", str(out)])
    assert r.exit_code != 0 and "missing.log" in r.output


@needs_zip
def test_cli_import_dtr_from_inside_the_zip(tmp_path):
    out = tmp_path / "u.trace.parquet"
    r = CliRunner().invoke(main, ["import-dtr", f"{DTR_ZIP}/unet", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert load_trace(out).meta.extra["dtr_model"] == "unet"
    r = CliRunner().invoke(main, ["import-dtr", str(DTR_ZIP), "-o", str(out)])
    assert r.exit_code != 0 and "resnet32" in r.output  # lists the members


@needs_zip
def test_dtr_plans_on_the_unet_log_are_valid_plans(converted):
    """Regression: on U-Net at 40% a replay kept by an earlier replay (its own replay never runs)
    was taken to keep its intermediates too; the builder then named a dropped storage as a source
    of a later replay and the simulator refused the plan."""
    from capuchin.planner.build import complete_decisions
    from capuchin.planner.registry import get_policy
    from capuchin.planner.simulator import simulate

    ((trace, _),) = [v for k, v in converted.items() if k.startswith("unet")]
    problem = Problem.from_trace(trace)
    for frac in (0.4, 0.6):
        budget = int(problem.peak_bytes * frac)
        ds = complete_decisions(problem, get_policy("dtr")(problem, budget).decisions)
        assert any(d.keep for d in ds), frac  # collective recomputation is exercised
        sim = simulate(problem, ds)  # raised PlanError at 40% before the fix
        assert sim.time_ns >= problem.time_ns
