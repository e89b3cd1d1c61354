"""A script may set a default device (``torch.set_default_device("cuda")``; the GPU check's
wrapper does): a tensor capuchin makes for itself without naming a device then lands there. On
the H200 the pinned host pool's buffers did (``torch.empty(n, pin_memory=True)``: "Only dense
CPU tensors can be pinned", dynamic mode's first swap). So every tensor factory call in the
runtime and the tracer names its device."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FACTORIES = {"empty", "zeros", "ones", "full", "arange", "tensor", "randn", "rand", "empty_strided"}


def _unnamed(path: Path, root: Path = ROOT) -> list[str]:
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        f = node.func
        if not (isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES):
            continue
        if not any(k.arg == "device" for k in node.keywords):
            bad.append(f"{path.relative_to(root)}:{node.lineno} torch.{f.attr}")
    return bad


def test_every_tensor_factory_in_the_runtime_and_the_tracer_names_its_device():
    files = [p for d in ("runtime", "tracer") for p in sorted((ROOT / d).rglob("*.py"))]
    assert files
    bad = [b for p in files for b in _unnamed(p)]
    assert not bad, bad


def test_the_check_sees_a_call_without_a_device(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import torch\nx = torch.empty(4, pin_memory=True)\ny = torch.ones(2, device='cpu')\n"
    )
    assert [b.split(" ")[1] for b in _unnamed(src, tmp_path)] == ["torch.empty"]
