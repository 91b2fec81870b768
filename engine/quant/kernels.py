"""The compiled CPU kernels (csrc/, one extension; module.cpp lists its files): built once, loaded
on first use.

`make install` builds it (`python -m engine.quant.kernels`); torch.utils.cpp_extension keeps the
build under the cache folder and rebuilds only when the source changes. Where it cannot be built
(no compiler, no ninja) `load_kernel()` returns None once, with one log line, and the linear layers
fall back to dequantizing with formats.dequantize.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
from pathlib import Path

from engine.core.cpp_build import build_extension, extension_dir

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
EXTENSION_NAME = "specserve_gguf_cpu"
# Instruction sets the kernel was compiled for, as its `isa` argument takes them.
ISA_GENERIC, ISA_AVX2, ISA_AVX512 = 0, 1, 2


def build_dir() -> Path:
    return extension_dir(EXTENSION_NAME)


@functools.cache
def load_kernel():
    """The extension module, or None where it cannot be built (logged once)."""
    if os.environ.get("SPECSERVE_DISABLE_GGUF_KERNEL") == "1":
        logger.info("GGUF CPU kernel disabled by SPECSERVE_DISABLE_GGUF_KERNEL=1")
        return None
    try:
        module = _build(verbose=False)
    except Exception as error:  # any build failure leaves the pure-torch path working
        logger.warning("GGUF CPU kernel unavailable (%s); using the slower pure-torch fallback",
                       str(error).strip().splitlines()[-1] if str(error).strip() else error)
        return None
    failure = error_path_failure(build_dir())
    if failure:
        logger.warning("GGUF CPU kernel built, but a refused call %s (this compiler's C++ "
                       "library cannot format its error messages); using the slower "
                       "pure-torch fallback", failure)
        return None
    try:  # SPECSERVE_FLOAT_ISA is read once, here: a name this CPU cannot run fails at start
        variant = module.float_isa()
    except RuntimeError as error:
        raise ValueError(str(error).splitlines()[0]) from None
    logger.info("float CPU kernels: %s", ("generic", "avx2", "avx512")[variant])
    return module


# A refused call must raise a RuntimeError that names the refused value. Checked in a child
# process, once per build: with GCC 13 under /opt/gcc on a CUDA image, formatting a number in the
# first error message crashed the whole process (the module carries its own copy of libstdc++,
# whose number formatting does not work inside it; a GCC 12 build linked that way truncates
# the message instead).
_ERROR_PATH_PROBE = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
import {name} as module
try:
    module.int8_unpack_rows(torch.zeros(16, 20, dtype=torch.uint8), 77, torch.tensor([0]))
except RuntimeError as error:
    sys.exit(0 if "77" in str(error) else 3)
sys.exit(4)
"""


def error_path_failure(folder: Path, probe: str = _ERROR_PATH_PROBE) -> str | None:
    """None where the built module in `folder` raises cleanly, else what went wrong."""
    library = folder / f"{EXTENSION_NAME}.so"
    stamp, key = folder / "error-path-checked", ""
    if library.is_file() and probe == _ERROR_PATH_PROBE:
        key = f"{library.stat().st_mtime_ns}:{library.stat().st_size}"
        if stamp.is_file() and stamp.read_text() == key:
            return None
    result = subprocess.run([sys.executable, "-c", probe.format(name=EXTENSION_NAME),
                             str(folder)], capture_output=True, timeout=300)
    if result.returncode < 0:
        return f"crashed the process (signal {-result.returncode})"
    if result.returncode != 0:
        return {3: "raised without naming its value", 4: "did not raise"}.get(
            result.returncode, f"failed ({result.stderr.decode(errors='replace')[-200:]})")
    stamp.write_text(key)
    return None


def cpu_ops_for(x):
    """The extension where its fused float32 CPU ops (cpu_ops.cpp) apply to tensor `x`, else
    None: other devices and dtypes take the torch path."""
    return cpu_ops_on(x.device, x.dtype)


def cpu_ops_on(device, dtype):
    """`cpu_ops_for` a tensor of this device and dtype."""
    if device.type != "cpu" or dtype != torch_float32():
        return None
    return load_kernel()


@functools.cache
def torch_float32():
    import torch

    return torch.float32


def _build(verbose: bool):
    return build_extension(
        EXTENSION_NAME,
        [SOURCE_DIR / name for name in
         ("module.cpp", "isa.cpp", "gguf_cpu.cpp", "gguf_int8.cpp", "vec_ops.cpp",
          "cpu_ops.cpp", "paged_attention.cpp", "decoder_stack.cpp")],
        SOURCE_DIR,
        cflags=["-O3", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno"],
        # ATen's parallel_for is OpenMP inlined into the caller; the libgomp this links is the one
        # torch already loaded (same soname), so torch.set_num_threads governs it too.
        ldflags=["-fopenmp"],
        verbose=verbose,
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    module = _build(verbose=True)
    print(f"built {EXTENSION_NAME}: best instruction set {module.best_isa()} "
          "(0 generic, 1 AVX2+FMA, 2 AVX-512)")
