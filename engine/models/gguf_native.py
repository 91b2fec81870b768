"""A GGUF file loaded natively: quantized matrices stay in their blocks (see engine/quant/).

Only the configuration and the tokenizer go through transformers, once per file, into a small
cached folder (no weights in it); the header and the tensors are read straight from the file
(gguf_header.py). Types the CPU kernel covers (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) stay packed; float
tensors load as float32; other block types are dequantized to float32, named in one log line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from engine.models.gguf_config import complete_config
from engine.models.gguf_header import read_header
from engine.models.gguf_names import NORMS_PLUS_ONE, hf_tensor_name
from engine.quant.formats import FORMATS
from engine.quant.gguf_weight import PackedTensor

logger = logging.getLogger(__name__)

_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


def rope_unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (interleaved rotary pairs per head back
    to the two-halves layout the Hugging Face checkpoint had)."""
    half = num_rows // num_heads // 2
    return torch.arange(num_rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(-1)


def read_tensors(path: Path, hf_config) -> Iterator[tuple[str, torch.Tensor | PackedTensor]]:
    """Yields (Hugging Face name, tensor) for every tensor of the file, packed where a kernel
    exists."""
    header = read_header(path)
    architecture = header.string("general.architecture")
    unpermute = architecture == "llama"  # llama.cpp's converter permutes q/k of llama only
    dequantized: set[str] = set()
    for tensor in header.tensors:
        name = hf_tensor_name(tensor.name, architecture)
        if name is None:
            continue
        data = header.tensor_data(tensor)
        if "{expert}" in name:  # [experts, rows, ...]: each expert's rows are its own matrix
            for expert in range(data.shape[0]):
                yield name.format(expert=expert), _tensor_value(tensor, data[expert], dequantized)
            continue
        value = _tensor_value(tensor, data, dequantized)
        if unpermute and (".q_proj." in name or ".k_proj." in name):
            heads = hf_config.num_attention_heads if ".q_proj." in name \
                else hf_config.num_key_value_heads
            value = _take_rows(value, rope_unpermute_rows(_num_rows(value), heads))
        if architecture in NORMS_PLUS_ONE and name.endswith("norm.weight"):
            value = value - 1  # stored as 1 + w; the model adds the 1 back (norm_weight_offset)
        yield name, value
    if dequantized:
        logger.warning("GGUF block types without a CPU kernel, dequantized to float32: %s",
                       ", ".join(sorted(dequantized)))


def float_tensors(path: Path, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """`read_tensors` with every block dequantized to float32 by the gguf package: an
    implementation independent of this project's kernels, so a folder of these is a reference
    for them."""
    import gguf

    for name, value in read_tensors(path, hf_config):
        if isinstance(value, PackedTensor):
            data = gguf.quants.dequantize(value.packed.numpy(),
                                          gguf.GGMLQuantizationType(value.ggml_type))
            value = torch.from_numpy(data.astype(np.float32))
        yield name, value.contiguous()


# llama.cpp architectures whose files load here (gguf_names.py, gguf_config.py). Others store
# tensors under names or with settings this loader does not map yet: refused before start.
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3")


def _tensor_value(tensor, data: np.ndarray, dequantized: set[str]) -> torch.Tensor | PackedTensor:
    """One matrix of a GGUF tensor: kept in its blocks where a kernel exists, else float32."""
    type_name = tensor.tensor_type.name
    if tensor.tensor_type.value in FORMATS:
        packed = torch.from_numpy(data.copy())  # [rows, row_bytes], owned
        return PackedTensor(packed, tensor.tensor_type.value, (packed.shape[0], int(tensor.shape[0])))
    if type_name in _FLOAT_TYPES:
        return torch.from_numpy(data.astype(np.float32))
    import gguf  # imported only here: see gguf_types.py

    dequantized.add(type_name)
    return torch.from_numpy(gguf.quants.dequantize(
        data, gguf.GGMLQuantizationType(tensor.tensor_type)).astype(np.float32))


def check_gguf(path: Path) -> None:
    """A ValueError in one line for a GGUF file that cannot serve: a header that does not parse,
    tensor data past the end of the file (truncated), an architecture not mapped here, or a
    vocabulary that is not the token embedding's."""
    size = path.stat().st_size
    damaged = f"{path} is not a readable GGUF file ({size} bytes; truncated or damaged?)"
    try:
        header = read_header(path)
    except (ValueError, OSError) as error:
        raise ValueError(f"{damaged}: {error}") from None
    for tensor in header.tensors:
        end = tensor.data_offset + tensor.n_bytes
        if end > size:
            raise ValueError(f"{damaged}: tensor {tensor.name} ends at byte {end}")
    architecture = header.string("general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF files of architecture {architecture!r} are not supported "
                         f"yet (supported: {', '.join(GGUF_ARCHITECTURES)}); serve its Hugging "
                         "Face folder instead")
    tokens = header.fields.get("tokenizer.ggml.tokens")
    embedding = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if tokens is not None and embedding is not None:
        num_tokens, num_rows = getattr(tokens, "count", 1), int(embedding.shape[-1])
        if num_tokens > num_rows:
            raise ValueError(f"{path}: tokenizer.ggml.tokens lists {num_tokens} tokens, but "
                             f"token_embd.weight has {num_rows} rows")


def gguf_types(path: Path) -> dict[str, str]:
    """Hugging Face tensor name -> GGUF type name, read from the file's header."""
    header = read_header(path)
    architecture = header.string("general.architecture")
    names = {}
    for t in header.tensors:
        name = hf_tensor_name(t.name, architecture)
        experts = range(int(t.shape[-1])) if name and "{expert}" in name else [None]
        for expert in experts:
            names[name if expert is None else name.format(expert=expert)] = t.tensor_type.name
    names.pop(None, None)
    return names


def packable(type_name: str) -> bool:
    return any(f.name == type_name for f in FORMATS.values())


def metadata_folder(path: Path, cache_root: Path) -> Path:
    """A cached folder with the file's config.json, tokenizer and generation config (no
    weights): written once per file version through transformers, atomically."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:v3".encode())
    folder = cache_root / "gguf-meta" / f"{path.stem}-{key.hexdigest()[:12]}"
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    kwargs = {"gguf_file": path.name}
    config = AutoConfig.from_pretrained(path.parent, **kwargs)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    header = read_header(path)
    complete_config(config, header.scalars(), {
        t.name: header.tensor_data(t).astype(float).tolist() for t in header.tensors
        if t.name.startswith("rope_factors_")})
    tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".staging-"))
    try:
        config.to_json_file(staging / "config.json", use_diff=False)  # every field: read_config
        tokenizer.save_pretrained(staging)
        GenerationConfig.from_model_config(config).save_pretrained(staging)
        staging.rename(folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "config.json").is_file():
            raise
    return folder


def read_config(folder: Path) -> SimpleNamespace:
    """The config.json of a metadata folder as attributes. Reading it with transformers' config
    classes would import accelerate, sympy and torch._dynamo on the way: ~90 MB of a server's
    resident memory for a file of 30 numbers."""
    with open(folder / "config.json") as file:
        return SimpleNamespace(**json.load(file))


def load_tokenizer(folder: Path):
    """The fast tokenizer of a metadata folder, without AutoTokenizer's heavy imports (see
    read_config)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(folder)


def _num_rows(value: torch.Tensor | PackedTensor) -> int:
    return value.shape[0]


def _take_rows(value: torch.Tensor | PackedTensor, rows: torch.Tensor):
    if isinstance(value, PackedTensor):
        return PackedTensor(value.packed.index_select(0, rows), value.ggml_type, value.shape)
    return value.index_select(0, rows)
