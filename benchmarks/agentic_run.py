"""How benchmarks/agentic.py sends a workload's turns, and what it makes of the answers.

A workload's *episodes* are independent; the turns within one are sent in order, each after the
answer to the one before, because a turn with `history` re-sends the replies (an agent loop).

  batch 1        every target answers every turn before the next turn is sent, the targets
                 taking turns on who goes first (run_interleaved)
  concurrency N  the episodes in waves of N: every target runs a wave, N episodes in flight
                 at once, before the next wave is sent, the targets taking turns on who goes
                 first (run_in_waves); a target's tokens/s is over the sum of its waves' wall
                 times, so the host's speed drifting over minutes falls on every target alike
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import httpx

from benchmarks.agentic_workloads import Turn, Workload
from specserve.bench.report import taking_turns


@dataclass(frozen=True)
class Target:
    label: str
    url: str
    ours: bool  # a specserve server: lossless speculation means its outputs equal the others'


@dataclass(frozen=True)
class TurnRecord:
    target: str
    episode: int
    turn: int
    completion_tokens: int
    seconds: float
    draft_tokens: int | None  # None: the server does not say (llama-server without timings)
    accepted_tokens: int | None
    text: str
    sampled: bool = False  # the turn's temperature was above 0


# Methods that may draft from the EAGLE head, whose drafts are sampled from its distribution.
SAMPLES_ITS_DRAFTS = ("auto", "eagle")
BASELINE_SUFFIX = "-baseline"  # an older tree's server of a method: "auto-baseline"
RATIOS_OF = ("suffix", "auto")  # the methods whose tokens/s is divided by every other target's

# (target, system prompt, messages, turn) -> (the response body, seconds it took)
Chat = Callable[[Target, str | None, list, Turn], tuple[dict, float]]


@functools.cache
def client_for(url: str) -> httpx.Client:
    """One keep-alive client per server, as an agent's SDK holds one. `httpx.post` builds a
    client per call, whose TLS context alone takes ~23 ms (AMD EPYC Zen 4): that was counted in
    every request's seconds, ~5% of a 64-token answer at batch 1, whichever server answered.
    Thread-safe: the episodes of a wave share it."""
    return httpx.Client(base_url=url, timeout=600,
                        limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))


def http_chat(target: Target, system: str | None, messages: list[dict], turn: Turn,
              max_tokens: int) -> tuple[dict, float]:
    body = {"max_tokens": max_tokens, "temperature": turn.temperature,
            "messages": ([{"role": "system", "content": system}] if system else []) + messages}
    if turn.seed is not None:
        body["seed"] = turn.seed
    client = client_for(target.url)
    started = time.perf_counter()
    response = client.post("/v1/chat/completions", json=body)
    seconds = time.perf_counter() - started
    response.raise_for_status()
    return response.json(), seconds


def speculative_counts(body: dict) -> tuple[int | None, int | None]:
    """(draft tokens, accepted tokens) of one response: specserve's `usage.speculative`, else
    llama-server's `timings.draft_n` / `draft_n_accepted` (left out when it drafted nothing),
    else (None, None): the server does not say."""
    speculative = (body.get("usage") or {}).get("speculative")
    if speculative:
        return speculative["draft_tokens"], speculative["accepted_tokens"]
    timings = body.get("timings")
    if timings is not None:
        return timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)
    return None, None


def to_record(body: dict, seconds: float, target: Target, episode: int, turn: int,
              sampled: bool = False) -> TurnRecord:
    draft, accepted = speculative_counts(body)
    return TurnRecord(target.label, episode, turn, body["usage"]["completion_tokens"], seconds,
                      draft, accepted, body["choices"][0]["message"]["content"] or "", sampled)


def turn_messages(history: list[dict], turn: Turn) -> list[dict]:
    return (history if turn.history else []) + [{"role": "user", "content": turn.user}]


def run_episode(workload: Workload, episode: int, target: Target, chat: Chat) -> list[TurnRecord]:
    """One episode's turns in order, each re-sending the history its turn asks for."""
    records, history = [], []
    for index, turn in enumerate(workload.episodes[episode]):
        messages = turn_messages(history, turn)
        record = to_record(*chat(target, workload.system, messages, turn), target, episode, index,
                           turn.temperature > 0)
        history = messages + [{"role": "assistant", "content": record.text}]
        records.append(record)
    return records


def run_interleaved(workload: Workload, targets: list[Target], chat: Chat) -> list[TurnRecord]:
    """Batch 1: every target answers a turn before the next; on the workload's n-th request the
    targets go in taking_turns order (whoever goes first runs a little slower)."""
    records, request_index = [], 0
    for episode, turns in enumerate(workload.episodes):
        histories = {target.label: [] for target in targets}
        for index, turn in enumerate(turns):
            for target in taking_turns(targets, request_index):
                messages = turn_messages(histories[target.label], turn)
                record = to_record(*chat(target, workload.system, messages, turn), target,
                                   episode, index, turn.temperature > 0)
                histories[target.label] = messages + [{"role": "assistant", "content": record.text}]
                records.append(record)
            request_index += 1
    return records


