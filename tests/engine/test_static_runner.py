"""Padded decode/verify steps over persistent buffers (engine/static_runner.py): the layout CUDA
graphs replay, run eagerly here. They must give exactly the tokens of the flat, unpadded steps."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.static_runner import bucket_for, power_of_two_bucket
from tests.conftest import make_llm
from tests.engine.test_spec_decode_engine import PROMPTS

# Different lengths, so the batch shrinks step by step and lands between buckets.
PARAMS = [SamplingParams(max_tokens=12 + 5 * i, temperature=0, ignore_eos=True)
          for i in range(len(PROMPTS))]
METHODS = {
    "none": {"speculative_method": "none"},
    "layer-skip": {"speculative_method": "layer-skip", "draft_layer_ids": (0, 2),
                   "adaptive": False, "num_speculative_tokens": 4},
}


def test_buckets_and_widths():
    buckets = (1, 2, 4, 6)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]
    assert [power_of_two_bucket(n, 40) for n in (1, 2, 3, 5, 17, 33)] == [1, 2, 4, 8, 32, 40]


@pytest.fixture(params=["fused-cpu-ops", "torch-ops"])
def ops(request, monkeypatch):
    if request.param == "torch-ops":  # what CUDA runs
        monkeypatch.setattr("engine.quant.kernels.load_kernel", lambda: None)
    return request.param


@pytest.mark.parametrize("method", list(METHODS))
def test_padded_steps_give_the_flat_steps_tokens(tiny_chat_model_folder, method, ops):
    folder = str(tiny_chat_model_folder)
    flat = make_llm(folder, padded_steps=False, **METHODS[method]).generate(PROMPTS, PARAMS)
    llm = make_llm(folder, padded_steps=True, max_num_seqs=6, **METHODS[method])
    runner = llm.engine.static_runner
    shapes, buffers = [], set()
    model = llm.engine.runner.model
    prepare, hidden_states = runner.prepare, model.hidden_states

    def spy_prepare(scheduled):
        step = prepare(scheduled)
        shapes.append((len(scheduled), step.shape))
        return step

    def spy_hidden_states(input_ids, *args, **kwargs):
        buffers.add(input_ids.untyped_storage().data_ptr())
        return hidden_states(input_ids, *args, **kwargs)

    runner.prepare = spy_prepare
    padded = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in padded] == [o.token_ids for o in flat]
    # The padded path really ran, with padding, reading its persistent buffers.
    assert len(shapes) > 20
    assert any(shape.num_seqs > real for real, shape in shapes)
    if method != "none":
        assert any(shape.query_len > 1 for _, shape in shapes)
        assert sum(o.spec_stats.num_accepted_tokens for o in padded) > 0
    model.hidden_states = spy_hidden_states
    llm.generate(PROMPTS[:3], PARAMS[:3])
    assert runner.input_ids.untyped_storage().data_ptr() in buffers
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
