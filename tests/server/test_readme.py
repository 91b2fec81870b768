"""The serving examples in README.md run as written against a live server."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
README_URL = "http://127.0.0.1:8000"


def _section_block(language: str, section: str = "Serving") -> str:
    text = README.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1, f"expected one {language} block in the section {section!r}"
    assert README_URL in blocks[0]
    return blocks[0]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_example(server):
    command = _section_block("sh").replace(README_URL, server.base_url)
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]


def test_python_sdk_example(server):
    code = _section_block("python").replace(README_URL, server.base_url)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    text, usage = result.stdout.rsplit("\nusage:", 1)
    assert text.strip() and "completion_tokens=" in usage


STRUCTURED = "Structured outputs and tool calling"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_structured_curl_example(server):
    command = _section_block("sh", STRUCTURED).replace(README_URL, server.base_url)
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    [choice] = json.loads(result.stdout)["choices"]
    city = json.loads(choice["message"]["content"])
    assert choice["finish_reason"] == "stop" and set(city) == {"name", "population"}


def test_structured_sdk_example(server):
    code = _section_block("python", STRUCTURED).replace(README_URL, server.base_url)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stderr
    parsed = re.search(r"^parsed: (.*)$", result.stdout, flags=re.M).group(1)
    assert "population=" in parsed
    reason, name, arguments = re.search(r"^call: (.*)$", result.stdout, flags=re.M).group(1) \
        .split(" ", 2)
    assert (reason, name) == ("tool_calls", "get_weather") and json.loads(arguments)["city"]
    assert result.stdout.split("\nanswer: ", 1)[1].strip()
