"""Tracing an unmodified third-party model: Hugging Face transformers' BERT (masked LM), built
from a tiny config with random weights (no download), dropout active, trained a few steps."""

from __future__ import annotations

import capuchin
import pytest
from capuchin.tracer.schema import Col, Phase
from capuchin.tracer.summary import summarize


def _train_bert(steps: int) -> None:
    import torch
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=500,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    model = BertForMaskedLM(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (4, 32))
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
        opt.zero_grad()
        out.loss.backward()
        opt.step()


@pytest.mark.slow
def test_trace_hugging_face_bert(tmp_path):
    out = tmp_path / "bert.trace.parquet"
    with capuchin.Tracer(out, iterations=2, warmup=1, device="cpu", log=None):
        _train_bert(steps=10)
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
