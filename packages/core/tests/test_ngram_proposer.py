"""Prompt lookup: the longest ending n-gram in [min, max], its latest earlier occurrence, the k
tokens after it; nothing where nothing matches."""

from __future__ import annotations

import numpy as np
import pytest

from kvik.spec_decode.config import SpeculativeConfig
from kvik.spec_decode.ngram_proposer import NgramProposer


def propose(tokens, min_n=1, max_n=3, k=3, max_tokens=None):
    return NgramProposer(min_n, max_n, k).propose_one(np.array(tokens), max_tokens).tolist()


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule spelled out with loops."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        ending = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == ending:
                return tokens[start + n : start + n + k]
    return []


def test_copies_what_followed_the_ending_before():
    assert propose([1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4, 5, 9]
    assert propose([1, 2, 3, 4, 5, 9, 1, 2, 3], k=2) == [4, 5]
    assert propose([7, 8, 9, 1, 2], k=5) == []  # 2 never occurred before
    assert propose([5, 6, 5, 6], k=4) == [5, 6]  # only what exists after the match


def test_prefers_the_longest_match_then_the_latest():
    # "3" occurs twice; "2 3" once (followed by 7): the longer match wins.
    assert propose([2, 3, 7, 4, 3, 8, 2, 3], k=1) == [7]
    # "1 2" occurs twice, followed by 5 then by 6: the latest.
    assert propose([1, 2, 5, 1, 2, 6, 1, 2], k=1) == [6]


def test_min_n_and_max_n_bound_the_match():
    tokens = [4, 1, 2, 9, 3, 2]
    assert propose(tokens, min_n=1, k=2) == [9, 3]
    assert propose(tokens, min_n=2, k=2) == []  # only a 1-gram matches
    assert propose([1], min_n=1) == []  # too short to have a match before its ending


def test_max_tokens_caps_the_proposal():
    proposer = NgramProposer(1, 3, 4)
    seqs = [np.array([1, 2, 3, 1, 2]), np.array([9, 9, 9, 9])]
    assert [p.tolist() for p in proposer.propose(seqs, [1, 0])] == [[3], []]
    assert [p.tolist() for p in proposer.propose(seqs)] == [[3, 1, 2], [9]]
    with pytest.raises(ValueError, match="2 sequences but 1 max_tokens"):
        proposer.propose(seqs, [1])


def test_agrees_with_the_spelled_out_rule_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, rng.integers(1, 40)).tolist()
        min_n, max_n = sorted(rng.integers(1, 5, 2).tolist())
        k = int(rng.integers(1, 6))
        assert propose(tokens, min_n, max_n, k) == reference(tokens, min_n, max_n, k), tokens


def test_from_config_and_bad_arguments():
    proposer = NgramProposer.from_config(SpeculativeConfig(4, "ngram", prompt_lookup_max=3))
    assert (proposer.min_n, proposer.max_n, proposer.k) == (3, 3, 4)
    with pytest.raises(ValueError, match="needs method 'ngram'"):
        NgramProposer.from_config(SpeculativeConfig(4, "eagle3", model="m"))
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramProposer(3, 2, 1)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(1, 2, 0)
