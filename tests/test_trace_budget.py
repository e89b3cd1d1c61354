"""Tracing under a memory cap (`capuchin trace --budget`, Note [Tracing under a budget] in
tracer/record.py): the trace is the unmanaged program's, the run stayed within the cap."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from capuchin.tracer.reader import load_trace
from capuchin.tracer.schema import COLUMNS, Col, Role
from capuchin.tracer.summary import summarize
from capuchin.tracing import trace_script

ROOT = Path(__file__).resolve().parent.parent
CNN = ROOT / "traces" / "cnn.py"

# every column but the device timeline: what the program did, not how long it took
SAME = [c for c in COLUMNS if c not in (Col.START_NS, Col.DURATION_NS)]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    d = tmp_path_factory.mktemp("budget")
    quiet = {"log": lambda line: None}
    free = trace_script(
        CNN, ["--steps", "5"], output=d / "free.parquet", iterations=2, device="cpu", **quiet
    )
    peak = summarize(load_trace(free)).peak_bytes
    cap = int(0.6 * peak)
    capped = trace_script(
        CNN,
        ["--steps", "5"],
        output=d / "capped.parquet",
        iterations=2,
        device="cpu",
        budget_bytes=cap,
        **quiet,
    )
    return load_trace(free), load_trace(capped), cap


def _rows(trace):
    def cell(v):
        if hasattr(v, "tolist"):  # the shape column holds arrays
            return tuple(v.tolist())
        return None if v is None or v != v else v  # NaN / NA -> None

    ev = trace.events[SAME].reset_index(drop=True)
    return [tuple(cell(v) for v in row) for row in ev.astype(object).itertuples(index=False)]


def test_capped_trace_records_the_unmanaged_program(traced):
    free, capped, cap = traced
    a, b = _rows(free), _rows(capped)
    assert len(a) == len(b)
    diff = [(x, y) for x, y in zip(a, b, strict=True) if x != y]
    assert not diff, diff[:3]
    # scratch rows come from the allocator's events inside each op's profiler range: equal only
    # if the runtime's evictions and restores stayed outside those ranges
    assert (capped.events[Col.ROLE] == Role.SCRATCH.value).sum() > 0
    assert summarize(capped).peak_bytes == summarize(free).peak_bytes
    assert capped.memory["op_peak_bytes"].tolist() == free.memory["op_peak_bytes"].tolist()
    assert capped.ops[Col.DURATION_NS].notna().all()


def test_capped_trace_stayed_within_the_cap(traced):
    free, capped, cap = traced
    meta = capped.meta
    assert meta.trace_budget_bytes == cap
    assert meta.measured_peak_bytes is not None
    assert meta.measured_peak_bytes <= 1.05 * cap
    # the cap did something: the unmanaged program peaks well above it
    assert summarize(free).peak_bytes > 1.5 * cap
    assert sum(meta.extra["passive_evictions"].values()) > 0
    assert free.meta.trace_budget_bytes is None and free.meta.measured_peak_bytes is None


def test_show_json_reports_the_cap(traced, tmp_path):
    _, capped, cap = traced
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    out = subprocess.run(
        [sys.executable, "-m", "capuchin.cli", "show", "--json", str(capped.path)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    got = json.loads(out.stdout)
    assert got["trace_budget_bytes"] == cap
    assert got["measured_peak_bytes"] == capped.meta.measured_peak_bytes
    text = subprocess.run(
        [sys.executable, "-m", "capuchin.cli", "show", str(capped.path)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    assert "traced under" in text


@pytest.mark.parametrize("budget", ["60%", "0", "lots"])
def test_trace_budget_bad_sizes(tmp_path, budget):
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "capuchin.cli",
            "trace",
            "--budget",
            budget,
            "-o",
            str(tmp_path / "t.parquet"),
            str(CNN),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "budget" in lines[0], out.stderr
    assert not (tmp_path / "t.parquet").exists()


def _train_cuda(steps: int) -> None:
    import torch

    dev = torch.device("cuda")
    torch.manual_seed(0)
    layers = []
    for _ in range(12):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(1024, 10)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8192, 1024, device=dev)).square().mean().backward()
        opt.step()


@pytest.mark.gpu
def test_cuda_trace_under_a_real_cap(tmp_path):
    """On CUDA the cap is real: the Runtime caps the process with
    ``set_per_process_memory_fraction``, so a model whose unmanaged peak is above the cap is
    traced only because passive eviction keeps it under (an out-of-memory error evicts and
    retries the op)."""
    import torch

    free = tmp_path / "f.parquet"
    with capuchin_tracer(free, None):
        _train_cuda(5)
    peak = summarize(load_trace(free)).peak_bytes
    torch.cuda.empty_cache()
    cap = int(0.6 * peak)
    capped = tmp_path / "c.parquet"
    with capuchin_tracer(capped, cap):
        _train_cuda(5)
    a, b = load_trace(free), load_trace(capped)
    assert _rows(b) == _rows(a)
    assert summarize(b).peak_bytes == peak > cap
    assert b.meta.measured_peak_bytes <= 1.05 * cap
    assert sum(b.meta.extra["passive_evictions"].values()) > 0


def capuchin_tracer(path, budget):
    from capuchin.tracing import Tracer

    return Tracer(path, iterations=2, warmup=1, device="cuda", log=None, budget_bytes=budget)


def test_a_cap_that_was_not_kept_is_warned_about(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(4):\n"
        "    opt.zero_grad(); m(torch.randn(128, 64)).sum().backward(); opt.step()\n"
    )
    warnings = {}
    for cap in (1024, 64 * 2**20):
        lines = []
        trace_script(
            script,
            [],
            output=tmp_path / f"{cap}.parquet",
            iterations=1,
            device="cpu",
            budget_bytes=cap,
            log=lines.append,
        )
        warnings[cap] = [ln for ln in lines if "warning: the trace cap" in ln]
    assert not warnings[64 * 2**20]
    assert len(warnings[1024]) == 1
    assert "the trace cap 1.00 KiB was not kept: the allocator measured" in warnings[1024][0]
