"""engine/models/gguf_header.py reads what the `gguf` package's reader reads: the same keys and
values, the same tensor table, the same tensor bytes, in files of either byte order; and bytes
that are not a GGUF header give a ValueError, never another exception or a hang."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.models.gguf_header import ArrayField, read_header
from engine.models.loader import locate_model


def _same_as_gguf_reader(path) -> int:
    """Asserts that both readers agree on `path`; returns how many values were compared."""
    reference, header = gguf.GGUFReader(str(path)), read_header(path)
    compared = 0
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries for the header's counts
            continue
        value = header.fields[key]
        if isinstance(value, ArrayField):
            assert value.count == len(field.data), key
        else:
            assert value == field.contents(), key
        compared += 1
    assert len(header.fields) == compared
    assert [t.name for t in header.tensors] == [t.name for t in reference.tensors]
    for ours, theirs in zip(header.tensors, reference.tensors):
        assert (ours.tensor_type, ours.shape, ours.data_offset, ours.n_bytes) == \
            (theirs.tensor_type, tuple(theirs.shape.tolist()), theirs.data_offset,
             theirs.n_bytes), ours.name
        data, expected = header.tensor_data(ours), np.asarray(theirs.data)
        assert data.dtype == expected.dtype and data.shape == expected.shape, ours.name
        assert np.array_equal(data, expected), ours.name
        compared += 1
    return compared


def test_the_default_model_reads_as_the_gguf_package_reads_it():
    assert _same_as_gguf_reader(locate_model(None)[0]) > 250


def _write(path, endianess=gguf.GGUFEndian.LITTLE, alignment=None):
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint32("test.count", 7)
    writer.add_float32("test.scale", 0.25)
    writer.add_bool("test.flag", True)
    writer.add_string("test.name", "héllo")
    writer.add_int64("test.big", -2**40)
    writer.add_array("test.words", ["a", "bc", ""])
    writer.add_array("test.numbers", [1.5, 2.5, 3.5])
    writer.add_tensor("token_embd.weight", np.arange(40, dtype=np.float32).reshape(5, 8))
    writer.add_tensor("output.weight", np.arange(16, dtype=np.float16).reshape(2, 8))
    blocks = np.arange(2 * 34, dtype=np.uint8).reshape(2, 34)  # two Q8_0 rows of 32 weights
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_shape=(2, 34),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_written_values_read_back(tmp_path, endianess):
    path = tmp_path / "small.gguf"
    _write(path, endianess, alignment=64)
    _same_as_gguf_reader(path)
    header = read_header(path)
    assert header.string("test.name") == "héllo" and header.fields["test.count"] == 7
    assert header.fields["test.flag"] is True and header.fields["test.big"] == -2**40
    assert header.fields["test.words"].count == 3
    assert header.fields["test.numbers"].element_type == gguf.GGUFValueType.FLOAT32
    assert header.tensors[0].data_offset % 64 == 0
    embedding = header.tensor_data(header.tensors[0])
    assert embedding.tolist() == np.arange(40, dtype=np.float32).reshape(5, 8).tolist()
    # Negative control: the comparison sees a changed value.
    other = tmp_path / "other.gguf"
    _write(other, endianess, alignment=32)
    with pytest.raises(AssertionError):
        assert read_header(other).fields["general.alignment"] == 64


def test_every_cut_of_a_header_is_a_value_error(tmp_path):
    path = tmp_path / "small.gguf"
    _write(path)
    data = path.read_bytes()
    data_start = read_header(path).tensors[0].data_offset
    parsed = []
    for cut in range(0, data_start + 1):
        damaged = tmp_path / "cut.gguf"
        damaged.write_bytes(data[:cut])
        try:
            parsed.append((cut, len(read_header(damaged).tensors)))
        except ValueError:
            assert not parsed, cut  # once the table is whole, longer cuts parse too
    # Only cuts in the padding before the aligned data parse (check_gguf then finds every
    # tensor past the end), and they read the whole table.
    assert parsed and data_start - parsed[0][0] < 32 and {n for _, n in parsed} == {3}
    # An absurd count is refused before any loop over it.
    counts = bytearray(data)
    counts[16:24] = (2**62).to_bytes(8, "little")  # the number of metadata entries
    damaged.write_bytes(bytes(counts))
    with pytest.raises(ValueError, match="more than the file holds"):
        read_header(damaged)


def test_the_format_s_numbers_are_the_gguf_package_s():
    """engine/models/gguf_types.py's copy of the format's numbers (the server does not import
    the package): every value type and block type, with its block's elements and bytes, as
    the package has them; the control: a wrong size would differ."""
    from engine.models import gguf_types

    assert {t.name: int(t) for t in gguf_types.GGUFValueType} == \
        {t.name: int(t) for t in gguf.GGUFValueType}
    ours = {t.name: (int(t), *size) for t, size in gguf_types.GGML_QUANT_SIZES.items()}
    theirs = {t.name: (int(t), *size) for t, size in gguf.GGML_QUANT_SIZES.items()}
    assert len(ours) >= 32 and ours == {name: theirs[name] for name in ours}
    assert gguf_types.GGUF_DEFAULT_ALIGNMENT == gguf.GGUF_DEFAULT_ALIGNMENT
    q4 = gguf_types.GGMLQuantizationType.Q4_1
    assert gguf_types.quant_shape_to_byte_shape((3, 64), q4) == \
        gguf.quants.quant_shape_to_byte_shape((3, 64), gguf.GGMLQuantizationType.Q4_1)
    assert ours["Q4_1"] != (3, 32, 18)
    with pytest.raises(ValueError):
        gguf_types.quant_shape_to_byte_shape((3, 48), q4)
