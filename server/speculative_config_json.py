"""`--speculative-config '<json>'`: vLLM's speculative config, mapped onto our flags.

vLLM users start servers with e.g. `--speculative-config '{"method": "eagle3", "model": "...",
"num_speculative_tokens": 3}'`. Each key either maps onto one of our flags, or is accepted only
at the values whose meaning we already have (one GPU: a draft tensor-parallel size of 1), or is
refused with its name: never ignored. A flag given separately that says otherwise is an error.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# vLLM method -> our --speculative-method; ours are accepted under their own names too.
METHODS = {"ngram": "ngram", "suffix": "suffix", "draft_model": "draft", "eagle": "eagle",
           "eagle3": "eagle", "none": "none", "auto": "auto", "draft": "draft",
           "layer-skip": "layer-skip"}
# vLLM key -> our flag's argparse dest, where the meaning is the same.
KEYS = {
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_max": "ngram_max",
    "prompt_lookup_min": "ngram_min",
    "suffix_decoding_max_tree_depth": "suffix_max_depth",
    "suffix_decoding_max_cached_requests": "suffix_cache_max_requests",
    "suffix_decoding_max_spec_factor": "suffix_max_spec_factor",
    "suffix_decoding_min_token_prob": "suffix_min_token_prob",
}
# vLLM keys whose listed values describe what we do anyway.
FIXED = {
    "draft_tensor_parallel_size": (None, 1),
    "disable_padded_drafter_batch": (False, True),  # how vLLM pads its drafter's batch
    "rejection_sample_method": ("standard",),
    "draft_sample_method": ("probabilistic",),  # sampled requests draft from q and verify by it
}
# Where "model" goes, by our method.
MODEL_DESTS = {"eagle": "draft_head", "draft": "draft_model"}


def speculative_config_flags(text: str) -> dict[str, object]:
    """Our flags (argparse dests and values) for vLLM's JSON; ValueError naming a bad key."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--speculative-config is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError("--speculative-config must be a JSON object")
    known = {"method", "model"} | set(KEYS) | set(FIXED)
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"--speculative-config: key {unknown[0]!r} is not supported (supported: "
                         f"{', '.join(sorted(known))})")
    for key, values in FIXED.items():
        if key in config and config[key] not in values:
            raise ValueError(f"--speculative-config: {key} {config[key]!r} is not supported "
                             f"(supported: {', '.join(map(repr, values))})")
    method = config.get("method") or _detect_method(config.get("model"))
    if method not in METHODS:
        raise ValueError(f"--speculative-config: method {method!r} is not supported (supported: "
                         f"{', '.join(METHODS)})")
    flags: dict[str, object] = {"speculative_method": METHODS[method]}
    model = config.get("model")
    if model is not None:
        dest = MODEL_DESTS.get(METHODS[method])
        if dest is None:
            raise ValueError(f"--speculative-config: method {method!r} takes no model")
        flags[dest] = str(model)
    flags.update({KEYS[key]: value for key, value in config.items() if key in KEYS})
    return flags


def apply_speculative_config(args: argparse.Namespace,
                             defaults: dict[str, object]) -> argparse.Namespace:
    """`args` with --speculative-config's flags set; ValueError where a flag given separately
    (not at its default) says otherwise. Without --speculative-config, `args` unchanged."""
    text = getattr(args, "speculative_config", None)
    if text is None:
        return args
    merged = argparse.Namespace(**vars(args))
    for dest, value in speculative_config_flags(text).items():
        given = getattr(args, dest)
        if given != defaults.get(dest) and given != value:
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"--speculative-config sets {dest} to {value!r} but {flag} says "
                             f"{given!r}: give one of them")
        setattr(merged, dest, value)
    return merged


def _detect_method(model) -> str:
    """As vLLM does without a method: a head folder is EAGLE, another model is a draft model."""
    if model is None:
        raise ValueError("--speculative-config needs a method (or a model)")
    folder = Path(str(model))
    if (folder / "eagle_head.json").is_file():
        return "eagle"
    config_file = folder / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        architectures = " ".join(config.get("architectures") or [])
        if "speculators_model_type" in config or "Eagle" in architectures:
            return "eagle3"
    return "draft_model"
