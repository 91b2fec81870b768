"""The offline API, shaped like vLLM's: `LLM(model=None).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Loads a model (the embedded default when `model` is None) and generates in batches.

    Keyword arguments are engine options named like the CLI flags (`dtype`, `max_num_seqs`,
    `num_kv_blocks`, ...).
    """

    def __init__(self, model: str | None = None, **engine_options):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion, all in one continuous batch; outputs keep the order
        of `prompts`."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        requests = [self.engine.make_request(p, sp) for p, sp in zip(prompts, sampling_params)]
        for request in requests:
            self.engine.add(request)
        finals: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.finished:
                        finals[output.request_id] = output
        finally:
            for request in requests:  # an interrupted call leaves nothing behind
                if request.request_id not in finals:
                    self.engine.abort(request.request_id)
        return [finals[r.request_id] for r in requests]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
