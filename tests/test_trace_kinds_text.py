"""``capuchin show``'s line on iteration kinds says what ``capuchin plan`` does with them: each
kind is planned only when the most frequent one was recorded at least twice (planner/api.py
Note [Iteration kinds]); kinds recorded once each need ``--iteration``."""

from __future__ import annotations

import dataclasses

from capuchin.testing.training import TRACES
from capuchin.tracer.reader import load_trace
from capuchin.tracer.summary import format_summary, summarize


def _text(kinds: dict) -> str:
    s = summarize(load_trace(TRACES / "mlp.trace.parquet"))
    return format_summary(dataclasses.replace(s, kinds=kinds))


def test_kinds_recorded_twice_are_planned_each():
    assert "(capuchin plan plans each kind)" in _text({"train": [1, 3], "kind1": [2]})


def test_kinds_recorded_once_each_need_an_iteration():
    text = _text({"train": [3], "kind1": [2], "kind2": [1]})
    assert "plans each kind" not in text
    assert "capuchin plan needs --iteration N" in text
