"""Runtime faults of the third fault probe (../shared/reports/faults.md): a plan followed by a run
with another dtype and the shortfall line (S6)."""

from __future__ import annotations

import pytest
from capuchin.planner.api import make_plan
from capuchin.runmain import run_as_main
from capuchin.runtime.engine import Runtime
from capuchin.testing.training import run_example, state_mismatches
from capuchin.tracer.record import Tracer

# an MLP whose dtype is an option; its plan is made at float32
DTYPED = """
import argparse
import torch
p = argparse.ArgumentParser()
p.add_argument("--dtype", default="float32")
p.add_argument("--steps", type=int, default=4)
a = p.parse_args()
torch.manual_seed(0)
dt = getattr(torch, a.dtype)
m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                        torch.nn.Tanh(), torch.nn.Linear(256, 10)).to(dt)
opt = torch.optim.Adam(m.parameters(), lr=1e-3)
for _ in range(a.steps):
    x = torch.randn(512, 64, dtype=dt)
    loss = m(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.fixture(scope="module")
def dtyped(tmp_path_factory):
    """(script, its swap plan at 70% of its float32 trace)."""
    d = tmp_path_factory.mktemp("dtyped")
    script = d / "dtyped.py"
    script.write_text(DTYPED)
    with Tracer(d / "t.parquet", iterations=1, warmup=1, device="cpu", log=None):
        run_as_main(script, [])
    plan = make_plan(d / "t.parquet", budget="70%", policy="swap", allow_infeasible=True)
    assert plan.decisions
    return script, plan


def test_a_float64_run_of_a_float32_plan_diverges_and_trains_bitwise(dtyped):
    """S6: names and shapes match, sizes do not; the run followed the plan with no divergence."""
    script, plan = dtyped
    args = ["--dtype", "float64"]
    rt = Runtime(plan, measure_memory=False)
    got = run_example(script, args, rt)
    assert state_mismatches(run_example(script, args), got) == []
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
    assert its and all(s.diverged for s in its)


def test_a_float32_run_of_its_plan_does_not_diverge(dtyped):
    script, plan = dtyped
    rt = Runtime(plan, measure_memory=False)
    assert state_mismatches(run_example(script, []), run_example(script, [], rt)) == []
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
    assert its and not any(s.diverged for s in its) and all(s.evictions for s in its)


def test_the_shortfall_line_agrees_with_the_measured_peak():
    """S6: the estimate said 1.3 MiB over while the allocator measured 9.7 MiB over."""
    from capuchin.runtime.report import IterationStats, RunReport

    mib = 2**20
    its = [
        IterationStats(i, peak_bytes=12 * mib, time_s=0.1, passive_short_bytes=mib + mib // 4)
        for i in range(3)
    ]
    text = RunReport(3 * mib, "cpu", None, its).summary()
    assert "budget not reachable: up to 9.0 MiB over it" in text, text
    its[1].peak_bytes = None  # not measured: the estimate is all there is
    its[0].peak_bytes = its[2].peak_bytes = 3 * mib
    text = RunReport(3 * mib, "cpu", None, its).summary()
    assert "budget not reachable: up to 1.2 MiB over it" in text, text
