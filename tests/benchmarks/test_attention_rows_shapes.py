"""benchmarks/experiments/attention_rows.py's --shapes: the names the report keys its cells by
read back as the shapes measured."""

import pytest

from benchmarks.experiments.attention_rows import SHAPES, format_shapes, parse_shapes


def test_shapes_round_trip_and_a_malformed_one_is_refused():
    assert parse_shapes(format_shapes(SHAPES)) == list(SHAPES)
    assert parse_shapes("1x16@1700,16x1@250") == [(1, 16, 1700), (16, 1, 250)]
    with pytest.raises(ValueError):
        parse_shapes("1x16")
