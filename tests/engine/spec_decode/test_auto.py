"""`auto`: per request, the lookup whose draft promises the most tokens per second, with the
chosen source named in the metrics; its law and greedy output are tested with every other method
in tests/engine/test_spec_decode_engine.py."""

import pytest

from engine.config import SpeculativeConfig
from engine.core.request import Request, RequestStatus
from engine.metrics.spec_stats import AcceptanceTracker
from engine.sampling_params import SamplingParams
from engine.spec_decode.auto import AutoProposer, expected_gain
from engine.spec_decode.step_cost import LinearCostModel
from engine.spec_decode.ngram import NgramLookup
from engine.spec_decode.suffix import build_suffix_proposer

PROMPT = [7, 8, 9, 10, 11, 12, 13, 14]
ANSWER = [501, 502, 503, 504, 505, 506, 507, 508]


def auto() -> AutoProposer:
    suffix = build_suffix_proposer(SpeculativeConfig(speculative_method="auto"))
    return AutoProposer(suffix, NgramLookup(4, 1), LinearCostModel(fixed=5e-3, per_unit=1e-3))


def request(prompt, output=()):
    made = Request("r", list(prompt), SamplingParams())
    for token in output:
        made.append_output_token(token)
    return made


def test_expected_gain_is_the_geometric_sum():
    assert expected_gain(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_gain(1.0, 4) == 4.0
    assert expected_gain(0.0, 4) == 0.0


def test_a_cached_answer_is_drafted_from_the_suffix_cache():
    proposer = auto()
    done = request(PROMPT, ANSWER)
    done.status = RequestStatus.FINISHED_STOPPED
    proposer.request_finished(done)
    again = request(PROMPT, ANSWER[:2])
    proposer.prepare([again], [4])
    assert proposer.method_of(again) == "suffix" and proposer.drafts_are_free(again)
    assert proposer.propose([again], [4]).draft_token_ids == [ANSWER[2:6]]
    # the chosen source's tracker is what the controller sizes K by
    assert again.acceptance is again.acceptance_by_source["suffix"]
    # negative control: nothing cached, nothing repeated: no draft from either lookup
    fresh = request([1, 2, 3, 4], [5])
    proposer.prepare([fresh], [4])
    assert proposer.propose([fresh], [4]).draft_token_ids == [[]]


def test_the_source_with_the_better_record_wins():
    """Both lookups find a continuation of a context that repeats itself; the one whose drafts
    were accepted lately is chosen, and the choice follows the record when it turns."""
    proposer = auto()
    looping = request([1, 2, 3, 4, 5, 6, 1, 2, 3])
    proposer.prepare([looping], [3])  # creates the trackers
    trackers = looping.acceptance_by_source
    trackers["ngram"] = AcceptanceTracker(accepted=20, trials=21)
    trackers["suffix"] = AcceptanceTracker(accepted=0, trials=20)
    proposer.prepare([looping], [3])
    assert proposer.method_of(looping) == "ngram"
    assert proposer.propose([looping], [3]).draft_token_ids == [[4, 5, 6]]
    trackers["ngram"] = AcceptanceTracker(accepted=0, trials=20)
    trackers["suffix"] = AcceptanceTracker(accepted=20, trials=21)
    proposer.prepare([looping], [3])
    assert proposer.method_of(looping) == "suffix"
