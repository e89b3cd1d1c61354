"""torch.compile under capuchin (Note [torch.compile] in tracer/compiled.py): refused up front
with one line, since Dynamo would silently train eagerly under capuchin's dispatch mode; with
Dynamo disabled the script trains eagerly with and without capuchin, bitwise alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from capuchin.cli import main
from capuchin.planner.api import make_plan
from capuchin.runtime.engine import Runtime
from capuchin.testing.training import run_example, state_mismatches
from capuchin.tracer.script import trace_script
from click.testing import CliRunner

SCRIPT = Path(__file__).resolve().parent / "frameworks" / "compiled_lm.py"


@pytest.mark.parametrize(
    "command",
    [["trace", "-o", "{tmp}/t.parquet"], ["run", "--budget", "100M", "--report", "{tmp}/r.json"]],
)
def test_compiled_script_is_refused_up_front(tmp_path, command):
    original = torch.compile
    args = [a.format(tmp=tmp_path) for a in command]
    r = CliRunner().invoke(main, [*args, str(SCRIPT), "--steps", "2"])
    assert r.exit_code == 1, r.output
    err = [line for line in r.output.splitlines() if line.startswith("capuchin: error:")]
    assert len(err) == 1, r.output
    line = next(
        i for i, t in enumerate(SCRIPT.read_text().splitlines(), 1) if "torch.compile(" in t
    )
    assert f"{SCRIPT}:{line}: torch.compile cannot run under capuchin" in err[0]
    assert "TORCHDYNAMO_DISABLE=1" in err[0]
    assert list(tmp_path.iterdir()) == [], "nothing written"
    assert torch.compile is original, "the guard is gone after the run"


@pytest.mark.slow
def test_dynamo_disabled_trains_bitwise_under_a_plan(tmp_path, monkeypatch):
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo.config, "disable", True)
    trace = trace_script(
        SCRIPT, ["--steps", "6"], output=tmp_path / "t.parquet", log=lambda m: None
    )
    plan = make_plan(trace, "70%")
    assert plan.decisions
    rt = Runtime(plan)
    got = run_example(SCRIPT, ["--steps", "4"], rt)
    assert state_mismatches(run_example(SCRIPT, ["--steps", "4"]), got) == []
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
    assert len(its) == 3 and not any(s.diverged for s in its)
    assert all(s.evictions > 0 and s.peak_bytes <= plan.budget_bytes for s in its), (
        [s.peak_bytes for s in its],
        plan.budget_bytes,
    )


def test_a_model_compiled_before_capuchin_started_is_refused_at_its_first_call():
    """The Python API after torch.compile: Dynamo would skip the compiled model for the mode;
    the first call raises instead, naming the script's line."""
    from capuchin.errors import CapuchinError
    from torch import nn
    from torch._dynamo.convert_frame import CatchErrorsWrapper

    torch._dynamo.reset()  # nothing compiled by an earlier test stands in for this model's frames
    original = CatchErrorsWrapper._handle_skip
    model = nn.Linear(8, 2)
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CapuchinError, match=r"test_frameworks_compile.py:\d+: a function compiled"):
        with Runtime(device="cpu", budget_bytes=10**9, measure_memory=False):
            compiled(torch.randn(4, 8)).sum().backward()
            opt.step()
    assert CatchErrorsWrapper._handle_skip is original


def test_an_empty_plan_lets_torch_compile_through(tmp_path, monkeypatch):
    """A plan that evicts nothing installs no dispatch mode (Note [Empty plan]): Dynamo would
    compile as without capuchin, so torch.compile is not refused."""
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo.config, "disable", True)  # trace quickly, eagerly
    trace = trace_script(
        SCRIPT, ["--steps", "4"], output=tmp_path / "t.parquet", log=lambda m: None
    )
    monkeypatch.setattr(torch._dynamo.config, "disable", False)
    plan = make_plan(trace, "100%")
    assert not plan.decisions
    original = torch.compile
    with Runtime(plan, measure_memory=False):
        assert torch.compile is original
