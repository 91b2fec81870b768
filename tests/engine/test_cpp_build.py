"""engine/core/cpp_build.py loads a current build without torch.utils.cpp_extension (and the
setuptools it imports), and goes back to torch's build where the stamp says the inputs changed."""

from __future__ import annotations

import subprocess
import sys

from engine.core import cpp_build
from engine.spec_decode.suffix_native import EXTENSION_NAME

LOAD_SUFFIX_TRIE = (
    "import sys; from engine.spec_decode.suffix_native import native_trie_class; "
    "trie = native_trie_class(); assert trie is not None; "
    "print('torch.utils.cpp_extension' in sys.modules, 'setuptools' in sys.modules)")


def _load_in_a_new_process() -> str:
    return subprocess.run([sys.executable, "-c", LOAD_SUFFIX_TRIE], capture_output=True,
                          text=True, check=True, timeout=600).stdout.split()


def test_a_current_build_loads_without_torch_s_builder():
    _load_in_a_new_process()  # builds, or finds the build current
    assert _load_in_a_new_process() == ["False", "False"]


def test_a_stale_stamp_goes_through_torch_s_builder_and_is_rewritten():
    """The control: the same load with a stamp that no longer matches imports the builder
    (which finds the objects current and relinks nothing), then stamps the library again."""
    _load_in_a_new_process()
    stamp = cpp_build.extension_dir(EXTENSION_NAME) / cpp_build.STAMP_FILE
    current = stamp.read_text()
    stamp.write_text("0" * 64)
    assert _load_in_a_new_process() == ["True", "True"]
    assert stamp.read_text() == current


def test_the_stamp_covers_sources_headers_and_flags(tmp_path):
    source, header = tmp_path / "a.cpp", tmp_path / "a.h"
    source.write_text("int f();")
    header.write_text("#pragma once")
    stamp = cpp_build._inputs_hash("x", [source], tmp_path, ["-O3"], [])
    assert stamp == cpp_build._inputs_hash("x", [source], tmp_path, ["-O3"], [])
    assert stamp != cpp_build._inputs_hash("x", [source], tmp_path, ["-O2"], [])
    header.write_text("#pragma once\n#define X 1")
    assert stamp != cpp_build._inputs_hash("x", [source], tmp_path, ["-O3"], [])
