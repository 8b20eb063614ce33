"""Per-request logits processors: the seam where min-tokens, penalties and structured outputs plug in.

A processor sees one request's output tokens so far and its logits row [V] (fp32, raw model logits
before temperature) and returns the row to sample from. The sampler applies them only to the rows of
requests that have any, so requests without processors cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from kvik.sampling_params import SamplingParams


class LogitsProcessor(Protocol):
    def __call__(self, output_token_ids: Sequence[int], logits: Tensor) -> Tensor: ...


class MinTokensLogitsProcessor:
    """Forbid end-of-sequence and stop tokens until ``min_tokens`` tokens have been generated."""

    def __init__(self, min_tokens: int, stop_ids: Sequence[int]) -> None:
        self.min_tokens = min_tokens
        self.stop_ids = sorted(set(stop_ids))

    def __call__(self, output_token_ids: Sequence[int], logits: Tensor) -> Tensor:
        if len(output_token_ids) < self.min_tokens and self.stop_ids:
            logits[torch.tensor(self.stop_ids, device=logits.device)] = float("-inf")
        return logits


def build_logits_processors(
    params: SamplingParams, eos_token_ids: Sequence[int]
) -> list[LogitsProcessor]:
    processors: list[LogitsProcessor] = []
    if params.min_tokens > 0:
        stop_ids = list(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids += list(eos_token_ids)
        processors.append(MinTokensLogitsProcessor(params.min_tokens, stop_ids))
    return processors
