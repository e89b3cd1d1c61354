"""The ids of Note [Tensor and storage ids]: one type, formatted and parsed in one place."""

from __future__ import annotations

import pytest
from capuchin.tracer.schema import (
    IdKind,
    TensorId,
    id_kind,
    input_id,
    output_id,
    resident_id,
    scratch_id,
)


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("12:0", TensorId(IdKind.OUTPUT, 12, 0)),
        ("x3:7", TensorId(IdKind.INPUT, 3, 7)),
        ("r41", TensorId(IdKind.RESIDENT, 41)),
        ("~5", TensorId(IdKind.SCRATCH, 5)),
    ],
)
def test_parse_and_format_are_inverse(text, parsed):
    assert TensorId.parse(text) == parsed
    assert parsed.format() == text
    assert id_kind(text) is parsed.kind


def test_formatters_build_the_ids_the_parser_reads():
    assert TensorId.parse(output_id(4, 1)) == TensorId(IdKind.OUTPUT, 4, 1)
    assert TensorId.parse(input_id(0, 2)) == TensorId(IdKind.INPUT, 0, 2)
    assert TensorId.parse(resident_id(9)) == TensorId(IdKind.RESIDENT, 9)
    assert TensorId.parse(scratch_id(3)) == TensorId(IdKind.SCRATCH, 3)


@pytest.mark.parametrize(
    "bad", ["", "x", "x3", "3", "r", "r1:2", "1:2:3", "a:b", "x-1:2", "１:2", "~", "3:"]
)
def test_malformed_ids_are_refused(bad):
    with pytest.raises(ValueError, match="not a tensor or storage id"):
        TensorId.parse(bad)
