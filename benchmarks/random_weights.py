"""A model folder with random bfloat16 weights in another folder's shape, for speed measurements
on a lent GPU (speed does not depend on weight values): the config's model, seeded, saved with
every other file of the source folder (tokenizer, chat template) copied beside it.

    python -m benchmarks.random_weights .gpu/smol /tmp/smolrand
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def main(source: str, target: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source),
                                             dtype=torch.bfloat16)
    model.save_pretrained(target)
    for path in Path(source).iterdir():
        if path.is_file() and path.name != "config.json":
            shutil.copy(path, target)


if __name__ == "__main__":
    main(*sys.argv[1:3])
