"""The suffix trie in C++ (csrc/suffix_trie.cpp) and `new_trie`, which makes every suffix trie
the proposer and the global cache use: the C++ one where it builds, else the pure-Python
`suffix_tree.SuffixTrie`. Both give the same node ids, counts, matches and drafts
(tests/engine/spec_decode/test_suffix_native.py); the C++ one holds a node in ~36 bytes instead
of ~140 and a proposal step costs a few microseconds instead of ~100 (docs/performance/agentic.md).

`make install` builds it (through `native_trie_class()`; `python -m engine.spec_decode.suffix_native`
shows the compiler's output); where it cannot be built
(no compiler) or SPECSERVE_DISABLE_SUFFIX_NATIVE=1, the Python trie is used, with one log line.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from engine.core.cpp_build import build_extension
from engine.spec_decode.suffix_tree import Draft, SuffixTrie, check_max_depth

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
EXTENSION_NAME = "specserve_suffix_trie"


def _build(verbose: bool = False):
    return build_extension(EXTENSION_NAME, [SOURCE_DIR / "suffix_trie.cpp"], SOURCE_DIR,
                           cflags=["-O3"], verbose=verbose)


def native_trie_class() -> type | None:
    """The C++ trie's class, or None where it cannot be had: not built, or turned off by
    SPECSERVE_DISABLE_SUFFIX_NATIVE=1 (read on each call, so a benchmark can compare both)."""
    if os.environ.get("SPECSERVE_DISABLE_SUFFIX_NATIVE") == "1":
        return None
    return _built_class()


@functools.cache
def _built_class() -> type | None:
    """Builds (or loads) the extension once; None where it cannot be built (logged once)."""
    try:
        module = _build()
    except Exception as error:  # any build failure leaves the Python trie working
        text = str(error).strip()
        logger.warning("C++ suffix trie unavailable (%s); using the slower Python trie",
                       text.splitlines()[-1] if text else error)
        return None

    class NativeSuffixTrie(module.SuffixTrie):
        def __init__(self, max_depth: int):
            check_max_depth(max_depth)
            super().__init__(max_depth)

        def draft(self, matched: Sequence[int], tail: Sequence[int], num_tokens: int,
                  max_spec_factor: float, min_token_prob: float) -> Draft | None:
            found = super().draft(matched, tail, num_tokens, max_spec_factor, min_token_prob)
            return None if found is None else Draft(*found)

    return NativeSuffixTrie


def new_trie(max_depth: int):
    """A suffix trie of this depth: the C++ one where it is available."""
    return (native_trie_class() or SuffixTrie)(max_depth)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    _build(verbose=True)
    print(f"built {EXTENSION_NAME}")
