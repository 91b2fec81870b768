"""Log-probabilities in OpenAI's two formats.

Completions use the legacy columns `{tokens, token_logprobs, top_logprobs, text_offset}` (the top
dictionaries always include the chosen token, as vLLM does); chat uses
`{content: [{token, logprob, bytes, top_logprobs: [...]}]}`. A token's text is the token decoded on
its own (special tokens included), so a character split across tokens shows as U+FFFD there.
"""

from __future__ import annotations

from engine.outputs import TokenLogprob
from server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


class TokenTexts:
    """Token id -> its text, decoded once per id."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False,
                                          clean_up_tokenization_spaces=False)
            self._texts[token_id] = text
        return text


class CompletionLogprobsBuilder:
    """Builds the legacy columns chunk by chunk; `text_offset` continues across chunks."""

    def __init__(self, texts: TokenTexts):
        self._texts = texts
        self._offset = 0

    def prompt(self, token_ids: list[int]) -> CompletionLogprobs:
        """Echoed prompt tokens: the engine does not score the prompt, so their logprobs are
        null."""
        out = CompletionLogprobs()
        for token_id in token_ids:
            self._add(out, self._texts(token_id), None, None)
        return out

    def generated(self, logprobs: list[TokenLogprob]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for entry in logprobs:
            token = self._texts(entry.token_id)
            top = {self._texts(token_id): value for token_id, value in entry.top}
            top.setdefault(token, entry.logprob)
            self._add(out, token, entry.logprob, top)
        return out

    def _add(self, out: CompletionLogprobs, token: str, logprob: float | None,
             top: dict[str, float] | None) -> None:
        out.tokens.append(token)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(self._offset)
        self._offset += len(token)


def merge_completion_logprobs(parts: list[CompletionLogprobs]) -> CompletionLogprobs:
    merged = CompletionLogprobs()
    for part in parts:
        merged.tokens += part.tokens
        merged.token_logprobs += part.token_logprobs
        merged.top_logprobs += part.top_logprobs
        merged.text_offset += part.text_offset
    return merged


def chat_logprobs(texts: TokenTexts, logprobs: list[TokenLogprob],
                  num_top: int) -> ChatLogprobs:
    def top_entry(token_id: int, value: float) -> TopLogprob:
        token = texts(token_id)
        return TopLogprob(token=token, logprob=value, bytes=list(token.encode()))

    content = []
    for entry in logprobs:
        chosen = top_entry(entry.token_id, entry.logprob)
        content.append(ChatTokenLogprob(
            **chosen.model_dump(),
            top_logprobs=[top_entry(t, v) for t, v in entry.top[:num_top]]))
    return ChatLogprobs(content=content)
