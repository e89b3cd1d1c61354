"""Raw reads between steps (Note [Raw reads] in runtime/rawreads.py): a script that reads every
parameter and Adam state tensor after each step without an op (``numpy()``, ``np.asarray``,
``tolist()``, ``data_ptr()``, ``__dlpack__``, ``untyped_storage().data_ptr()``), under a plan
that keeps optimizer state out across the step (wrap-around swaps), reads the values plain
training reads and trains bitwise like it: the values read set the next step's learning rate and
are kept in a buffer of the model, so a wrong read shows in the compared state."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
from capuchin.errors import InfeasibleBudgetError
from capuchin.planner.api import make_plan
from capuchin.runtime.engine import Runtime
from capuchin.testing.training import (
    FIXED_BANDWIDTH,
    run_example,
    state_mismatches,
    with_fixed_costs,
)
from capuchin.tracer.script import trace_script

SCRIPT = Path(__file__).resolve().parent / "frameworks" / "raw_reads.py"


@cache
def _plan(tmp: Path, read: str):
    # the read methods differ in the ops they run (``tolist()`` detaches): one trace each
    trace = trace_script(
        SCRIPT,
        ["--steps", "4", "--read", read],
        output=tmp / f"{read}.parquet",
        iterations=1,
        log=lambda m: None,
        plain_steps=0,
    )
    # Note [Fixed op costs]: one plan whatever the host's load (with the measured times, a
    # loaded host could make a plan whose every decision is a storage the reads expose)
    loaded = with_fixed_costs(trace)
    kw = {"policy": "capuchin", "bandwidth": FIXED_BANDWIDTH}
    try:
        plan = make_plan(loaded, "50%", **kw)
    except InfeasibleBudgetError as exc:  # the smallest budget the plan reaches
        plan = make_plan(loaded, str(exc.smallest_feasible_bytes), **kw)
    assert any(d.wraps for d in plan.decisions), "the plan keeps storages out across the step"
    return plan


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("rawreads")


SLOW = pytest.mark.slow  # one trace each: the fast tier keeps two of the six


@pytest.mark.parametrize(
    "read",
    [
        "numpy",
        pytest.param("tolist", marks=SLOW),
        pytest.param("data_ptr", marks=SLOW),
        pytest.param("array", marks=SLOW),
        pytest.param("dlpack", marks=SLOW),
        pytest.param("storage", marks=SLOW),
    ],
)
def test_raw_reads_between_steps_under_wrap_around_swaps(tmp, read):
    args = ["--steps", "4", "--read", read]
    rt = Runtime(_plan(tmp, read), measure_memory=False)
    got = run_example(SCRIPT, args, rt)
    assert state_mismatches(run_example(SCRIPT, args), got) == []
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
    assert its and all(s.evictions > 0 for s in its), [
        (s.evictions, s.refused, s.diverged, s.diverged_at) for s in its
    ]


def test_raw_reads_leave_no_method_patched(tmp):
    import torch

    before = {n: getattr(torch.Tensor, n) for n in ("numpy", "tolist", "data_ptr")}
    run_example(SCRIPT, ["--steps", "4"], Runtime(_plan(tmp, "numpy"), measure_memory=False))
    assert {n: getattr(torch.Tensor, n) for n in before} == before
