"""Per-request logits processors: the seam where min-tokens, penalties, biases and structured
outputs plug in.

A processor sees one request's output tokens so far and its logits row [V] (fp32, raw model logits
before temperature) and returns the row to sample from. The sampler applies them only to the rows of
requests that have any, so requests without processors cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from kvik.request import Request


_FLOAT32 = torch.finfo(torch.float32)
#: The largest logit a processor leaves: the sampler's division by a temperature (at least its
#: greedy threshold, 1e-5) keeps it finite, with a factor of ten to spare (at max * 1e-5 exactly,
#: the division's rounding overflowed to inf, and inf - inf in the softmax sampled token 0).
_SATURATED = _FLOAT32.max * 1e-6


class LogitsProcessor(Protocol):
    def __call__(self, output_token_ids: Sequence[int], logits: Tensor) -> Tensor: ...


class MinTokensLogitsProcessor:
    """Forbid end-of-sequence and stop tokens until ``min_tokens`` tokens have been generated."""

    def __init__(self, min_tokens: int, stop_ids: Sequence[int]) -> None:
        self.min_tokens = min_tokens
        self.stop_ids = sorted(set(stop_ids))

    def __call__(self, output_token_ids: Sequence[int], logits: Tensor) -> Tensor:
        if len(output_token_ids) < self.min_tokens and self.stop_ids:
            logits[self.stop_ids] = float("-inf")
        return logits


class RepetitionPenaltyLogitsProcessor:
    """As Hugging Face and vLLM: every token seen in the prompt or output has a positive logit
    divided by the penalty and a negative one multiplied by it.

    A penalty far from 1 is kept finite in fp32: 1e-308 rounded to 0 there and made every seen
    positive logit inf (and 1e39 to inf, with 0 * inf NaN); a row of infinities samples NaN, which
    came out as token 0 whatever the model said."""

    def __init__(self, penalty: float, prompt_token_ids: Sequence[int]) -> None:
        # Within float32's range: a penalty that rounds to 0 or to inf makes NaN of a 0 logit.
        self.penalty = min(max(penalty, _FLOAT32.tiny), _FLOAT32.max)
        self.prompt_ids = torch.tensor(sorted(set(prompt_token_ids)), dtype=torch.long)

    def __call__(self, output_token_ids: Sequence[int], logits: Tensor) -> Tensor:
        seen = torch.cat((self.prompt_ids, torch.tensor(output_token_ids, dtype=torch.long)))
        seen = seen.unique().to(logits.device)
        values = logits[seen]
        scaled = torch.where(values > 0, values / self.penalty, values * self.penalty)
        # An extreme penalty saturates: a finite logit stays finite, even divided by the smallest
        # temperature the sampler divides by (an inf among the logits makes NaN of the softmax,
        # and the sampler then returns token 0, allowed or not); a masked one (-inf) stays masked.
        logits[seen] = torch.where(values.isfinite(), scaled.clamp(-_SATURATED, _SATURATED), values)
        return logits


class PresenceFrequencyLogitsProcessor:
    """OpenAI's penalties over the output so far: ``-= frequency * count + presence * (count > 0)``."""

    def __init__(self, presence: float, frequency: float) -> None:
        self.presence = presence
        self.frequency = frequency

    def __call__(self, output_token_ids: Sequence[int], logits: Tensor) -> Tensor:
        if not output_token_ids:
            return logits
        ids = torch.tensor(output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(ids, minlength=logits.shape[-1]).to(logits.dtype)
        return logits - self.frequency * counts - self.presence * (counts > 0).to(logits.dtype)


class LogitBiasLogitsProcessor:
    def __init__(self, bias: dict[int, float]) -> None:
        self.ids = list(bias)
        self.values = torch.tensor([bias[i] for i in self.ids], dtype=torch.float32)

    def __call__(self, output_token_ids: Sequence[int], logits: Tensor) -> Tensor:
        logits[self.ids] += self.values.to(logits.device)
        return logits


class AllowedTokensLogitsProcessor:
    def __init__(self, allowed: Sequence[int]) -> None:
        self.allowed = sorted(set(allowed))

    def __call__(self, output_token_ids: Sequence[int], logits: Tensor) -> Tensor:
        kept = logits[self.allowed].clone()
        logits.fill_(float("-inf"))
        logits[self.allowed] = kept
        return logits


def bad_word_endings(
    bad_words_token_ids: Sequence[Sequence[int]], output_token_ids: Sequence[int]
) -> list[int]:
    """The tokens bad words forbid next: each word's last token, where the output ends with the
    word's other tokens (the structured outputs' dead-end check asks the same)."""
    endings = []
    for word in bad_words_token_ids:
        if not word:
            continue
        prefix = list(word[:-1])
        if not prefix or list(output_token_ids[-len(prefix) :]) == prefix:
            endings.append(word[-1])
    return endings


class BadWordsLogitsProcessor:
    """Forbid the last token of a bad word whenever the output ends with the word's other tokens."""

    def __init__(self, bad_words_token_ids: Sequence[Sequence[int]]) -> None:
        self.words = [list(w) for w in bad_words_token_ids if w]

    def __call__(self, output_token_ids: Sequence[int], logits: Tensor) -> Tensor:
        for token in bad_word_endings(self.words, output_token_ids):
            logits[token] = float("-inf")
        return logits


def build_logits_processors(request: Request) -> list[LogitsProcessor]:
    """The processors a request's sampling parameters call for, in vLLM's order."""
    p = request.sampling_params
    processors: list[LogitsProcessor] = []
    if p.allowed_token_ids is not None:
        processors.append(AllowedTokensLogitsProcessor(p.allowed_token_ids))
    if request.bad_words_token_ids:
        processors.append(BadWordsLogitsProcessor(request.bad_words_token_ids))
    if p.min_tokens > 0:
        stop_ids = list(p.stop_token_ids or ())
        if not p.ignore_eos:
            stop_ids += list(request.eos_token_ids)
        processors.append(MinTokensLogitsProcessor(p.min_tokens, stop_ids))
    if p.logit_bias:
        processors.append(LogitBiasLogitsProcessor(p.logit_bias))
    if p.repetition_penalty != 1.0:
        processors.append(
            RepetitionPenaltyLogitsProcessor(p.repetition_penalty, request.prompt_token_ids)
        )
    if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
        processors.append(PresenceFrequencyLogitsProcessor(p.presence_penalty, p.frequency_penalty))
    return processors
