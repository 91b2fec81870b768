"""Finds and loads the draft head a --draft-head names: our own format (eagle_head.json) or a
published EAGLE-3 head (config.json), from a folder or the Hugging Face cache (never
downloaded)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from engine.spec_decode.eagle_head import CONFIG_FILE as OWN_CONFIG_FILE
from engine.spec_decode.eagle_head import load_head
from engine.spec_decode.heads_published.eagle3_checkpoint import (is_published_head,
                                                                  load_published_head)


def load_draft_head(folder: Path, target, device: torch.device, dtype: torch.dtype):
    """An EagleHead or Eagle3Head for `target`; ValueError where the head does not fit."""
    folder = locate_head(folder)
    if (folder / OWN_CONFIG_FILE).is_file() or not is_published_head(folder):
        return load_head(folder, target, device, dtype)  # its own error names what is missing
    return load_published_head(folder, target, device, dtype)


def locate_head(name: str | Path) -> Path:
    """A folder as given, else a Hugging Face repository id already in the local cache."""
    path = Path(name)
    if path.exists() or not re.fullmatch(r"[\w.-]+/[\w.-]+", str(name)):
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(name), local_files_only=True))
    except Exception:  # not cached (or no hub client): the same answer for the user
        raise ValueError(f"draft head {name!r} is neither a folder nor a repository in the "
                         f"Hugging Face cache (specserve downloads nothing; fetch it with "
                         f"`huggingface-cli download {name}`)") from None
