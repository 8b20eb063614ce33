"""Prompt lookup: propose the tokens that followed the last time the sequence's ending appeared.

For a request's tokens (prompt and output so far), find the longest n in
[prompt_lookup_min, prompt_lookup_max] such that the last n tokens occurred earlier; the k tokens
that followed that occurrence (the latest one, when there are several) are the proposal. Text that
copies its prompt (edits, quotes, retrieved passages) is proposed well; anything else gets no
proposal, which costs nothing to verify.

Vectorised with numpy, on the host: one pass compares each earlier position's preceding tokens
with the ending, up to prompt_lookup_max of them, so it can run off the critical path while the
device computes the previous step.
"""

from __future__ import annotations

import numpy as np

from kvik.spec_decode.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.min_n, self.max_n, self.k = min_n, max_n, num_speculative_tokens

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> NgramProposer:
        if config.method != "ngram":
            raise ValueError(f"NgramProposer needs method 'ngram', got {config.method!r}")
        return cls(
            config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens
        )

    def propose_one(self, token_ids: np.ndarray, max_tokens: int | None = None) -> np.ndarray:
        """Up to k (and ``max_tokens``) proposed ids for one request; empty if no n-gram of
        [min_n, max_n] tokens ending the sequence occurred before."""
        tokens = np.asarray(token_ids)
        limit = self.k if max_tokens is None else min(self.k, max_tokens)
        length = tokens.shape[0]
        if limit <= 0 or length <= self.min_n:
            return tokens[:0]
        max_n = min(self.max_n, length - 1)
        # Candidate ends i < length - 1 (a token must follow). matched[l, i]: the token l places
        # before i equals the token l places before the sequence's end.
        ends = np.arange(length - 1)
        lags = np.arange(max_n)[:, None]
        before = ends[None, :] - lags
        matched = (before >= 0) & (tokens[np.maximum(before, 0)] == tokens[length - 1 - lags])
        # How far each candidate's agreement with the ending runs.
        run = np.cumprod(matched, axis=0).sum(axis=0)
        best = run.max()
        if best < self.min_n:
            return tokens[:0]
        end = ends[run == best][-1]  # the latest occurrence of the longest match
        return tokens[end + 1 : end + 1 + limit]

    def propose(
        self, sequences: list[np.ndarray], max_tokens: list[int] | None = None
    ) -> list[np.ndarray]:
        """Per request, its proposal (possibly empty). ``max_tokens`` caps each request's
        proposal (its remaining output budget or model length)."""
        if max_tokens is not None and len(max_tokens) != len(sequences):
            raise ValueError(f"{len(sequences)} sequences but {len(max_tokens)} max_tokens")
        caps = max_tokens if max_tokens is not None else [None] * len(sequences)
        return [self.propose_one(seq, cap) for seq, cap in zip(sequences, caps, strict=True)]
