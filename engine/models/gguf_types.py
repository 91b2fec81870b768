"""GGUF's numbered types, as the file format defines them: metadata value types, tensor block
types and each block type's (elements per block, bytes per block).

The `gguf` package has these too, but importing it loads yaml, sentencepiece and mistral_common
on the way (~0.2 s and ~4 MB of a server's resident memory) for a header read that needs only
these numbers. tests/engine/test_gguf_header.py checks them equal to the package's.
"""

from __future__ import annotations

from enum import IntEnum

GGUF_DEFAULT_ALIGNMENT = 32


class GGUFValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# Block type: (its number in a tensor's info, elements per block, bytes per block). Numbers 4, 5
# and 31-33 were retired by llama.cpp and never appear in files.
_BLOCK_TYPES = {
    "F32": (0, 1, 4), "F16": (1, 1, 2), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34), "Q8_1": (9, 32, 40),
    "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210), "Q8_K": (15, 256, 292),
    "IQ2_XXS": (16, 256, 66), "IQ2_XS": (17, 256, 74), "IQ3_XXS": (18, 256, 98),
    "IQ1_S": (19, 256, 50), "IQ4_NL": (20, 32, 18), "IQ3_S": (21, 256, 110),
    "IQ2_S": (22, 256, 82), "IQ4_XS": (23, 256, 136), "I8": (24, 1, 1), "I16": (25, 1, 2),
    "I32": (26, 1, 4), "I64": (27, 1, 8), "F64": (28, 1, 8), "IQ1_M": (29, 256, 56),
    "BF16": (30, 1, 2), "TQ1_0": (34, 256, 54), "TQ2_0": (35, 256, 66), "MXFP4": (39, 32, 17),
    "NVFP4": (40, 64, 36), "Q1_0": (41, 128, 18),
}

GGMLQuantizationType = IntEnum("GGMLQuantizationType",
                               {name: number for name, (number, _, _) in _BLOCK_TYPES.items()})
GGML_QUANT_SIZES = {GGMLQuantizationType[name]: (block, size)
                    for name, (_, block, size) in _BLOCK_TYPES.items()}


def quant_shape_to_byte_shape(shape: tuple[int, ...], tensor_type) -> tuple[int, ...]:
    """A tensor's shape in bytes: its rows' element count turned into their blocks' bytes."""
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    if shape[-1] % block_size:
        raise ValueError(f"a {tensor_type.name} row of {shape[-1]} elements is not a whole "
                         f"number of {block_size}-element blocks")
    return (*shape[:-1], shape[-1] // block_size * type_size)
