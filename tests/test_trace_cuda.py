"""CUDA tracing (needs a GPU; skipped without one): kernel times per op on the GPU timeline and
the steady peak against torch.cuda.max_memory_allocated."""

from __future__ import annotations

import capuchin
import pytest
from capuchin.tracer.schema import Col
from capuchin.tracer.summary import summarize


@pytest.mark.gpu
def test_trace_on_cuda(tmp_path):
    import torch

    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 2048),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(2048, 10),
    ).to(dev)
    opt = torch.optim.Adam(model.parameters())
    out = tmp_path / "cuda.trace.parquet"
    with capuchin.Tracer(out, iterations=2, warmup=1, device="cuda", log=None):
        for _ in range(10):
            opt.zero_grad()
            model(torch.randn(256, 512, device=dev)).square().mean().backward()
            opt.step()
    trace = capuchin.load_trace(out)
    assert trace.meta.device == "cuda" and trace.meta.regular
    ops = trace.ops[trace.ops[Col.ITERATION] == 2]
    mm = ops[ops[Col.OP_NAME].str.contains("addmm|mm")]
    assert len(mm) and (mm[Col.DURATION_NS] > 0).all()  # kernel times were attributed
    assert ops[Col.START_NS].is_monotonic_increasing
    s = summarize(trace)
    cuda = trace.meta.extra["cuda_memory_allocated_bytes"][str(s.steady_iteration)]
    # PyTorch's measurement of the same iteration: the rise of max_memory_allocated above what was
    # allocated when it started (like with like: memory no op touched cancels out)
    rise = cuda["max"] - cuda["start"]
    ours = s.peak_bytes - s.start_bytes
    assert abs(ours - rise) <= 0.02 * rise, (ours, rise)
    assert trace.meta.bandwidth_h2d_bytes_per_s > 1e8
