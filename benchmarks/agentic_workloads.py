"""Generated traffic for benchmarks/agentic.py: what suffix decoding is for, and a control.

Everything is made here from a seed (no download, nothing taken from the bundled HumanEval or
MT-Bench sets). A workload is a list of *episodes*; an episode is a list of chat turns sent one
after another, where a turn may re-send the replies the server gave to the turns before it
(`history=True`), as an agent loop does.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

SYSTEM_AGENT = ("You are an operations agent. Tools: get_weather(city), search_flights(origin, "
                "destination, date), book_hotel(city, nights). Reply with one JSON tool call "
                'such as {"tool": "get_weather", "arguments": {"city": "Paris"}} or, when done, '
                "a one-line summary.")
CITIES = ["Paris", "Lisbon", "Oslo", "Madrid", "Vienna", "Prague", "Dublin", "Athens", "Rome"]
FIRST_NAMES = ["Ada", "Alan", "Grace", "Linus", "Barbara", "Ken", "Edsger", "Margaret"]
PRODUCTS = ["keyboard", "monitor", "desk lamp", "headset", "webcam", "chair", "notebook"]
FRESH_QUESTIONS = [
    "Why is the sky blue? Answer in two sentences.",
    "Give me three tips for sleeping better.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a small bakery and explain it briefly.",
    "How do tides work?",
    "Write a haiku about a quiet library.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a prime number is to a ten-year-old.",
]


@dataclass
class Turn:
    user: str
    history: bool = False  # send the episode's earlier turns and the replies to them first
    temperature: float = 0.0
    seed: int | None = None


@dataclass
class Workload:
    name: str
    episodes: list[list[Turn]] = field(default_factory=list)
    system: str | None = None


def agent_loop(rng: random.Random, num_episodes: int, num_turns: int) -> Workload:
    """A tool-calling loop: each turn re-sends the conversation and a fake tool result."""
    episodes = []
    for _ in range(num_episodes):
        origin, destination = rng.sample(CITIES, 2)
        turns = [Turn(f"Plan a trip from {origin} to {destination} on 2026-0{rng.randint(1, 9)}"
                      f"-1{rng.randint(0, 9)}: check the weather, find a flight, book 2 nights.")]
        for step in range(1, num_turns):
            result = {"tool_result": {"step": step, "city": destination,
                                      "temperature_c": rng.randint(-5, 30),
                                      "flights": [{"id": f"FL{rng.randint(100, 999)}",
                                                   "price_eur": rng.randint(40, 400)}]}}
            turns.append(Turn(json.dumps(result) + "\nContinue with the next tool call.",
                              history=True))
        episodes.append(turns)
    return Workload("agent_loop", episodes, SYSTEM_AGENT)


def _record(rng: random.Random) -> dict:
    return {"id": rng.randint(1, 9999), "name": rng.choice(FIRST_NAMES),
            "product": rng.choice(PRODUCTS), "quantity": rng.randint(1, 20),
            "price": round(rng.uniform(5, 500), 2)}


def templated(rng: random.Random, num_inputs: int) -> Workload:
    """One task template over different inputs: records to SQL, JSON to YAML, code edits."""
    episodes = []
    for _ in range(num_inputs):
        record = _record(rng)
        episodes.append([Turn("Convert this record into one SQL INSERT statement for the table "
                              f"orders. Output only SQL.\n{json.dumps(record)}")])
        episodes.append([Turn("Convert this JSON to YAML. Output only YAML.\n"
                              + json.dumps({"order": record, "status": "shipped"}, indent=1))])
        name, other = rng.sample(["total", "count", "price", "amount", "value"], 2)
        code = (f"def add_{name}(items):\n    {name} = 0\n    for item in items:\n"
                f"        {name} += item.{name}\n    return {name}\n")
        episodes.append([Turn(f"Rename the variable {name} to {other} in this function. "
                              f"Output only the code.\n{code}")])
    return Workload("templated", episodes)


def repeated(rng: random.Random, num_repeats: int, temperature: float) -> Workload:
    """The same prompt again and again (rollouts); at T > 0 each repeat has its own seed."""
    prompt = ("Write a Python function that checks whether a string is a palindrome, "
              "with a docstring.")
    name = f"repeated_t{temperature:g}"
    return Workload(name, [[Turn(prompt, temperature=temperature,
                                 seed=None if temperature == 0 else 1000 + i)]
                           for i in range(num_repeats)])


def fresh_chat(rng: random.Random, num_prompts: int) -> Workload:
    """The control: different questions, each once."""
    return Workload("fresh_chat", [[Turn(q)] for q in rng.sample(FRESH_QUESTIONS, num_prompts)])


WORKLOAD_NAMES = ("agent_loop", "templated", "repeated_t0", "repeated_t0.7", "fresh_chat")
DEFAULT_REPEATS = 8  # RL rollouts send one prompt 8-16 times


def all_workloads(seed: int, scale: int = 1, repeats: int = DEFAULT_REPEATS) -> list[Workload]:
    """Every workload, in WORKLOAD_NAMES order: `scale` multiplies the episodes of the others,
    `repeats` is how often the repeated prompt is sent."""
    if scale < 1 or repeats < 1:
        raise ValueError(f"--scale and --repeats must be >= 1, got {scale} and {repeats}")
    rng = random.Random(seed)
    return [agent_loop(rng, 2 * scale, 4), templated(rng, 3 * scale),
            repeated(rng, repeats, 0.0), repeated(rng, repeats, 0.7),
            fresh_chat(rng, min(4 * scale, len(FRESH_QUESTIONS)))]


def select_workloads(workloads: list[Workload], names: list[str] | None) -> list[Workload]:
    """The workloads named (all when `names` is None), in their usual order. Filtering after
    generating keeps a re-run of one workload identical to its part of a full run: every
    workload draws from the one seeded RNG."""
    if names is None:
        return workloads
    unknown = sorted(set(names) - {workload.name for workload in workloads})
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; choose from "
                         f"{[workload.name for workload in workloads]}")
    return [workload for workload in workloads if workload.name in names]
