"""What quiet steps do to a speculative engine's steps, counted on any machine: per prompt and
method, the steps a request takes (synchronous, quiet, landing-only) and the drafts it verifies,
with overlap off and on (engine/spec_decode/quiet_steps.py), and a projected time from per-step
costs measured on a GPU (`--step-ms`).

    python -m benchmarks.experiments.quiet_policy [--methods ngram,suffix] [--max-tokens 128]
        [--step-ms none_overlapped,spec_sync,landing] [--output J]

Greedy tokens are the same in every run (checked), so the step counts are the rule's doing.
The prompts are written here, not the benchmark sets, so a rule is not tuned on what measures it.
On a GPU a quiet step costs what an overlapped `none` step does, a synchronous speculative step
what `profile_step` measured for it; the projection is a guide, not a measurement.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.machine import device_facts
from specserve.bench.report import emit

PROMPTS = {
    "copy": "Copy this paragraph word for word, then stop.\n\nThe river bends twice before the "
            "old mill, where the water slows and the herons wait. In spring the banks flood, "
            "and the path to the village disappears under a sheet of brown water for weeks. "
            "The miller's children count the days by the marks on the wall, and every year "
            "they argue about whose mark was highest. When the water goes down, the fields "
            "smell of mud and mint, and the herons leave for the lakes up north.",
    "summary": "Here is a note: 'The meeting moved to Thursday at 10. Bring the budget sheet "
               "and the list of vendors. Maria will present the new timeline, and Tom will "
               "answer questions about the warehouse lease.' Rewrite the note as a bulleted "
               "list, keeping its wording.",
    "rewrite": "Fix the typo in this function and return the whole function:\n\n"
               "def mean(values):\n    total = 0\n    for value in values:\n        total += "
               "value\n    return totl / len(values)\n",
    "chat": "Give me three tips for sleeping better, with one sentence each.",
    "code": "Write a Python function that returns the n-th prime number.",
}


def count_steps(llm, prompt: str, max_tokens: int) -> dict:
    from engine import SamplingParams

    engine = llm.engine
    counts = {"calls": 0, "sync": 0}
    propose = engine.speculation.propose

    def counted(*args, **kwargs):
        counts["sync"] += 1
        return propose(*args, **kwargs)

    engine.speculation.propose = counted
    quiet = engine.speculation.quiet
    taken = quiet.num_taken if quiet else 0
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
    request_id = engine.add_request(list(ids), SamplingParams(max_tokens=max_tokens,
                                                              temperature=0))
    tokens, stats = [], None
    while engine.has_unfinished():
        counts["calls"] += 1
        for output in engine.step():
            tokens += output.delta_token_ids
            stats = output.spec_stats or stats
    engine.speculation.propose = propose
    counts["quiet"] = (quiet.num_taken if quiet else 0) - taken
    # the rest: the prefill, and calls that land a quiet step without launching one
    counts["landing"] = max(counts["calls"] - counts["sync"] - counts["quiet"] - 1, 0)
    counts.update(tokens=len(tokens), drafts=stats.num_draft_tokens,
                  accepted=stats.num_accepted_tokens, request_id=request_id)
    return counts, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="ngram,suffix")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--step-ms", default="1.54,1.97,0.5",
                        help="a quiet step, a synchronous speculative step, a landing-only call")
    parser.add_argument("--output")
    args = parser.parse_args()
    from engine import LLM

    quiet_ms, sync_ms, landing_ms = (float(v) for v in args.step_ms.split(","))
    results = {}
    for method in args.methods.split(","):
        for rule in ("sync", "quiet"):
            llm = LLM(None, speculative_method=method, async_scheduling=rule == "quiet",
                      enable_prefix_caching=False, kv_cache_memory_gib=1.0)
            for kind, prompt in PROMPTS.items():
                counts, tokens = count_steps(llm, prompt, args.max_tokens)
                cell = results.setdefault(method, {}).setdefault(kind, {})
                reference = cell.get("sync", {}).get("_tokens")
                assert reference is None or reference == tokens, (method, kind, rule)
                counts["_tokens"] = tokens
                counts["projected_ms"] = round(counts["quiet"] * quiet_ms + counts["sync"]
                                               * sync_ms + counts["landing"] * landing_ms, 2)
                cell[rule] = counts
            del llm
    for cells in results.values():
        for cell in cells.values():
            for counts in cell.values():
                counts.pop("_tokens")
                counts.pop("request_id")
    emit({"benchmark": "quiet_policy", "date": time.strftime("%Y-%m-%d"),
          **device_facts("cpu"), "step_ms": {"quiet": quiet_ms, "sync": sync_ms,
                                             "landing": landing_ms},
          "max_tokens": args.max_tokens, "results": results}, args.output)


if __name__ == "__main__":
    main()
