"""Just enough of Dockerfile and .dockerignore syntax to check ours without a Docker engine."""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import PurePosixPath


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, ...
    args: str  # the rest of the logical line, continuations joined
    stage: str | None  # the stage's name (or its index as a string); None for global ARGs


def parse_dockerfile(text: str) -> list[Instruction]:
    """Logical lines: `\\` continuations joined, comment lines dropped (also inside a
    continuation, as Docker does)."""
    logical, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not current):
            continue
        if line.endswith("\\"):
            current += line[:-1].strip() + " "
            continue
        logical.append(current + line)
        current = ""
    instructions, stage, num_stages = [], None, 0
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            match = re.search(r"\s+AS\s+(\S+)\s*$", args, re.I)
            stage = match.group(1) if match else str(num_stages)
            num_stages += 1
        instructions.append(Instruction(keyword, args.strip(), stage))
    return instructions


def stages(instructions: list[Instruction]) -> dict[str, str]:
    """Stage name -> the image or stage it starts FROM (`torch-${VARIANT}` kept as written)."""
    return {i.stage: re.split(r"\s+AS\s+", i.args, flags=re.I)[0].strip()
            for i in instructions if i.keyword == "FROM"}


def arg_defaults(instructions: list[Instruction], stage: str | None) -> dict[str, str | None]:
    """`ARG NAME=default` declarations of one stage (None: the global ones before any FROM)."""
    declared = {}
    for i in instructions:
        if i.keyword == "ARG" and i.stage == stage:
            name, _, default = i.args.partition("=")
            declared[name] = default or None
    return declared


def exec_form(args: str) -> list[str]:
    """The JSON array of an exec-form instruction (`ENTRYPOINT ["a", "b"]`)."""
    value = json.loads(args)
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ValueError(f"not an exec form: {args}")
    return value


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Whether a context path is left out: the last pattern matching it or one of its parent
    folders decides; `!pattern` includes."""
    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        if any(fnmatch.fnmatchcase(candidate, pattern) for candidate in candidates):
            excluded = not negated
    return excluded


def read_dockerignore(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]
