"""Issue 49's "never slower" for a draft head: a request whose head does not pay (its drafts are
never accepted, or the controller stops drafting with it) retires the head, and from then on
takes `none`'s path: no target rows kept, no head forward, and a target step without the
feature layers (one stack run). Outputs stay `none`'s throughout. Each test has its control: the
same run with retirement held off keeps paying for the head, and a head that is accepted does
not retire."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.spec_decode import head_retirement
from tests.conftest import make_llm, make_random_head

PROMPT = ["one two three four five six"]
PARAMS = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def head_folder(tiny_chat_model_folder, tmp_path_factory):
    return make_random_head(tiny_chat_model_folder, tmp_path_factory.mktemp("head"), 64,
                            std=0.3, feature_layers=[0, 1])


@pytest.fixture(scope="module")
def plain(tiny_chat_model_folder):
    return make_llm(str(tiny_chat_model_folder), speculative_method="none").generate(
        PROMPT, PARAMS)[0].token_ids


def _traced_run(model_folder, head_folder, method: str, pick=None, hold_back: bool = False):
    """Generates PROMPT with the head, recording per target step whether its forward returned
    the feature layers, and per step how many head forwards ran. `pick(request, drafts_so_far)`
    replaces the head's choice of draft token; `hold_back`: the controller plans no draft.
    K is fixed at 3, with retirement on (an adaptive controller's plans follow measured step
    times, so which steps draft would differ from run to run)."""
    llm = make_llm(str(model_folder), speculative_method=method, draft_head=str(head_folder),
                   eagle_ngram_min=0, num_speculative_tokens=3, adaptive=False)
    engine = llm.engine
    head = engine.proposer if method == "eagle" else engine.proposer.head
    assert head.retire is False  # a fixed K drafts whatever the head accepts, unless asked
    head.retire = True
    model = engine.runner.model
    trace = {"captures": [], "head_forwards": 0, "requests": set(), "kept_after_retiring": 0}
    hidden_states, forward, keep = model.hidden_states, head._forward, head.observe_target_step

    def spy_hidden(*args, **kwargs):
        trace["captures"].append(kwargs.get("capture_features", True))
        return hidden_states(*args, **kwargs)

    def spy_forward(*args, **kwargs):
        trace["head_forwards"] += 1
        return forward(*args, **kwargs)

    def spy_keep(scheduled, *args):
        retired = [s.request for s in scheduled if s.request.head_retired]
        keep(scheduled, *args)
        trace["requests"].update(s.request for s in scheduled)
        trace["kept_after_retiring"] += sum(len(r.pending_features) for r in retired)

    model.hidden_states, head._forward, head.observe_target_step = spy_hidden, spy_forward, \
        spy_keep
    if pick is not None:
        head._pick_drafts = lambda predicted, requests, so_far: (
            [pick(r, d) for r, d in zip(requests, so_far)], [None] * len(requests))
    if hold_back:
        plan = engine.controller.plan
        engine.controller.plan = lambda requests, max_ks, *a, **k: [0] * len(requests)
        assert plan  # the real planner is what every other run uses
    tokens = llm.generate(PROMPT, PARAMS)[0].token_ids
    (request,) = trace["requests"]
    return tokens, request, trace


def _never_accepted(plain):
    """Drafts a token the target never emits here: every draft is rejected."""
    wrong = next(t for t in range(64) if t not in plain)
    return lambda request, so_far: wrong


def _always_accepted(plain):
    """Drafts exactly what `none` emits next: every draft is accepted."""
    def pick(request, so_far):
        position = request.num_output_tokens + len(so_far)
        return plain[position] if position < len(plain) else plain[-1]
    return pick


@pytest.mark.parametrize("method", ["eagle", "auto"])
def test_a_head_never_accepted_retires_and_takes_nones_path(tiny_chat_model_folder, head_folder,
                                                           plain, method, monkeypatch):
    tokens, request, trace = _traced_run(tiny_chat_model_folder, head_folder, method,
                                         pick=_never_accepted(plain))
    assert tokens == plain
    assert request.head_retired and request.pending_features == []
    captures = trace["captures"]
    # The prompt and HEAD_IDLE_STEPS + 1 decode steps carried the feature layers (the last of
    # them retired the head); then none did.
    retired_at = 2 + head_retirement.HEAD_IDLE_STEPS
    assert captures.index(False) == retired_at < len(captures) // 2
    assert not any(captures[retired_at:])
    assert trace["kept_after_retiring"] == 0
    forwards_when_retired = trace["head_forwards"]
    if method == "eagle":  # it drafted, and failed (`auto` prices the head by measured step
        assert forwards_when_retired > 0  # times: it may retire it without drafting)

    # The control: with retirement held off, every step keeps paying for the head.
    monkeypatch.setattr(head_retirement, "HEAD_IDLE_STEPS", 10**9)
    tokens, request, trace = _traced_run(tiny_chat_model_folder, head_folder, method,
                                         pick=_never_accepted(plain))
    assert tokens == plain and not request.head_retired
    assert all(trace["captures"]) and request.pending_features
    if method == "eagle":
        assert trace["head_forwards"] > forwards_when_retired  # drafting on, and failing


def test_a_head_that_is_accepted_does_not_retire(tiny_chat_model_folder, head_folder, plain,
                                                 monkeypatch):
    # The run takes ~20 steps: with 4 idle steps allowed, only its acceptances keep it going.
    monkeypatch.setattr(head_retirement, "HEAD_IDLE_STEPS", 4)
    tokens, request, trace = _traced_run(tiny_chat_model_folder, head_folder, "eagle",
                                         pick=_always_accepted(plain))
    assert tokens == plain
    assert not request.head_retired
    assert all(trace["captures"])
    assert request.spec_stats.num_accepted_tokens > len(plain) // 2


def test_a_head_the_controller_never_drafts_with_retires_after_the_idle_steps(
        tiny_chat_model_folder, head_folder, plain, monkeypatch):
    monkeypatch.setattr(head_retirement, "HEAD_IDLE_STEPS", 20)
    tokens, request, trace = _traced_run(tiny_chat_model_folder, head_folder, "eagle",
                                         hold_back=True)
    assert tokens == plain and request.head_retired
    assert trace["head_forwards"] == 0
    captures = trace["captures"]
    # prefill, then 21 decode steps kept rows (the 21st retired the head); then none did
    assert captures.index(False) == 22
    assert not any(captures[22:])

    # The control: with more idle steps allowed than the request decodes, it keeps its rows.
    monkeypatch.setattr(head_retirement, "HEAD_IDLE_STEPS", 10**9)
    tokens, request, trace = _traced_run(tiny_chat_model_folder, head_folder, "eagle",
                                         hold_back=True)
    assert not request.head_retired and all(trace["captures"])
    assert request.pending_features  # everything since the prompt, kept for nothing


def test_steps_count_against_the_head_only_where_nothing_was_accepted(monkeypatch):
    """An accepted head draft starts the count again, a step another source paid for counts
    neither way, and a step that added nothing counts; past HEAD_IDLE_STEPS of those the head
    retires and its rows and its acceptance tracker go."""
    from engine.core.request import Request
    from engine.sampling_params import SamplingParams as Params

    monkeypatch.setattr(head_retirement, "HEAD_IDLE_STEPS", 3)
    request = Request("r", [1, 2, 3], Params(max_tokens=8))
    request.pending_features = [(0, object(), False)]
    request.acceptance_by_source = {head_retirement.HEAD_TRACKER: request.acceptance,
                                    "copy": request.acceptance}
    for head_drafted, accepted, idle in [(True, False, 1), (False, False, 2), (True, True, 0),
                                         (False, False, 1), (False, True, 1), (False, False, 2),
                                         (True, False, 3)]:
        head_retirement.count_step(request, head_drafted, accepted)
        assert (request.head_idle_steps, request.head_retired) == (idle, False)
    assert request.pending_features
    head_retirement.count_step(request, False, False)
    assert request.head_retired and request.pending_features == []
    assert list(request.acceptance_by_source) == ["copy"]  # no slots kept for its drafts


def test_an_adaptive_controller_retires_heads_and_a_fixed_k_does_not(tiny_chat_model_folder,
                                                                      head_folder):
    for method in ("eagle", "auto"):
        for adaptive in (True, False):
            proposer = make_llm(str(tiny_chat_model_folder), speculative_method=method,
                                draft_head=str(head_folder), adaptive=adaptive).engine.proposer
            head = proposer if method == "eagle" else proposer.head
            assert head.retire is adaptive
