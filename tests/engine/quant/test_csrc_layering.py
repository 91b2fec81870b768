"""The C++ extension's files call one another without a circle: module.cpp registers every file's
functions and nothing calls back into it, and each function declared in the shared headers
(vec_ops.h, isa.h) is defined in one file whose own calls never lead back to its callers. Read
from the source, like tests/engine/test_layering.py reads the Python imports."""

from __future__ import annotations

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[3] / "engine" / "quant" / "csrc"
SHARED_HEADERS = ("vec_ops.h", "isa.h")
# A declaration in a header: `type name(params);` at the start of a line.
DECLARATION = re.compile(r"^[A-Za-z][\w:<>\s\*&]*?\b(\w+)\(([^;{}]*)\);", re.MULTILINE)


def declared_functions(headers: dict[str, str]) -> set[str]:
    return {match.group(1) for text in headers.values() for match in DECLARATION.finditer(text)}


def call_graph(sources: dict[str, str], functions: set[str]) -> dict[str, set[str]]:
    """file -> the files whose shared functions it calls (a call is the name followed by "(";
    the file whose body opens "{" after the parameter list is the one that defines it)."""
    defined_in = {}
    for name in functions:
        definition = re.compile(rf"\b{name}\(([^;{{}}]*)\)\s*(const\s*)?\{{")
        owners = [file for file, text in sources.items() if definition.search(text)]
        if owners:
            assert len(owners) == 1, f"{name} is defined in {owners}"
            defined_in[name] = owners[0]
    graph: dict[str, set[str]] = {file: set() for file in sources}
    for file, text in sources.items():
        for name, owner in defined_in.items():
            if owner != file and re.search(rf"\b{name}\(", text):
                graph[file].add(owner)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}  # file -> "open" while on the path, "done" after

    def visit(file: str, path: list[str]) -> list[str] | None:
        state[file] = "open"
        for callee in sorted(graph[file]):
            if state.get(callee) == "open":
                return path + [file, callee]
            if callee not in state and (cycle := visit(callee, path + [file])):
                return cycle
        state[file] = "done"
        return None

    for file in sorted(graph):
        if file not in state and (cycle := visit(file, [])):
            return cycle
    return None


def read(folder: Path, suffix: str) -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(folder.glob(f"*{suffix}"))}


def test_only_module_cpp_defines_the_python_module():
    sources = read(CSRC, ".cpp")
    assert [file for file, text in sources.items() if "PYBIND11_MODULE" in text] == ["module.cpp"]


def test_the_extension_files_call_one_another_without_a_circle():
    sources = read(CSRC, ".cpp")
    functions = declared_functions({name: (CSRC / name).read_text() for name in SHARED_HEADERS})
    assert {"vec_ops", "best_isa", "gguf_matmul_rows", "register_gguf_ops"} <= functions
    graph = call_graph(sources, functions)
    assert find_cycle(graph) is None
    assert not any("module.cpp" in callees for callees in graph.values())
    # module.cpp reaches every file that registers functions, so the graph is really read
    assert {"gguf_cpu.cpp", "gguf_int8.cpp", "cpu_ops.cpp", "paged_attention.cpp",
            "decoder_stack.cpp"} <= graph["module.cpp"]
    assert graph["vec_ops.cpp"] == {"isa.cpp"}


def test_the_check_finds_the_circle_the_extension_once_had():
    """Negative control: gguf_cpu.cpp registered every file's functions and they called back into
    its vec_ops()."""
    headers = {"vec_ops.h": "VecOps vec_ops();\nvoid register_cpu_ops(pybind11::module& m);\n"}
    sources = {
        "gguf_cpu.cpp": "VecOps vec_ops() {\n  return {};\n}\nPYBIND11_MODULE(x, m) {\n"
                        "  register_cpu_ops(m);\n}\n",
        "cpu_ops.cpp": "void run() {\n  const VecOps ops = vec_ops();\n}\n"
                       "void register_cpu_ops(pybind11::module& m) {\n}\n",
    }
    graph = call_graph(sources, declared_functions(headers))
    assert find_cycle(graph) == ["cpu_ops.cpp", "gguf_cpu.cpp", "cpu_ops.cpp"]
