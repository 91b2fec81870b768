"""`specserve serve`'s speculation flags: the method, how many drafts, and each method's own
settings. They map onto engine.config.SpeculativeConfig (server/cli.py builds the config)."""

from __future__ import annotations

import argparse

from engine.config import SPECULATIVE_METHODS, SUFFIX_CACHE_SCOPES
from server.speculative_config_json import apply_speculative_config


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-method", default="ngram", choices=SPECULATIVE_METHODS,
                   help="how draft tokens are proposed: none, ngram (prompt lookup), suffix "
                        "(suffix trees over the request and over finished requests' outputs), "
                        "auto (per request and step the best of suffix, ngram and eagle), eagle (a "
                        "trained draft head on the target's features, --draft-head), draft (a "
                        "smaller model, --draft-model) or layer-skip (a subset of the target's "
                        "layers) (default: %(default)s)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="most draft tokens per step; fewer when speculation does not pay "
                        "(default: 15 for suffix and auto, 5 otherwise)")
    p.add_argument("--draft-at-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="a prompt's last chunk verifies drafts too (default: where lossless)")
    p.add_argument("--draft-model", default=None,
                   help="draft model for --speculative-method draft (HF folder or .gguf)")
    p.add_argument("--draft-head", default=None,
                   help="trained head folder for --speculative-method eagle (default: the head "
                        "shipped for the model; `specserve train-draft` makes one)")
    p.add_argument("--eagle-ngram-min", type=int, default=2,
                   help="with eagle, an n-gram match of at least this many tokens may be "
                        "proposed instead of the head's guess, when its recent acceptance is at "
                        "least the head's; 0: the head only (default: %(default)s)")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="layers the layer-skip draft runs (default: chosen by calibration)")
    p.add_argument("--draft-layer-ids", type=_layer_ids, default=None,
                   help="exactly these layers for layer-skip, e.g. 0,1,2,28,29")
    p.add_argument("--ngram-max", type=int, default=4,
                   help="longest n-gram the ngram proposer looks up (default: %(default)s)")
    p.add_argument("--ngram-min", type=int, default=1,
                   help="shortest n-gram the ngram proposer looks up (default: %(default)s)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's speculative config as JSON, e.g. '{\"method\": \"eagle3\", "
                        "\"model\": \"HEAD\", \"num_speculative_tokens\": 3}': method (ngram, "
                        "suffix, draft_model, eagle, eagle3), model, num_speculative_tokens, "
                        "prompt_lookup_min/max, suffix_decoding_*; a key not supported is an "
                        "error (docs/bring-your-own-speculator.md)")
    add_suffix_arguments(p)


def with_speculative_config(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with --speculative-config's JSON turned into our flags (ValueError on a key we
    do not support, or on a separate flag that says otherwise)."""
    defaults = argparse.ArgumentParser(add_help=False)
    add_speculative_arguments(defaults)
    return apply_speculative_config(args, vars(defaults.parse_args([])))


def add_suffix_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suffix-max-depth", type=int, default=24,
                   help="suffix: longest substring the suffix tries hold (default: %(default)s)")
    p.add_argument("--suffix-max-spec-factor", type=float, default=1.0,
                   help="suffix: a match of m tokens drafts at most this x m tokens "
                        "(default: %(default)s)")
    p.add_argument("--suffix-min-token-prob", type=float, default=0.1,
                   help="suffix: a draft stops where its estimated probability falls below "
                        "this (default: %(default)s)")
    p.add_argument("--suffix-cache-max-requests", type=int, default=10000,
                   help="suffix: finished requests kept in the global cache, oldest evicted "
                        "first (default: %(default)s)")
    p.add_argument("--suffix-cache-max-bytes", type=int, default=32 * 2**20,
                   help="suffix: bytes the global cache's tries and kept tokens may hold "
                        "(default: %(default)s)")
    p.add_argument("--suffix-cache-scope", default="tenant", choices=SUFFIX_CACHE_SCOPES,
                   help="suffix: tenant (default): a request drafts only from outputs of "
                        "requests with its API key and cache_salt; global: from all")
    p.add_argument("--suffix-cache-prompts", action="store_true",
                   help="suffix: also keep finished requests' whole prompts in the global cache")


def _layer_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}")
