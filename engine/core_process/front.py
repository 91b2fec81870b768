"""The front's own copy of what the engine checks a request against, so a request is refused in
the API process (a 400 before any streaming), as `LLMEngine.make_request` refuses it in the
in-thread mode.

The front loads the engine's tokenizer from the folder the engine process names, and keeps its
own grammar compiler over it: the server compiles a constraint here, off its event loop, to find
what does not compile; the engine process compiles the same constraint (plain data) again, off
its step loop.
"""

from __future__ import annotations

import uuid

from engine.config import EngineConfig, EngineLimits
from engine.core.block_manager import BlockManager
from engine.core.intake import check_fits, check_prompt_ids
from engine.core.request import Request
from engine.core_process.wire import Ready
from engine.grammar import GrammarCompiler
from engine.sampling_params import SamplingParams


def load_tokenizer(ready: Ready):
    """The tokenizer the engine process loaded, read the same way (engine/models/loader.py)."""
    if ready.native_tokenizer:
        from engine.models.gguf_native import load_tokenizer as load_gguf_tokenizer

        return load_gguf_tokenizer(ready.model_folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ready.model_folder)


class FrontValidator:
    def __init__(self, config: EngineConfig, ready: Ready, tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = ready.vocab_size
        self.eos_token_ids = frozenset(ready.eos_token_ids)
        self.limits = EngineLimits(num_kv_blocks=ready.num_kv_blocks,
                                   block_size=ready.block_size,
                                   max_model_len=ready.max_model_len)
        # Holds no blocks: it answers how many tokens of KV a request can need at once, which
        # depends only on the block size and the window.
        self._kv_shape = BlockManager(0, ready.block_size, config.cache.enable_prefix_caching,
                                      ready.kv_window)
        self.grammars = GrammarCompiler(tokenizer, ready.vocab_size, ready.eos_token_ids)

    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None, cache_salt: str = "") -> Request:
        """Tokenizes and validates as `LLMEngine.make_request` does; raises ValueError with a
        message fit for an API client."""
        if isinstance(prompt, str):
            prompt_text, token_ids = prompt, self.tokenizer(prompt)["input_ids"]
        else:
            prompt_text, token_ids = None, list(prompt)
            check_prompt_ids(token_ids, self.vocab_size)
        check_fits(token_ids, params, self.limits, self._kv_shape, self.config)
        if params.structured is not None:  # what does not compile is refused here
            self.grammars.matcher(params.structured)
        return Request(request_id=request_id or uuid.uuid4().hex, prompt_token_ids=token_ids,
                       sampling_params=params, eos_token_ids=self.eos_token_ids,
                       prompt_text=prompt_text, cache_salt=cache_salt)
