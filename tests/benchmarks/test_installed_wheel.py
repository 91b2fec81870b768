"""What `pip install .` puts on a machine: specserve's packages, not the repository's benchmarks
(experiments and results), and `specserve bench` works from there."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # built from a copy of the tracked files: a checkout's build/ folder keeps what earlier
    # builds put there, and setuptools would pack it again
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode().split("\0")
    for name in filter(None, tracked):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    # the environment's own setuptools where it is recent enough (no download), else pip's
    # isolated build fetches one
    import setuptools

    isolation = [] if int(setuptools.__version__.split(".")[0]) >= 68 else ["--use-pep517"]
    no_isolation = [] if isolation else ["--no-build-isolation"]
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *no_isolation,
                           *isolation, "-q", "-w", str(out), str(source)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    [path] = out.glob("specserve-*.whl")
    return path


def test_the_wheel_holds_no_top_level_benchmarks(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.startswith("specserve-")}
    assert tops == {"engine", "server", "training", "specserve"}, tops
    assert not any(re.match(r"benchmarks/", name) for name in names)
    assert "specserve/bench/data/humaneval_subset.jsonl" in names  # the bench's prompt sets
    assert "specserve/bench/cli.py" in names
    # the C++ sources travel too, so an installed wheel can build its kernels and suffix trie
    assert {"engine/quant/csrc/module.cpp", "engine/spec_decode/csrc/suffix_trie.cpp"} <= set(names)


def test_specserve_bench_runs_from_the_installed_wheel(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # outside the repository, so nothing is imported from the checkout
    done = subprocess.run([sys.executable, "-c", "import sys; from specserve.cli import main; "
                           "import specserve.bench.cli as bench; print(bench.__file__); "
                           "sys.argv = ['specserve', 'bench', '--help']; main()"],
                          cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    where, usage = done.stdout.split("\n", 1)
    assert Path(where).is_relative_to(site)  # the wheel's copy ran, not the checkout's
    assert "serve" in usage and "offline" in usage
