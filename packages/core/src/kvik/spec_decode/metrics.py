"""Speculative decoding counts: drafts, draft tokens, accepted tokens (in all and per draft
position), and what is read from them (acceptance rate, mean accepted length).

The Prometheus names are vLLM's under kvik's prefix. Core does not depend on prometheus_client:
``prometheus_increments`` gives (name, labels, increment) triples for the server's /metrics to
apply to counters it owns (the ``position`` label on the per-position counter, as vLLM's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

NUM_DRAFTS = "kvik:spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "kvik:spec_decode_num_draft_tokens"
NUM_ACCEPTED_TOKENS = "kvik:spec_decode_num_accepted_tokens"
NUM_ACCEPTED_TOKENS_PER_POS = "kvik:spec_decode_num_accepted_tokens_per_pos"

#: name -> help text, for the server to create its counters from.
METRIC_DOCS = {
    NUM_DRAFTS: "Number of spec decoding drafts.",
    NUM_DRAFT_TOKENS: "Number of draft tokens.",
    NUM_ACCEPTED_TOKENS: "Number of accepted tokens.",
    NUM_ACCEPTED_TOKENS_PER_POS: "Accepted tokens per draft position.",
}


@dataclass
class SpecDecodingStats:
    """Counts over some verification steps; a draft is one request's proposal in one step."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_spec_tokens < 1:
            raise ValueError(f"num_spec_tokens must be >= 1, got {self.num_spec_tokens}")
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verification: it proposed num_draft_tokens, the first
        num_accepted_tokens of which the target accepted (acceptance stops at the first miss)."""
        if not 0 <= num_draft_tokens <= self.num_spec_tokens:
            raise ValueError(
                f"a draft has 0..{self.num_spec_tokens} tokens, got {num_draft_tokens}"
            )
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(
                f"accepted {num_accepted_tokens} of {num_draft_tokens} draft tokens is impossible"
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for position in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[position] += 1

    def observe_batch(self, num_draft_tokens: list[int], num_accepted_tokens: list[int]) -> None:
        """A step's drafts, per request (the rejection sampler's counts)."""
        for drafted, accepted in zip(num_draft_tokens, num_accepted_tokens, strict=True):
            self.observe_draft(drafted, accepted)

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
        )

    def merge(self, other: SpecDecodingStats) -> None:
        if other.num_spec_tokens != self.num_spec_tokens:
            raise ValueError(
                f"cannot merge counts for {other.num_spec_tokens} speculative tokens into counts "
                f"for {self.num_spec_tokens}"
            )
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for i, n in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[i] += n

    def minus(self, before: SpecDecodingStats | None) -> SpecDecodingStats:
        """What was counted since ``before`` (an earlier copy of the same cumulative counts)."""
        if before is None:
            return self.copy()
        if before.num_spec_tokens != self.num_spec_tokens:
            raise ValueError(
                f"cannot subtract counts for {before.num_spec_tokens} speculative tokens from "
                f"counts for {self.num_spec_tokens}"
            )
        pairs = zip(self.num_accepted_tokens_per_pos, before.num_accepted_tokens_per_pos)
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            [now - then for now, then in pairs],
        )

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step yields per request: 1 (the target's own token) plus the
        accepted drafts, as vLLM's "mean acceptance length"."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Per draft position, the share of drafts whose token there was accepted."""
        if not self.num_drafts:
            return [0.0] * self.num_spec_tokens
        return [n / self.num_drafts for n in self.num_accepted_tokens_per_pos]

    def summary(self) -> str:
        per_pos = ", ".join(f"{rate:.3f}" for rate in self.acceptance_rate_per_pos)
        return (
            f"mean accepted length {self.mean_accepted_length:.3f}, acceptance rate "
            f"{self.acceptance_rate:.3f}, per position [{per_pos}] over {self.num_drafts} drafts, "
            f"{self.num_draft_tokens} draft tokens, {self.num_accepted_tokens} accepted"
        )

    def to_json(self) -> dict[str, object]:
        """The counts and what is read from them, for a benchmark's JSON."""
        return {
            "num_spec_tokens": self.num_spec_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_rate_per_pos": [round(r, 4) for r in self.acceptance_rate_per_pos],
        }

    def prometheus_increments(self) -> list[tuple[str, dict[str, str], int]]:
        """These counts as increments of vLLM's counters: (name, labels, amount)."""
        increments: list[tuple[str, dict[str, str], int]] = [
            (NUM_DRAFTS, {}, self.num_drafts),
            (NUM_DRAFT_TOKENS, {}, self.num_draft_tokens),
            (NUM_ACCEPTED_TOKENS, {}, self.num_accepted_tokens),
        ]
        for position, n in enumerate(self.num_accepted_tokens_per_pos):
            increments.append((NUM_ACCEPTED_TOKENS_PER_POS, {"position": str(position)}, n))
        return increments
