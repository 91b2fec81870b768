"""What a benchmark ran on: the CPU's name, our integer kernel's variant, our versions and commit.
Reports carry these so a figure can be named with its machine. `baseline_tree` checks out an
older commit beside this one, for benchmarks that measure both (`runs_taking_turns`)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def baseline_tree(ref: str | None) -> Iterator[Path | None]:
    """`ref` checked out into a temporary git worktree for the block, then removed; None for
    no ref (the benchmark measures this tree alone)."""
    if ref is None:
        yield None
        return
    folder = Path(tempfile.mkdtemp()) / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), ref],
                   check=True, capture_output=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(folder)],
                       check=False, capture_output=True)


def runs_taking_turns(ref: str | None, repeats: int,
                      run_tree: Callable[[Path, str | None], dict]) -> dict[str, list[dict]]:
    """`run_tree(tree, kernel folder)`'s reports for this tree ("this", the default kernel
    folder) and, with `ref`, that commit's worktree ("baseline", a kernel folder of its own), the
    trees taking turns `repeats` times so that the host's drift falls on both alike."""
    with baseline_tree(ref) as baseline, tempfile.TemporaryDirectory() as cache:
        trees = {"this": (ROOT, None), **({"baseline": (baseline, cache)} if baseline else {})}
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(repeats):
            for name, (tree, cache_dir) in trees.items():
                runs[name].append(run_tree(tree, cache_dir))
    return runs


def measure_in_tree(script: Path, tree: Path, arguments: list[str],
                    env: dict[str, str] | None = None) -> dict:
    """`script --measure-only *arguments` run as a subprocess in `tree`, with `tree` first on
    the import path, its last line of output read as JSON: how a benchmark measures an older
    tree beside this one (`env`: more variables, such as that tree's own kernel folder)."""
    command = [sys.executable, str(script), "--measure-only", *arguments]
    done = subprocess.run(command, cwd=tree, check=True, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tree), **(env or {})})
    return json.loads(done.stdout.strip().splitlines()[-1])


def int8_variant() -> str | None:
    """The integer kernel variant our --quantization gguf/auto servers ran (engine/quant/int8)."""
    try:
        from engine.quant.kernels import load_kernel

        kernel = load_kernel()
        return kernel.int8_isa() if kernel is not None else "pure-torch reference"
    except (ImportError, RuntimeError) as error:
        return f"unknown ({error})"


def float_variant() -> str | None:
    """The float kernel variant (attention, SiLU, argmax) our CPU servers ran: set by
    SPECSERVE_FLOAT_ISA, else the best this CPU has."""
    try:
        from engine.quant.kernels import load_kernel

        kernel = load_kernel()
        return ("generic", "avx2", "avx512")[kernel.float_isa()] if kernel is not None else \
            "pure-torch reference"
    except (ImportError, RuntimeError, ValueError) as error:
        return f"unknown ({error})"


def our_versions() -> dict:
    versions = {"python": platform.python_version()}
    for module in ("torch", "transformers"):
        try:
            versions[module] = __import__(module).__version__
        except ImportError:
            pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        versions["specserve_commit"] = commit + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return versions


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU's name with its family and model numbers: under a hypervisor the name is often
    just "AMD EPYC", which Zen 3 (family 25 model 1), Zen 4 (25, 17) and Zen 5 (26, 2) share."""
    try:
        first_processor = cpuinfo.read_text().split("\n\n")[0]
    except OSError:
        return None
    fields = {key.strip(): value.strip() for key, _, value in
              (line.partition(":") for line in first_processor.splitlines())}
    name = fields.get("model name")
    if name and "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']} model {fields['model']})"
    return name


def device_facts(device) -> dict:
    """What ran the benchmark: the GPU by name with torch's CUDA version where it ran on one,
    and always the host's CPU and versions."""
    import torch

    facts = {"device": str(device), "cpu": cpu_model(), "versions": our_versions()}
    if getattr(device, "type", device) == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
        facts["versions"]["cuda"] = torch.version.cuda
    return facts
