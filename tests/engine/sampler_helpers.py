"""What the sampler's tests share: every test on every device present, and batches built from
forged settings."""

from __future__ import annotations

import pytest
import torch

from engine.sample.sampler import build_sampling_batch
from tests.conftest import DEVICES


@pytest.fixture(autouse=True, params=DEVICES)
def device(request):
    """Every test on every device present: tensors made without a device land on it."""
    with torch.device(request.param):
        yield torch.device(request.param)


def rng(seed: int) -> torch.Generator:
    return torch.Generator(device=torch.get_default_device()).manual_seed(seed)


def make_batch(params, vocab_size, prompts=None, outputs=None, generator=None):
    prompts = prompts or [[] for _ in params]
    outputs = outputs or [[] for _ in params]
    return build_sampling_batch(params, prompts, outputs, vocab_size, torch.get_default_device(),
                                generator)
