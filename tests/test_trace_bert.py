"""Tracing an unmodified third-party model: Hugging Face transformers' BERT (masked LM), built
from a tiny config with random weights (no download), dropout active, trained a few steps."""

from __future__ import annotations

import capuchin
import pytest
from capuchin.testing.training import train_tiny_bert
from capuchin.tracer.schema import Col, Phase
from capuchin.tracer.summary import summarize


@pytest.mark.slow
def test_trace_hugging_face_bert(tmp_path):
    out = tmp_path / "bert.trace.parquet"
    with capuchin.Tracer(out, iterations=2, warmup=1, device="cpu", log=None):
        train_tiny_bert(10, batch=4, seq=32)
    trace = capuchin.load_trace(out)
    s = summarize(trace)
    assert trace.meta.iterations == [1, 2] and s.regular
    assert s.ops_by_phase[Phase.FORWARD.value] > 50 and s.ops_by_phase[Phase.BACKWARD.value] > 50
    assert s.ops_by_phase[Phase.OPTIMIZER.value] > 0
    ops = trace.ops[trace.ops[Col.ITERATION] == 2]
    # dropout is active and recorded as random-number-drawing ops
    assert ops[Col.SEEDED].fillna(False).sum() >= 5, sorted(set(ops[Col.OP_NAME]))
    assert s.transient_peak_bytes == s.allocator_peak_bytes or (
        abs(s.transient_peak_bytes - s.allocator_peak_bytes) <= 0.02 * s.allocator_peak_bytes
    )
    acc = trace.accesses
    a = acc[acc[Col.ITERATION] == 1][[Col.OP_NAME, Col.TENSOR, Col.STORAGE]].reset_index(drop=True)
    b = acc[acc[Col.ITERATION] == 2][[Col.OP_NAME, Col.TENSOR, Col.STORAGE]].reset_index(drop=True)
    assert a.equals(b)
