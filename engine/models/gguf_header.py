"""A GGUF file's header (metadata and tensor table), read without decoding its arrays.

The `gguf` package's GGUFReader builds a numpy view for every element of every metadata array.
For the default model's 49,152 tokens and 48,900 merges that is ~150 MB of Python objects and
~3 s on a 2-core machine, paid at each of the four reads a start made, and each read left 9-17
MB of its freed objects' pages resident. Here scalars are decoded, arrays are only counted and
skipped, and tensor data stays in the file until asked for, as a view of one read-only memory
map: ~0.1 s a read.

Layout (little- or big-endian, versions 2 and 3): magic "GGUF", version u32, tensor count u64,
metadata count u64; each metadata entry a string key, a u32 type and its value (an array: the
element type u32, a u64 count, the elements); each tensor its name, a u32 rank, u64 dimensions,
a u32 block type and a u64 offset; the tensor data from the next multiple of
`general.alignment` (32 by default).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.models.gguf_types import (GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT,
                                      GGMLQuantizationType, GGUFValueType,
                                      quant_shape_to_byte_shape)

SUPPORTED_VERSIONS = (2, 3)
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
# Tensor types whose data is read as numbers (as GGUFReader reads them); others as block bytes.
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class ArrayField:
    """A metadata array, not decoded: its element type, length and where its elements start."""
    element_type: GGUFValueType
    count: int
    offset: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: shape[0] is the row length
    data_offset: int  # from the start of the file
    n_bytes: int


class GGUFHeader:
    """`fields`: key -> int, float, bool, str or ArrayField; `tensors` in file order."""

    def __init__(self, path: Path, byte_order: str, fields: dict, tensors: list[TensorInfo]):
        self.path = path
        self.byte_order = byte_order
        self.fields = fields
        self.tensors = tensors
        self._map: np.memmap | None = None

    def string(self, key: str) -> str:
        value = self.fields.get(key)
        return value if isinstance(value, str) else ""

    def scalars(self) -> dict:
        """The scalar and string keys (arrays left out)."""
        return {key: value for key, value in self.fields.items()
                if not isinstance(value, ArrayField)}

    def tensor_data(self, tensor: TensorInfo) -> np.ndarray:
        """A read-only view of the tensor in the file: numbers shaped [..., row] for float and
        integer types, block bytes shaped [..., row bytes] for quantized ones (as GGUFReader)."""
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        dims = tuple(reversed(tensor.shape))
        raw = self._map[tensor.data_offset:tensor.data_offset + tensor.n_bytes]
        dtype = _ELEMENT_DTYPES.get(tensor.tensor_type)
        if dtype is None:
            return raw.reshape(quant_shape_to_byte_shape(dims, tensor.tensor_type))
        return raw.view(np.dtype(dtype).newbyteorder(self.byte_order)).reshape(dims)


def read_header(path: Path) -> GGUFHeader:
    """Raises ValueError for bytes that are not a GGUF header this reader supports: a wrong magic
    or version, a value running past the end of the file, a duplicate key or tensor name, an
    unknown type."""
    with open(path, "rb") as file:
        if path.stat().st_size == 0:
            raise ValueError("the file is empty")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(path, _Cursor(data))


class _Cursor:
    """Reads values in order, checking each against the end of the file."""

    def __init__(self, data: mmap.mmap):
        self.data, self.offset, self.order = data, 0, "<"

    def take(self, size: int) -> int:
        start = self.offset
        if size < 0 or start + size > len(self.data):
            raise ValueError(f"a value at byte {start} runs past the end of the file "
                             f"({len(self.data)} bytes)")
        self.offset += size
        return start

    def unpack(self, code: str):
        fmt = self.order + code
        return struct.unpack_from(fmt, self.data, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        size = self.unpack("Q")
        start = self.take(size)
        return self.data[start:start + size].decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            self.take(self.unpack("Q"))

    def remaining(self) -> int:
        return len(self.data) - self.offset


def _parse(path: Path, cursor: _Cursor) -> GGUFHeader:
    if cursor.data[:4] != b"GGUF":
        raise ValueError("no GGUF magic at the start")
    cursor.take(4)
    version = cursor.unpack("I")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        cursor.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    num_tensors, num_fields = cursor.unpack("Q"), cursor.unpack("Q")
    # Every entry takes at least 12 bytes: refuse absurd counts before looping over them.
    if 12 * (num_tensors + num_fields) > cursor.remaining():
        raise ValueError(f"the header claims {num_fields} keys and {num_tensors} tensors, "
                         "more than the file holds")
    fields: dict = {}
    for _ in range(num_fields):
        key = cursor.string()
        if key in fields:
            raise ValueError(f"duplicate key {key}")
        fields[key] = _value(cursor, _value_type(cursor.unpack("I")))
    infos = [_tensor_info(cursor) for _ in range(num_tensors)]
    alignment = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"general.alignment is {alignment!r}")
    start = -(-cursor.offset // alignment) * alignment
    tensors, names = [], set()
    for name, tensor_type, shape, offset in infos:
        if name in names:
            raise ValueError(f"duplicate tensor {name}")
        names.add(name)
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        n_bytes = int(np.prod(shape, dtype=object)) * type_size // block_size
        tensors.append(TensorInfo(name, tensor_type, shape, start + offset, n_bytes))
    return GGUFHeader(path, "<" if cursor.order == "<" else ">", fields, tensors)


def _value_type(raw: int) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise ValueError(f"unknown metadata type {raw}") from None


def _value(cursor: _Cursor, value_type: GGUFValueType):
    if value_type == GGUFValueType.STRING:
        return cursor.string()
    if value_type != GGUFValueType.ARRAY:
        return cursor.unpack(_SCALAR_FORMATS[value_type])
    element_type, count = _value_type(cursor.unpack("I")), cursor.unpack("Q")
    offset = cursor.offset
    if element_type == GGUFValueType.STRING:
        if 8 * count > cursor.remaining():
            raise ValueError(f"an array of {count} strings at byte {offset} runs past the end")
        cursor.skip_strings(count)
    elif element_type == GGUFValueType.ARRAY:
        for _ in range(count):
            _value(cursor, GGUFValueType.ARRAY)
    else:
        cursor.take(count * struct.calcsize(_SCALAR_FORMATS[element_type]))
    return ArrayField(element_type, count, offset)


def _tensor_info(cursor: _Cursor) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
    name = cursor.string()
    rank = cursor.unpack("I")
    if rank > 8:
        raise ValueError(f"tensor {name} claims {rank} dimensions")
    shape = tuple(cursor.unpack("Q") for _ in range(rank))
    raw_type = cursor.unpack("I")
    try:
        tensor_type = GGMLQuantizationType(raw_type)
    except ValueError:
        tensor_type = None
    if tensor_type not in GGML_QUANT_SIZES:
        raise ValueError(f"tensor {name} has unknown type {raw_type}")
    return name, tensor_type, shape, cursor.unpack("Q")
