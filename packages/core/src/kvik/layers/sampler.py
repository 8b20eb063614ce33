"""Sampling a batch of logits rows: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Random rows draw with the exponential-race trick (argmax of probs / q with q ~ Exp(1)), which equals
sampling from probs. A seeded request's q for its output token i is drawn from a generator seeded
with ``position_seed(seed, i)``: it depends on the seed and the position alone, not on the batch,
on how many draws the request made before (speculative steps verify a varying number of drafts),
or on which step samples the position (asynchronous scheduling, preemptions). The rejection
sampler draws a seeded position's noise the same way, so that the token a position gets is the one
this sampler would take there (``kvik.spec_decode.rejection_sampler``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvik import ops
from kvik.layers.logits_processors import LogitsProcessor
from kvik.scheduler.output import TokenLogprobs

_GREEDY_EPS = 1e-5


@dataclass
class SamplingBatch:
    """Per-row sampling settings for one step's logits [N, V]."""

    temperature: Tensor  # [N] fp32; rows below _GREEDY_EPS are greedy
    top_k: Tensor  # [N] int64; 0 = off
    top_p: Tensor  # [N] fp32; 1 = off
    min_p: Tensor  # [N] fp32; 0 = off
    # Decided on the host from the requests' parameters, so sampling never waits on the device.
    all_greedy: bool = False
    use_top_k: bool = True
    use_top_p: bool = True
    use_min_p: bool = True
    # row -> (its request's seed, the output index of the row's token): seeded rows draw from
    # these alone (``at_position``). The rejection sampler keys them by request, with the index
    # of the request's first scored position (its j-th row is that index + j).
    seeds: dict[int, tuple[int, int]] = field(default_factory=dict)
    # (row, processors, output tokens so far) for the rows that have processors
    processors: list[tuple[int, list[LogitsProcessor], list[int]]] = field(default_factory=list)


def greedy_ids(
    argmax_rows: Callable[[Tensor, Tensor | None, Tensor], None], logits: Tensor
) -> Tensor:
    """Each row's first maximal index [N] int64, through ``argmax_rows`` (``kvik::argmax_rows``
    as the building engine's ops_dispatch resolved it: ``kvik.ops.small_op``)."""
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    argmax_rows(logits, None, out)
    return out


_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def position_seed(seed: int, index: int) -> int:
    """The generator seed of a seeded request's output token ``index`` (0 for the first): a
    64-bit mix of both, whose low 32 bits (all that a CPU generator, mt19937, keeps) differ between
    neighbouring seeds and positions too."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ index)


def at_position(generator: torch.Generator, seed: int, index: int) -> torch.Generator:
    """``generator`` reseeded for a seeded request's output token ``index``: what that position
    draws (its Exp(1) noise over the vocabulary first, as the sampler and the rejection sampler
    both do, so the same seed and position give the same noise in both).

    Cost, per seeded position: the reseed, on the host (a fresh mt19937 state on the CPU; a seed
    and an offset on CUDA, which each launch reads by value: no device work, no
    synchronization), and the draw's own launch over the vocabulary, as one generator per request
    took. Unseeded rows never come here."""
    return generator.manual_seed(position_seed(seed, index))


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # for rows without a seed of their own
        # Reseeded for every seeded row's position (``at_position``).
        self._seeded = torch.Generator(generator.device)
        # The platform's kernel where it has one (a GPU's reduction spread over the row): built
        # inside the engine's ops_dispatch, as the model's layers are.
        self._argmax_rows = ops.small_op("argmax_rows")

    def greedy(self, logits: Tensor) -> Tensor:
        return greedy_ids(self._argmax_rows, logits)

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        """logits [N, V] fp32 -> sampled token ids [N] int64."""
        for row, processors, output_ids in batch.processors:
            for processor in processors:
                logits[row] = processor(output_ids, logits[row])
        greedy = self.greedy(logits)
        if batch.all_greedy:
            return greedy
        greedy_rows = batch.temperature < _GREEDY_EPS
        temperature = torch.where(greedy_rows, 1.0, batch.temperature)
        logits = logits / temperature.unsqueeze(1)
        logits = apply_top_k_top_p(
            logits,
            batch.top_k if batch.use_top_k else None,
            batch.top_p if batch.use_top_p else None,
        )
        probs = logits.softmax(dim=-1)
        if batch.use_min_p:
            floor = batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, (seed, index) in batch.seeds.items():
            q[row].exponential_(generator=at_position(self._seeded, seed, index))
        sampled = probs.div(q).max(dim=-1).indices
        return torch.where(greedy_rows, greedy, sampled)


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Mask (to -inf) what top-k (0 = off) and top-p (1 = off) exclude; None skips a filter."""
    vocab = logits.shape[-1]
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        threshold = sorted_logits.gather(1, (vocab - k).unsqueeze(1))  # the k-th largest
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


@dataclass
class LogprobTensors:
    """Logprobs of N rows, still on the device: computed when a step launches and read on the host
    (``to_lists``) when it is collected, so that asking for logprobs adds no sync of its own."""

    chosen_ids: Tensor  # [N]
    chosen_values: Tensor  # [N]
    ranks: Tensor  # [N]
    top_values: Tensor  # [N, K]
    top_ids: Tensor  # [N, K]
    counts: list[int]  # per row, how many of the top K it asked for

    def to_lists(self) -> list[TokenLogprobs]:
        top_values, top_ids = self.top_values.tolist(), self.top_ids.tolist()
        chosen_values, chosen_ids = self.chosen_values.tolist(), self.chosen_ids.tolist()
        ranks = self.ranks.tolist()
        return [
            TokenLogprobs(
                token_ids=[chosen_ids[i]] + top_ids[i][:n],
                logprobs=[chosen_values[i]] + top_values[i][:n],
                ranks=[ranks[i]] + list(range(1, n + 1)),
            )
            for i, n in enumerate(self.counts)
        ]


def logprob_tensors(logprobs: Tensor, token_ids: Tensor, num_top: list[int]) -> LogprobTensors:
    """Per row: the given token's logprob and rank, and the top ``num_top[row]`` (-1 = all).

    logprobs [N, V] (log-softmax of raw logits), token_ids [N]. Launches device work only.
    """
    vocab = logprobs.shape[-1]
    counts = [vocab if n < 0 else min(n, vocab) for n in num_top]
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    ranks = (logprobs > chosen).sum(-1) + 1
    k = max(counts)
    if k > 0:
        top_values, top_ids = logprobs.topk(k, dim=-1)
    else:
        top_values, top_ids = logprobs[:, :0], token_ids[:, None][:, :0]
    return LogprobTensors(token_ids, chosen.squeeze(1), ranks, top_values, top_ids, counts)
