"""Low-level packages import nothing above them: the kernels and quantization code know no model
loader, the engine knows no server. Read from the source (importing any module of `engine` runs
the package's __init__, which imports everything)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# package (a folder under the repository root) -> modules it must never import
FORBIDDEN = {
    "engine/quant": ("engine.models", "engine.engine", "engine.llm", "engine.async_engine",
                     "engine.spec_decode", "server"),
    "engine/attention": ("engine.models", "engine.engine", "server"),
    # the engine's rooms by role (engine/__init__.py's public face sits above them all)
    "engine/core": ("engine.runner", "engine.sample", "engine.spec_decode", "engine.engine",
                    "engine.llm", "engine.async_engine", "engine.outputs", "server"),
    "engine/sample": ("engine.runner", "engine.spec_decode", "engine.models", "engine.engine",
                      "engine.llm", "engine.async_engine", "server"),
    "engine/metrics": ("engine.runner", "engine.sample", "engine.spec_decode", "engine.engine",
                       "engine.llm", "engine.async_engine", "server"),
    "engine/runner": ("engine.spec_decode", "engine.engine", "engine.llm",
                      "engine.async_engine", "server"),
    "engine": ("server", "benchmarks", "training", "specserve"),
    # the command lines meet in specserve/cli.py, not in one another
    "server": ("benchmarks", "training", "specserve"),
    "training": ("server", "benchmarks", "specserve"),
    # the repository's benchmarks (not installed) use the installed bench tools, never the
    # reverse: an installed package cannot import a folder that is not installed
    "benchmarks": ("training", "specserve.cli"),
    "specserve/bench": ("benchmarks", "training", "specserve.cli"),
}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in imported_modules(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_nothing_above_it(package):
    assert violations(package, FORBIDDEN[package]) == []


def test_the_check_sees_an_import_inside_a_function(tmp_path, monkeypatch):
    """Negative control: the kernel builder once imported the model loader inside a function."""
    (tmp_path / "engine" / "quant").mkdir(parents=True)
    (tmp_path / "engine" / "quant" / "kernels.py").write_text(
        "def build_dir():\n    from engine.models.loader import cache_dir\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert violations("engine/quant", FORBIDDEN["engine/quant"]) == [
        "engine/quant/kernels.py imports engine.models.loader"]
