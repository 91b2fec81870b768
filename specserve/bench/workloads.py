"""The prompt sets of the benchmarks, one per workload kind that matters to speculation.

  code  HumanEval problem prompts, raw completion     data/humaneval_subset.jsonl
  copy  editing / retrieval tasks whose answer repeats much of the prompt, chat: four written
        here, then edits (rename, annotate) of HumanEval reference solutions
  chat  MT-Bench first turns, chat                    data/mt_bench_subset.jsonl
  mixed the soak's traffic: completions and chat, structured outputs and tools, streamed and
        not, each answer checked against what it asked for (specserve/bench/mixed.py)

plus the user's own prompts from a JSON-lines file (`load_dataset`). Offline, chat prompts go
through the tokenizer's chat template (`encode`); over HTTP the server applies its own.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from specserve.bench.mixed import FLAVOURS

DATA = Path(__file__).resolve().parent / "data"
KINDS = ("code", "copy", "chat")  # what speculation is measured on, offline and served
SERVE_KINDS = (*KINDS, "mixed")  # mixed carries request fields: only `bench serve` sends it


@dataclass(frozen=True)
class Workload:
    id: str  # "<kind>/<name>"
    kind: str  # one of SERVE_KINDS
    text: str
    chat: bool  # True: `text` is one user message; False: a raw completion prompt
    extra: dict | None = None  # more request fields: response_format, tools (the mixed kind)
    stream: bool = True


_PARAGRAPH = (
    "Our walking tour of Lisbon starts at nine in the morning in front of the old tram depot. "
    "From there we climb the narrow streets of the Alfama district, stopping at a small bakery "
    "that has sold custard tarts since 1911. After a short rest at the castle walls, where the "
    "view reaches across the river to the southern bank, we walk down to the riverside market "
    "for lunch. In the afternoon the group visits the tile museum, and the tour ends at six in "
    "the evening with a ferry ride back across the river to Lisbon.")

_BUGGY_CODE = '''def moving_average(values, window):
    """Returns the averages of every run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = sum(values[:window])
    averages.append(total / window)
    for index in range(window, len(values)):
        total += values[index] - values[index - window]
        averages.append(total / window)
    retrun averages


def describe(values):
    smallest, largest = min(values), max(values)
    return f"{len(values)} values from {smallest} to {largest}"
