"""A ``DataLoader`` with two worker processes (Note [Batches from workers] in
tracer/materialize.py): the default trace records one kind of iteration whatever the workers'
timing, plans without ``--iteration``, and its plan runs again and again without a refusal or a
divergence (an epoch boundary included), bitwise like plain training."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
from capuchin.planner.api import make_plan
from capuchin.runtime.engine import Runtime
from capuchin.testing.training import run_example, state_mismatches
from capuchin.tracer.reader import load_trace
from capuchin.tracer.script import trace_script
from capuchin.tracer.summary import iteration_kinds

SCRIPT = Path(__file__).resolve().parent / "frameworks" / "worker_loader.py"
RUN = ["--steps", "10"]  # 8 batches per epoch: iteration 8 starts the second epoch


@cache
def _trace(tmp: Path):
    return trace_script(SCRIPT, ["--steps", "6"], output=tmp / "t.parquet", log=lambda m: None)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("workers")


def _run(plan):
    rt = Runtime(plan, measure_memory=False)
    got = run_example(SCRIPT, RUN, rt)
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
    assert len(its) == 10 - 1 and not any(s.diverged for s in its), [
        (s.iteration, s.diverged_at) for s in its if s.diverged
    ]
    assert all(s.evictions > 0 for s in its)
    return got


def test_a_worker_loader_trace_has_one_kind_and_plans_by_default(tmp):
    trace = _trace(tmp)
    kinds = iteration_kinds(load_trace(trace))
    assert len(kinds) == 1, kinds
    plan = make_plan(trace, "80%", policy="capuchin")  # no --iteration
    assert plan.decisions and not plan.kinds
    assert state_mismatches(run_example(SCRIPT, RUN), _run(plan)) == []


@pytest.mark.slow
def test_a_worker_loader_plan_runs_ten_times_without_refusal(tmp):
    plan = make_plan(_trace(tmp), "80%", policy="capuchin")
    ref = run_example(SCRIPT, RUN)
    for _ in range(10):
        assert state_mismatches(ref, _run(plan)) == []
