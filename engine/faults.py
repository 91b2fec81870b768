"""Faults injected for tests, never otherwise: `SPECSERVE_FAULT` names the faults armed (comma
separated), read once when an engine starts. An armed fault fires in a step that holds a request
whose prompt text contains its marker, `[fault:<name>]`, so a test chooses which request, and
when, while every other request runs as usual.

- `nan_logits`: that request's logits rows are NaN (a numerical fault in one request's rows);
- `row_error`: verifying that request's rows raises;
- `grammar_error`: that request's grammar fails once it has emitted two tokens (mid-generation);
- `detokenize_error`: turning that request's tokens into text raises (a tokenizer error);
- `step_error`: the step raises before the model runs, in no one request's part (unattributed);
- `oom`: the step raises torch's out-of-memory error there, as a CUDA allocation would.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

FAULT_ENV = "SPECSERVE_FAULT"
FAULTS = ("nan_logits", "row_error", "grammar_error", "detokenize_error", "step_error", "oom")
GRAMMAR_ERROR_AFTER = 2  # output tokens before an armed grammar_error fires


class InjectedFault(RuntimeError):
    """An error raised on purpose by an armed fault."""


def marker(name: str) -> str:
    """What a prompt holds to fire fault `name`."""
    return f"[fault:{name}]"


class Faults:
    def __init__(self, armed: frozenset[str] = frozenset()):
        self.armed = armed
        self._marked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> names

    @classmethod
    def from_env(cls) -> "Faults":
        names = frozenset(n.strip() for n in os.environ.get(FAULT_ENV, "").split(",") if n.strip())
        unknown = sorted(names - set(FAULTS))
        if unknown:
            raise ValueError(f"{FAULT_ENV}: unknown faults {', '.join(unknown)}; "
                             f"known: {', '.join(FAULTS)}")
        if names:
            logger.warning("%s=%s: faults armed (a test)", FAULT_ENV, ",".join(sorted(names)))
        return cls(names)

    def note(self, request, tokenizer) -> None:
        """At intake: which armed faults the request's prompt marks (its text, or its token ids
        decoded once, as the server sends them)."""
        if not self.armed:
            return
        text = request.prompt_text
        if text is None:
            text = tokenizer.decode(request.prompt_token_ids)
        names = {name for name in self.armed if marker(name) in text}
        if names:
            self._marked[request] = names

    def marked(self, name: str, requests: Sequence) -> list[int]:
        """Indices of the requests on which armed fault `name` fires."""
        if name not in self.armed:
            return []
        return [i for i, r in enumerate(requests) if name in self._marked.get(r, ())]

    def raise_if(self, name: str, requests: Sequence) -> None:
        if self.marked(name, requests):
            if name == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory (injected: SPECSERVE_FAULT=oom)")
            raise InjectedFault(f"injected fault {name}")

    def grammar_check(self, request) -> None:
        """Called before each of a constrained request's masks is built."""
        if request.num_output_tokens >= GRAMMAR_ERROR_AFTER and \
                self.marked("grammar_error", [request]):
            raise InjectedFault("injected fault grammar_error: the grammar failed")

    def corrupt_logits(self, requests: Sequence, row_starts: Sequence[int],
                       logits: torch.Tensor) -> None:
        for i in self.marked("nan_logits", requests):
            rows = len(requests[i].draft_token_ids) + 1
            with torch.inference_mode():
                logits[row_starts[i]:row_starts[i] + rows] = float("nan")
