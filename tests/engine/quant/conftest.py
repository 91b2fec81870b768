"""Fixtures of the CPU kernel tests: the extension, and the thread counts attention runs on."""

from __future__ import annotations

import pytest
import torch

from engine.quant.kernels import cpu_ops_for


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops_for(torch.empty(0))
    if module is None:
        pytest.skip("the CPU extension is not built")
    return module


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)
