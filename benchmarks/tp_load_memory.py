"""What one tensor-parallel rank allocates to load a float checkpoint (docs/multi-gpu.md): a
random Llama-shaped model (about 90 MB in float32, safetensors) loaded whole (1 rank), per rank
(rank 0 of 2: cut on the meta device, then only its piece read), and the old way (rank 0 of 2:
loaded whole, then cut). Each load runs in a fresh process; it reports the bytes of the
parameters the rank keeps and the peak anonymous resident memory the load added (RssAnon
sampled every millisecond: safetensors' mapped file pages are page cache, not the rank's), as
JSON. Each process loads once before it measures, so the imports a first load pulls in are not
counted.

    python -m benchmarks.tp_load_memory [--output PATH.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# A fixed mmap threshold: glibc otherwise raises it after the first load frees its tensors, and
# the measured load then reuses heap the first one left resident (it read below its own size).
ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
MODES = ["whole", "per_rank", "cut_after_load"]
SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def measure(mode: str, folder: str) -> dict:
    """One load in this process: parameter bytes and the sampled peak of RssAnon above the
    level before it."""
    import torch

    from engine.distributed.group import ParallelGroup

    group, cpu = ParallelGroup(0, 2), torch.device("cpu")
    load(mode, folder, group, cpu)  # once before: imports (transformers, sympy) are not the load's
    gc.collect()
    before, peak, done = rss_anon(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    model = load(mode, folder, group, cpu)
    done.set()
    sampler.join()
    peak[0] = max(peak[0], rss_anon())
    return {"mode": mode, "parameter_bytes": sum(p.numel() * p.element_size()
                                                 for p in model.parameters()),
            "peak_added_anon_bytes": peak[0] - before}


def load(mode: str, folder: str, group, cpu):
    from engine.distributed.shard_model import shard_model
    from engine.models.loader import _load_float

    if mode == "per_rank":
        return _load_float(Path(folder), cpu, False, None,
                           shard=lambda m: shard_model(m, group))[2]
    model = _load_float(Path(folder), cpu, False, None)[2]
    if mode == "cut_after_load":
        shard_model(model, group)
    return model


def write_model(folder: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **SHAPE),
                                             dtype=torch.float32)
    model.save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output")
    parser.add_argument("--measure", nargs=2, metavar=("MODE", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return
    with tempfile.TemporaryDirectory() as folder:
        write_model(Path(folder))
        runs = [json.loads(subprocess.run(
            [sys.executable, "-m", "benchmarks.tp_load_memory", "--measure", mode, folder],
            check=True, capture_output=True, text=True, env=ENV).stdout.splitlines()[-1])
            for mode in MODES]
    whole = runs[0]
    result = {"model": {"family": "llama", **SHAPE, "dtype": "float32"}, "runs": runs,
              "per_rank_over_whole": {key: round(runs[1][key] / whole[key], 3)
                                      for key in ("parameter_bytes", "peak_added_anon_bytes")},
              "cut_after_load_over_whole": {key: round(runs[2][key] / whole[key], 3) for key in
                                            ("parameter_bytes", "peak_added_anon_bytes")}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
