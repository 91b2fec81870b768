"""The LM head inside a padded step's graph (engine/runner/static_runner.py): decode steps, and
verify steps up to MAX_VERIFY_ROWS_WITH_HEAD rows, compute every row's logits in the graph, and
the step samples and verifies from the rows it wants. On a CPU no graph is captured, so here a
graph's replay is stood in for by the forward it would replay (`graphed=True`, run eagerly)."""

from __future__ import annotations

import pytest

from engine.runner import static_runner
from tests.conftest import make_llm
from tests.engine.test_static_runner import METHODS, PARAMS, PROMPTS


def _flat_and_graphed(folder: str, params):
    """(the flat steps' outputs, the padded steps' outputs with each replay stood in for by the
    graphed forward run eagerly, the shapes whose forward returned logits: the head ran in
    the 'graph')."""
    # Batch-invariant: a flat step multiplies its real rows, a padded one every padded row, and
    # on a GPU cuBLAS sums those two shapes otherwise (an H200 sampled one token off by one in
    # float32 at temperature 0.8); on a CPU the float32 kernels are row-invariant anyway.
    options = dict(METHODS["layer-skip"], batch_invariant=True)
    flat = make_llm(folder, padded_steps=False, **options).generate(PROMPTS, params)
    llm = make_llm(folder, padded_steps=True, max_num_seqs=6, **options)
    runner, shapes = llm.engine.static_runner, []

    def run(shape):
        hidden, logits = runner._forward(shape, graphed=True)
        if logits is not None:
            shapes.append(shape)
        return hidden, logits
    runner.graphs.run = run
    return flat, llm.generate(PROMPTS, params), shapes


@pytest.mark.parametrize("verify_rows_with_head", [64, 0])
def test_the_head_in_the_graph_gives_the_flat_steps_tokens(tiny_chat_model_folder, monkeypatch,
                                                           verify_rows_with_head):
    monkeypatch.setattr(static_runner, "MAX_VERIFY_ROWS_WITH_HEAD", verify_rows_with_head)
    flat, padded, shapes = _flat_and_graphed(str(tiny_chat_model_folder), PARAMS)
    assert [o.token_ids for o in padded] == [o.token_ids for o in flat]
    assert sum(o.spec_stats.num_accepted_tokens for o in padded) > 0
    verify = [s for s in shapes if s.query_len > 1]
    assert any(s.query_len == 1 for s in shapes)  # decode steps: head (and argmax) in the graph
    if verify_rows_with_head:  # verify steps: the head in the graph, on every padded row
        assert verify and all(s.num_seqs * s.query_len <= verify_rows_with_head for s in verify)
    else:  # the control: none of them
        assert not verify


def test_seeded_sampling_from_the_graphs_logits_equals_the_flat_steps(tiny_chat_model_folder):
    from engine import SamplingParams

    params = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=11 + i,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    flat, padded, shapes = _flat_and_graphed(str(tiny_chat_model_folder), params)
    assert [o.token_ids for o in padded] == [o.token_ids for o in flat]
    assert any(s.query_len > 1 for s in shapes)
