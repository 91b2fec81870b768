"""Helpers of the deploy tests. `promtool` (Debian package `prometheus`) checks PromQL and
prometheus.yml; without it those tests skip and say why."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (`apt-get install prometheus` provides it): PromQL and "
                    "prometheus.yml syntax not checked")
    return path


def run_promtool(promtool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)


def readme_section(title: str) -> str:
    """The text of docs/deployment.md's `## title` section (the deployment guide, which the
    README links to)."""
    text = (ROOT / "docs" / "deployment.md").read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/deployment.md has no section '## {title}'"
    return match.group(1)
