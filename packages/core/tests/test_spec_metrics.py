"""Acceptance counts and what is read from them, with vLLM's Prometheus names."""

from __future__ import annotations

import pytest

from kvik.spec_decode.metrics import (
    NUM_ACCEPTED_TOKENS,
    NUM_ACCEPTED_TOKENS_PER_POS,
    NUM_DRAFT_TOKENS,
    NUM_DRAFTS,
    SpecDecodingStats,
)


def test_counts_rates_and_mean_accepted_length():
    stats = SpecDecodingStats(num_spec_tokens=3)
    assert stats.mean_accepted_length == 1.0 and stats.acceptance_rate == 0.0
    stats.observe_batch([3, 3, 2, 0], [3, 1, 0, 0])
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 8, 4)
    assert stats.num_accepted_tokens_per_pos == [2, 1, 1]
    assert stats.acceptance_rate == 0.5
    assert stats.mean_accepted_length == 2.0  # 1 + 4 accepted / 4 drafts
    assert stats.acceptance_rate_per_pos == [0.5, 0.25, 0.25]
    other = SpecDecodingStats(num_spec_tokens=3)
    other.observe_draft(3, 2)
    stats.merge(other)
    assert stats.num_accepted_tokens_per_pos == [3, 2, 1] and stats.num_drafts == 5
    assert "mean accepted length 2.200" in stats.summary()


def test_a_proposer_that_proposes_nothing_shows_in_the_counts():
    stats = SpecDecodingStats(num_spec_tokens=4)
    stats.observe_batch([0, 0], [0, 0])
    assert stats.num_draft_tokens == 0 and stats.mean_accepted_length == 1.0


def test_prometheus_increments_use_vllms_names():
    stats = SpecDecodingStats(num_spec_tokens=2)
    stats.observe_batch([2, 2], [2, 1])
    assert stats.prometheus_increments() == [
        ("kvik:spec_decode_num_drafts", {}, 2),
        ("kvik:spec_decode_num_draft_tokens", {}, 4),
        ("kvik:spec_decode_num_accepted_tokens", {}, 3),
        ("kvik:spec_decode_num_accepted_tokens_per_pos", {"position": "0"}, 2),
        ("kvik:spec_decode_num_accepted_tokens_per_pos", {"position": "1"}, 1),
    ]
    names = (NUM_DRAFTS, NUM_DRAFT_TOKENS, NUM_ACCEPTED_TOKENS, NUM_ACCEPTED_TOKENS_PER_POS)
    assert [name.removeprefix("kvik:") for name in names] == [
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_per_pos",
    ]  # vLLM's names after its "vllm:" prefix


def test_impossible_counts_are_errors():
    stats = SpecDecodingStats(num_spec_tokens=2)
    with pytest.raises(ValueError, match="0..2 tokens"):
        stats.observe_draft(3, 0)
    with pytest.raises(ValueError, match="accepted 2 of 1"):
        stats.observe_draft(1, 2)
    with pytest.raises(ValueError, match="cannot merge"):
        stats.merge(SpecDecodingStats(num_spec_tokens=3))
    with pytest.raises(ValueError, match="num_spec_tokens"):
        SpecDecodingStats(num_spec_tokens=0)


def test_counts_since_an_earlier_copy():
    stats = SpecDecodingStats(num_spec_tokens=2)
    stats.observe_batch([2, 1], [1, 1])
    before = stats.copy()
    stats.observe_batch([2, 2], [2, 0])
    run = stats.minus(before)
    assert (run.num_drafts, run.num_draft_tokens, run.num_accepted_tokens) == (2, 4, 2)
    assert run.num_accepted_tokens_per_pos == [1, 1]
    assert stats.minus(None) == stats
    figures = run.to_json()
    assert figures["acceptance_rate"] == 0.5 and figures["mean_accepted_length"] == 2.0
    assert figures["acceptance_rate_per_pos"] == [0.5, 0.5]
    with pytest.raises(ValueError, match="cannot subtract"):
        stats.minus(SpecDecodingStats(num_spec_tokens=3))