'''

_REPORT = (
    "The new field recorder weighs 410 grams and fits in a coat pocket. Its battery lasts about "
    "eleven hours when recording in stereo at 48 kHz. The two built-in microphones can be "
    "angled for a wider or a narrower image. A low-cut filter removes wind rumble below 80 Hz. "
    "When the battery runs low, the recorder closes the current file safely before it shuts "
    "down. The menus are easy to read in bright sunlight. Files are written to a microSD card "
    "of up to 512 GB. Charging the battery from empty takes two and a half hours over USB-C. "
    "The metal case survived a drop onto concrete in our test without a scratch.")

_CONFIG = '''{
  "service": "image-resizer",
  "listen": {"host": "0.0.0.0", "port": 8080},
  "timeout": 30,
  "max_upload_mb": 25,
  "formats": ["jpeg", "png", "webp"],
  "cache": {"enabled": true, "directory": "/var/cache/resizer", "max_entries": 10000},
  "logging": {"level": "info", "file": "/var/log/resizer.log"}
}'''

COPY_PROMPTS = {
    "paragraph-rename": "Repeat the paragraph below word for word, but write \"Porto\" wherever "
                        "it says \"Lisbon\". Output only the paragraph.\n\n" + _PARAGRAPH,
    "code-typo": "Fix the typo in this Python code and return the full corrected code, "
                 "nothing else.\n\n```python\n" + _BUGGY_CODE + "```",
    "extract-battery": "Copy, word for word, every sentence of the review below that mentions "
                       "the battery, one per line.\n\n" + _REPORT,
    "json-edit": "Change the timeout in this configuration to 60 and add \"gif\" to the formats. "
                 "Return the complete JSON.\n\n```json\n" + _CONFIG + "\n```",
}

# Edits of a HumanEval reference solution: the answer is the code again, changed in one place.
_CODE_EDITS = (
    "Rename the function `{name}` to `{name}_impl` everywhere in the code below and output the "
    "complete updated code, nothing else.",
    "Copy the code below exactly, adding the comment line `# reviewed` directly above the "
    "definition of `{name}`. Output the complete code, nothing else.",
)


def load_workloads(kind: str, num_prompts: int) -> list[Workload]:
    """The first `num_prompts` prompts of `kind` (fewer when the set is smaller)."""
    if kind == "code":
        records = _read_jsonl(DATA / "humaneval_subset.jsonl")
        items = [Workload(f"code/{r['task_id'].replace('/', '-')}", "code", r["prompt"], False)
                 for r in records]
    elif kind == "copy":
        items = [Workload(f"copy/{name}", "copy", text, True)
                 for name, text in COPY_PROMPTS.items()]
        # From the end of the HumanEval set, so that the code kind's first prompts stay unused.
        records = _read_jsonl(DATA / "humaneval_subset.jsonl")[::-1]
        for index, record in enumerate(records):
            instruction = _CODE_EDITS[index % len(_CODE_EDITS)].format(name=record["entry_point"])
            code = record["prompt"] + record["canonical_solution"]
            items.append(Workload(f"copy/edit-{record['task_id'].replace('/', '-')}", "copy",
                                  f"{instruction}\n\n```python\n{code.strip()}\n```", True))
    elif kind == "chat":
        records = _read_jsonl(DATA / "mt_bench_subset.jsonl")
        items = [Workload(f"chat/mtbench-{r['question_id']}", "chat", r["turns"][0], True)
                 for r in records]
    elif kind == "mixed":
        items = _mixed(load_workloads("code", num_prompts), load_workloads("chat", num_prompts))
    else:
        raise ValueError(f"unknown workload kind {kind!r}; choose from {', '.join(SERVE_KINDS)}")
    return items[:num_prompts]


def _mixed(code: list[Workload], chat: list[Workload]) -> list[Workload]:
    """Each prompt pair (a code prompt, a chat prompt) through each of mixed.FLAVOURS in turn
    (eight request shapes)."""
    items = []
    for pair, flavour in itertools.product(zip(code, chat), FLAVOURS):
        base = pair[0] if flavour.raw else pair[1]
        text = base.text if flavour.raw else flavour.instruction + base.text
        items.append(Workload(f"mixed/{flavour.name}/{base.id}", "mixed", text,
                              chat=not flavour.raw, extra=flavour.extra, stream=flavour.stream))
    return items


def load_dataset(path: str | Path, num_prompts: int | None = None) -> list[Workload]:
    """The user's prompts: one JSON object a line with "prompt" (a string, sent as one user message
    to chat endpoints, raw to completion endpoints) and optionally "kind" (a label to group by)."""
    items = []
    for number, record in enumerate(_read_jsonl(Path(path)), start=1):
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f"{path}: line {number} needs a string \"prompt\"")
        kind = str(record.get("kind", "dataset"))
        items.append(Workload(f"{kind}/{number}", kind, record["prompt"], chat=True))
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items[:num_prompts]


def encode(tokenizer, workload: Workload) -> list[int]:
    """Prompt token ids: the chat template for chat prompts, plain tokenization otherwise."""
    if not workload.chat:
        return list(tokenizer(workload.text)["input_ids"])
    messages = [{"role": "user", "content": workload.text}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)
    return list(encoded["input_ids"])


def _read_jsonl(path: Path) -> list[dict]:
    try:
        with open(path) as file:
            return [json.loads(line) for line in file if line.strip()]
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read prompts from {path}: {error}") from None
