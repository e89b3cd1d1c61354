"""Recurrent layers (``nn.LSTM``, ``nn.GRU``) under recompute: on CPU they run
``aten.mkldnn_rnn_layer``, whose training workspace (its fourth output) is produced only with grad
mode on. A replay runs each op under the grad mode it ran in (Note [Replay grad mode] in
runtime/recompute.py), so a recompute-only plan and dynamic mode that replays whatever it can
train bitwise like plain training, with the workspace among what they drop."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
from capuchin.planner.api import make_plan
from capuchin.planner.problem import Problem
from capuchin.runtime.engine import Runtime
from capuchin.testing.training import run_example, state_mismatches
from capuchin.tracer.reader import load_trace
from capuchin.tracer.script import trace_script

SCRIPT = Path(__file__).resolve().parent / "frameworks" / "rnn_lm.py"
ARGS = ["--steps", "4"]


@cache
def _trace(tmp: Path, cell: str):
    return trace_script(
        SCRIPT,
        [*ARGS, "--cell", cell],
        output=tmp / f"{cell}.parquet",
        iterations=1,
        log=lambda m: None,
    )


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("rnn")


def _check(cell: str, rt: Runtime):
    args = [*ARGS, "--cell", cell]
    got = run_example(SCRIPT, args, rt)
    assert state_mismatches(run_example(SCRIPT, args), got) == []
    return [s for s in rt.report.iterations if s.complete]


@pytest.mark.slow
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_recompute_plan_replays_the_rnn_workspace(tmp, cell):
    plan = make_plan(_trace(tmp, cell), "90%", policy="recompute")
    if cell == "lstm":  # a recurrent layer's workspace (output 3 of mkldnn_rnn_layer) is dropped
        assert any(
            "mkldnn_rnn_layer" in plan.ops[int(d.storage_id.split(":")[0])][0]
            and d.storage_id.endswith(":3")
            for d in plan.decisions
            if d.method.value == "recompute"
        ), [(d.storage_id, plan.ops[int(d.storage_id.split(":")[0])][0]) for d in plan.decisions]
    its = _check(cell, Runtime(plan, measure_memory=False))
    steady = [s for s in its if s.iteration >= 1]
    assert steady and all(s.recomputed_ops > 0 and not s.diverged for s in steady), steady


@pytest.mark.slow
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_dynamic_mode_replays_the_rnn_workspace(tmp, cell):
    # 60% of the trace's peak: dynamic mode needs no plan, and whether the planner reaches 60%
    # depends on the op times it measured (under load it did not)
    budget = Problem.from_trace(load_trace(_trace(tmp, cell))).peak_bytes * 6 // 10
    its = _check(
        cell,
        Runtime(device="cpu", budget_bytes=budget, remat="recompute", measure_memory=False),
    )
    assert sum(s.dynamic_drops for s in its) > 0
