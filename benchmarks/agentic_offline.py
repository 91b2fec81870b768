"""The engine offline as an agentic target (`benchmarks/agentic.py --offline METHODS`): the same
turns as the servers get, answered by an `LLM` in this process, so the report holds the server's
tokens/s over the engine's on the same traffic (`<method>_over_offline`, issue 70's agent-loop
target: >= 0.8).

A turn's messages go through the tokenizer's chat template here (outside the timed part), then
`LLM.generate` on the ids; its seconds are the engine's alone, which is what the server is held to.
"""

from __future__ import annotations

import time

from benchmarks.agentic_run import Target
from benchmarks.agentic_workloads import Turn

OFFLINE_PREFIX = "offline-"
OFFLINE_URL = "offline:"  # a target's url: answered in this process, not over HTTP


def offline_targets(methods: list[str]) -> list[Target]:
    """Outputs are not held to the servers' (`ours` False): the template is rendered by another
    renderer, and on a GPU bfloat16 rows may round apart."""
    return [Target(OFFLINE_PREFIX + method, OFFLINE_URL + method, False) for method in methods]


class OfflineEngines:
    def __init__(self, methods: list[str], engine_options: dict):
        from engine import LLM

        options = dict(engine_options)
        model = options.pop("model", None)  # None: the default model, as the server's
        self.llms = {OFFLINE_PREFIX + method: LLM(model, speculative_method=method, **options)
                     for method in methods}

    def chat(self, target: Target, system: str | None, messages: list[dict], turn: Turn,
             max_tokens: int) -> tuple[dict, float]:
        """One turn, answered as `http_chat` answers it: (an OpenAI chat body, seconds)."""
        from engine import SamplingParams

        llm = self.llms[target.label]
        conversation = ([{"role": "system", "content": system}] if system else []) + messages
        prompt_ids = list(llm.engine.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=True)
            ["input_ids"])
        params = SamplingParams(max_tokens=max_tokens, temperature=turn.temperature,
                                seed=turn.seed)
        started = time.perf_counter()
        [output] = llm.generate([prompt_ids], params)
        seconds = time.perf_counter() - started
        stats = output.spec_stats
        usage = {"completion_tokens": len(output.token_ids)}
        if stats is not None and stats.num_draft_tokens:
            usage["speculative"] = {"draft_tokens": stats.num_draft_tokens,
                                    "accepted_tokens": stats.num_accepted_tokens}
        return {"usage": usage, "choices": [{"message": {"content": output.text}}]}, seconds


def server_over_offline(result: dict) -> dict:
    """`<method>_over_offline` for each method served and run offline in one workload's result."""
    ratios = {}
    for label, summary in result.items():
        offline = result.get(OFFLINE_PREFIX + label)
        if isinstance(summary, dict) and isinstance(offline, dict) \
                and summary.get("tokens_per_s") and offline.get("tokens_per_s"):
            ratios[f"{label}_over_offline"] = round(summary["tokens_per_s"]
                                                    / offline["tokens_per_s"], 3)
    return ratios