def run_concurrently(workload: Workload, target: Target, chat: Chat, concurrency: int,
                     episodes: range | None = None) -> tuple[list[TurnRecord], float]:
    """The workload's `episodes` (all by default) on one target, `concurrency` at a time:
    (records, wall s)."""
    episodes = range(len(workload.episodes)) if episodes is None else episodes
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        answered = list(pool.map(lambda episode: run_episode(workload, episode, target, chat),
                                 episodes))
    wall_s = time.perf_counter() - started
    return [record for records in answered for record in records], wall_s


def run_in_waves(workload: Workload, targets: list[Target], chat: Chat, concurrency: int,
                 first: int = 0) -> tuple[list[TurnRecord], dict[str, float]]:
    """Concurrency N, interleaved: the episodes in waves of N, every target running a wave
    before the next, whoever goes first rotating per wave (starting at `first`): (records,
    each target's wall seconds summed over its waves)."""
    records, wall_seconds = [], {target.label: 0.0 for target in targets}
    for wave, start in enumerate(range(0, len(workload.episodes), concurrency)):
        episodes = range(start, min(start + concurrency, len(workload.episodes)))
        for target in taking_turns(targets, first + wave):
            mine, seconds = run_concurrently(workload, target, chat, concurrency, episodes)
            records += mine
            wall_seconds[target.label] += seconds
    return records, wall_seconds


def renumbered(records: list[TurnRecord], offset: int) -> list[TurnRecord]:
    """The records with their episodes numbered from `offset`: a later round's episodes are
    other episodes than an earlier round's, though both count from 0."""
    return [replace(record, episode=record.episode + offset) for record in records]


def summarize(records: list[TurnRecord], targets: list[Target],
              wall_seconds: dict[str, float] | None = None) -> dict:
    """A workload's result: per target its tokens, seconds, tokens/s and acceptance; whether our
    servers' outputs agreed turn by turn; suffix's and auto's tokens/s over every other target's.

    Without `wall_seconds` (batch 1) tokens/s is over the sum of the request latencies; with it
    (concurrency > 1) over the target's wall time for the whole workload."""
    result: dict = {"requests": len({(r.episode, r.turn) for r in records}),
                    "outputs_identical_across_methods": outputs_identical(records, targets)}
    for target in targets:
        mine = [r for r in records if r.target == target.label]
        result[target.label] = target_summary(mine, (wall_seconds or {}).get(target.label))
    rates = {t.label: result[t.label]["tokens_per_s"] for t in targets}
    for measured in RATIOS_OF:
        if rates.get(measured):
            for label, rate in rates.items():
                if label != measured and rate:
                    result[f"{measured}_over_{label.replace('-', '_')}"] = \
                        round(rates[measured] / rate, 3)
    return result


def target_summary(records: list[TurnRecord], wall_s: float | None) -> dict:
    tokens = sum(r.completion_tokens for r in records)
    seconds = sum(r.seconds for r in records)
    elapsed = wall_s if wall_s is not None else seconds
    counted = [r for r in records if r.draft_tokens is not None]
    draft = sum(r.draft_tokens for r in counted) if counted else None
    accepted = sum(r.accepted_tokens for r in counted) if counted else None
    summary = {"completion_tokens": tokens, "seconds": round(seconds, 3),
               "tokens_per_s": round(tokens / elapsed, 2) if elapsed > 0 else None,
               "draft_tokens": draft, "accepted_tokens": accepted,
               "acceptance_rate": round(accepted / draft, 3) if draft else None}
    if wall_s is not None:
        summary["wall_s"] = round(wall_s, 3)
    return summary


def outputs_identical(records: list[TurnRecord], targets: list[Target]) -> bool:
    """Whether our servers gave the same text on every turn (llama-server's numerics differ).
    A sampled turn is compared only between methods whose drafts are one-hot: the EAGLE head's
    drafts are sampled, so with a seed they keep the law, not the tokens."""
    ours = {t.label for t in targets if t.ours}
    texts: dict[tuple[int, int], set[str]] = {}
    for record in records:
        method = record.target.removesuffix(BASELINE_SUFFIX)  # an older tree's, the same method
        if record.target in ours and not (record.sampled and method in SAMPLES_ITS_DRAFTS):
            texts.setdefault((record.episode, record.turn), set()).add(record.text)
    return all(len(variants) == 1 for variants in texts.values())


def over_baseline(result: dict, suffix: str = BASELINE_SUFFIX) -> dict:
    """A workload's result with each method's tokens/s over its baseline's (an older tree's
    server of the same method, labelled `<method>-baseline`) where both were served."""
    for label, cell in list(result.items()):
        baseline = result.get(label + suffix)
        if isinstance(cell, dict) and isinstance(baseline, dict) and \
                cell.get("tokens_per_s") and baseline.get("tokens_per_s"):
            result[f"{label}_over_baseline"] = round(cell["tokens_per_s"]
                                                     / baseline["tokens_per_s"], 3)
    return result
