"""CUDA graph capture under capuchin (Note [CUDA graphs] in tracer/compiled.py): refused with one
line naming the script's line, under the tracer and under the runtime, before anything is
captured; the guard is gone after the run. On this CPU build PyTorch's graph classes exist but
cannot capture: the refusal comes before any of their code runs."""

from __future__ import annotations

import pytest
import torch
from capuchin.cli import main
from click.testing import CliRunner

pytestmark = pytest.mark.emulated

SCRIPT = """\
import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
{capture}
    model(torch.randn(8, 4))
"""
CAPTURES = {
    "torch.cuda.graph": "with torch.cuda.graph(None):",
    "CUDAGraph.capture_begin": "if True:\n    torch.cuda.CUDAGraph.capture_begin(None)",
}


@pytest.mark.parametrize("what", sorted(CAPTURES))
@pytest.mark.parametrize(
    "command",
    [
        ["trace", "--device", "cpu", "-o", "{tmp}/t.parquet"],
        ["run", "--budget", "100M", "--device", "cpu", "--report", "{tmp}/r.json"],
    ],
)
def test_a_cuda_graph_capture_is_refused_up_front(tmp_path, command, what):
    graphs = torch.cuda.graphs
    originals = (graphs.graph.__init__, graphs.CUDAGraph.capture_begin)
    script = tmp_path / "src" / "graphed.py"
    script.parent.mkdir()
    script.write_text(SCRIPT.format(capture=CAPTURES[what]))
    args = [a.format(tmp=tmp_path) for a in command]
    r = CliRunner().invoke(main, [*args, str(script)])
    assert r.exit_code == 1, r.output
    err = [line for line in r.output.splitlines() if line.startswith("capuchin: error:")]
    assert len(err) == 1, r.output
    line = 10 if what == "torch.cuda.graph" else 11
    assert f"{script}:{line}: {what} cannot run under capuchin" in err[0], err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"], "nothing written"
    assert (graphs.graph.__init__, graphs.CUDAGraph.capture_begin) == originals, "guard gone"


def test_the_guards_install_where_dynamo_lacks_the_skip_handler(monkeypatch):
    """A torch without ``CatchErrorsWrapper._handle_skip`` (an older Dynamo; the GPU machine's
    torch may be one): installing the guards must not fail, and what they refuse stays
    refused."""
    import torch._dynamo.convert_frame as convert_frame
    from capuchin.tracer.compiled import CompileGuard, CompileRefused, CudaGraphRefused

    monkeypatch.delattr(convert_frame, "CatchErrorsWrapper")
    original = torch.compile
    CompileGuard.install()
    try:
        with pytest.raises(CompileRefused, match="reduce-overhead"):
            torch.compile(lambda x: x, mode="reduce-overhead")
        with pytest.raises(CudaGraphRefused):
            torch.cuda.graph(None)
    finally:
        CompileGuard.uninstall()
    assert torch.compile is original


def test_torch_compile_is_refused_where_inductor_cannot_wrap_regions(monkeypatch):
    """A torch whose Inductor config has no ``wrap_inductor_compiled_regions``: compiled regions
    cannot be made ops, so torch.compile is refused with one line while the guard is
    installed (it would otherwise run kernels capuchin cannot see)."""
    import capuchin.tracer.compiled as compiled
    import torch._inductor.config as ic

    monkeypatch.setattr(compiled, "_region_wrapper", lambda: False)
    wrap = ic.wrap_inductor_compiled_regions
    compiled.CompileGuard.install()
    try:
        assert ic.wrap_inductor_compiled_regions == wrap  # left alone
        with pytest.raises(compiled.CompileRefused, match="cannot make a compiled region one op"):
            torch.compile(lambda x: x)
    finally:
        compiled.CompileGuard.uninstall()
    assert ic.wrap_inductor_compiled_regions == wrap
