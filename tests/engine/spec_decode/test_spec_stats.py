"""Tests of engine.metrics.spec_stats (no model): the speculation counters and the per-request
acceptance trackers the controller reads."""

from __future__ import annotations

import random

import pytest

from engine.metrics.spec_stats import DECAY, PRIOR_ACCEPTANCE, AcceptanceTracker, SpecStats


def test_spec_stats_record():
    stats = SpecStats()
    assert stats.acceptance_rate == 0.0 and stats.mean_acceptance_length == 0.0
    stats.record(4, 2)
    stats.record(4, 4)
    stats.record(3, 0)
    assert (stats.num_drafts, stats.num_draft_tokens) == (3, 11)
    assert (stats.num_accepted_tokens, stats.num_emitted_tokens) == (6, 9)
    assert stats.accepted_per_position == [2, 2, 1, 1]
    assert stats.acceptance_rate == pytest.approx(6 / 11)
    assert stats.mean_acceptance_length == pytest.approx(3.0)
    emitted_per_step = stats.num_emitted_tokens / stats.num_drafts
    assert stats.mean_acceptance_length == pytest.approx(emitted_per_step)


def test_spec_stats_merge_equals_recording_everything_in_one():
    rng = random.Random(0)
    steps = [(k, rng.randint(0, k)) for k in (rng.randint(1, 6) for _ in range(200))]
    parts, whole = [SpecStats(), SpecStats(), SpecStats()], SpecStats()
    for index, (k, num_accepted) in enumerate(steps):
        method = ("ngram", "suffix")[index % 2]
        for stats in (parts[index % 3 if index < 150 else 0], whole):
            stats.record(k, num_accepted)
            stats.record_method(method, k, num_accepted)
    merged = SpecStats()
    for part in [parts[1], parts[0], SpecStats(), parts[2]]:
        merged.merge(part)
    assert merged == whole
    per_position = whole.accepted_per_position
    assert all(a >= b for a, b in zip(per_position, per_position[1:]))
    assert sum(per_position) == whole.num_accepted_tokens
    assert per_position[0] == sum(1 for _, a in steps if a > 0)
    assert sum(whole.draft_tokens_by_method.values()) == whole.num_draft_tokens
    assert whole.method_acceptance()["suffix"] == pytest.approx(
        sum(a for i, (_, a) in enumerate(steps) if i % 2)
        / sum(k for i, (k, _) in enumerate(steps) if i % 2))
    # a snapshot is a copy: recording after it leaves it as it was
    before = whole.snapshot()
    whole.record_method("suffix", 3, 1)
    assert before.draft_tokens_by_method["suffix"] == whole.draft_tokens_by_method["suffix"] - 3


def test_acceptance_tracker_follows_observations_and_drifts_back_to_the_prior():
    tracker = AcceptanceTracker()
    assert tracker.estimate() == pytest.approx(PRIOR_ACCEPTANCE)
    for _ in range(50):
        tracker.observe(4, 4)
    assert tracker.estimate() > 0.95
    for _ in range(150):
        tracker.observe(4, 0)
    assert tracker.estimate() < 0.1
    for _ in range(200):
        tracker.decay()
    assert tracker.estimate() == pytest.approx(PRIOR_ACCEPTANCE, abs=1e-3)


def test_acceptance_tracker_counts_accepted_drafts_and_the_first_rejection_as_trials():
    tracker = AcceptanceTracker()
    tracker.observe(4, 2)
    assert (tracker.accepted, tracker.trials) == (2, 3)
    tracker.observe(4, 4)  # no rejection: four trials, four successes
    assert tracker.accepted == pytest.approx(DECAY * 2 + 4)
    assert tracker.trials == pytest.approx(DECAY * 3 + 4)
