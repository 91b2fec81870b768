"""Whether servers that should compute alike generated the same answers, prompt by prompt, from
the `outputs` digests `bench serve` records (greedy runs: equal tokens give equal digests).

vs_llamacpp.sh's two GGUF specserve servers (`none` and `ngram`) run the same weights and kernels,
so losslessness says their greedy answers are equal; the float32 server runs other weights, and
llama.cpp other arithmetic, so neither is compared.
"""

from __future__ import annotations


def same_weights_labels(labels: list[str]) -> list[str]:
    """The specserve servers of vs_llamacpp.sh that run the GGUF file natively."""
    return [label for label in labels
            if label.startswith("specserve-") and not label.endswith("-float32")]


def digests_by_prompt(result: dict) -> dict[str, list[str]]:
    """{prompt id: its answers' digests, sorted} (a prompt may be sent more than once)."""
    found: dict[str, list[str]] = {}
    for prompt_id, digest, *_ in result.get("outputs") or []:
        found.setdefault(prompt_id, []).append(digest)
    return {prompt_id: sorted(digests) for prompt_id, digests in found.items()}


def disagreements(cells: dict[tuple, dict[str, dict]], labels: list[str]) -> list[dict]:
    """Per (workload, concurrency) of `cells` ({(kind, concurrency): {label: result}}, as
    vs_llamacpp.throughput_cells groups a serve report), the prompts whose answers from a server
    in `labels` differ from the first such server's; a prompt answered by only one of them counts
    as differing. [] where every compared cell agrees."""
    found = []
    for (kind, concurrency), by_label in cells.items():
        present = [label for label in labels if label in by_label]
        if not present:
            continue
        first = digests_by_prompt(by_label[present[0]])
        for label in present[1:]:
            other = digests_by_prompt(by_label[label])
            differing = sorted(p for p in first.keys() | other.keys()
                               if first.get(p) != other.get(p))
            if differing:
                found.append({"workload": kind, "concurrency": concurrency,
                              "servers": [present[0], label], "prompts": differing})
    return found


def without_texts(serve_report: dict) -> dict:
    """The report with each answer's text dropped and its digest kept (texts stay in the parts
    `bench serve --keep-texts` wrote)."""
    runs = [{**run, "results": [
        {**result, "outputs": [entry[:2] for entry in result["outputs"]]}
        if "outputs" in result else result for result in run["results"]]}
        for run in serve_report["runs"]]
    return {**serve_report, "runs": runs}
