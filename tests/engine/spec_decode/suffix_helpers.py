"""What the suffix tests share: finished requests to cache, and text-like token streams."""

import random

from engine.core.request import Request, RequestStatus
from engine.sampling_params import SamplingParams


def finished(prompt, output, salt=""):
    request = Request("done", list(prompt), SamplingParams(), cache_salt=salt)
    for token in output:
        request.append_output_token(token)
    request.status = RequestStatus.FINISHED_STOPPED
    return request


def phrase_text(seed, vocab=49152, num_phrases=200, longest_phrase=8):
    """`text(length)`: token sequences made of phrases from a small pool, so that substrings
    repeat as in real text (uniform tokens would never match)."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(vocab) for _ in range(rng.randrange(2, longest_phrase + 1))]
               for _ in range(num_phrases)]

    def text(length):
        tokens = []
        while len(tokens) < length:
            tokens.extend(rng.choice(phrases))
        return tokens[:length]
    return text
