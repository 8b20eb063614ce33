"""Offline measurement of an EAGLE-3 head: greedy speculative decoding with the target in
transformers, k drafts a step, counting how many the target accepts.

Each step runs the target over the whole sequence (no KV cache): slow but exact, and what is
measured (acceptance) does not depend on speed. The output is the target's own greedy text by
construction; ``check_against`` compares it with plain greedy decoding all the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvik.spec_decode.eagle3 import Eagle3Head
from kvik.spec_decode.metrics import SpecDecodingStats


@torch.no_grad()
def target_features(target, token_ids: Tensor, aux_layer_ids: list[int]) -> tuple[Tensor, Tensor]:
    """One target pass over token_ids [B, T]: (greedy next tokens [B, T], the aux layers' hidden
    states concatenated [B, T, 3 * hidden])."""
    out = target(input_ids=token_ids, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1)
    return out.logits.argmax(-1), aux


@dataclass
class SpeculativeRun:
    output_ids: list[int]
    stats: SpecDecodingStats


@torch.no_grad()
def speculative_greedy(
    target, head: Eagle3Head, prompt_ids: list[int], k: int, max_new_tokens: int
) -> SpeculativeRun:
    """Greedy decoding of one prompt with the head's k drafts verified by the target."""
    aux_ids = head.config.eagle_aux_hidden_state_layer_ids
    if aux_ids is None:
        raise ValueError("the head's config names no eagle_aux_hidden_state_layer_ids")
    stats = SpecDecodingStats(num_spec_tokens=k)
    sequence = list(prompt_ids)
    drafts: list[int] = []
    while len(sequence) - len(prompt_ids) < max_new_tokens:
        ids = torch.tensor([sequence + drafts])
        greedy, aux = target_features(target, ids, aux_ids)
        start = len(sequence) - 1  # the position whose prediction is the first new token
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == greedy[0, start + accepted]:
            accepted += 1
        if drafts:
            stats.observe_draft(num_draft_tokens=len(drafts), num_accepted_tokens=accepted)
        sequence += drafts[:accepted] + [int(greedy[0, start + accepted])]
        # Rows 0..n-2 of the head: token p + 1 with the target's hidden state at p; the target
        # states of the accepted tokens came from this pass, whose prefix they share.
        n = len(sequence)
        hidden = head.combine(aux[0, : n - 1].to(head.fc.weight.dtype))
        drafts = head.propose_greedy(torch.tensor(sequence[1:n]), hidden, k).tolist()
    return SpeculativeRun(sequence[len(prompt_ids) :][:max_new_tokens], stats)


@torch.no_grad()
def plain_greedy(target, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    sequence = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = target(input_ids=torch.tensor([sequence])).logits
        sequence.append(int(logits[0, -1].argmax()))
    return sequence[len(prompt_ids) :]


def evaluate_acceptance(
    target,
    head: Eagle3Head,
    prompts: list[list[int]],
    k: int = 3,
    max_new_tokens: int = 48,
    check_against_plain: int = 0,
) -> SpecDecodingStats:
    """Acceptance over held-out prompts (token ids). ``check_against_plain``: for that many
    prompts, also decode plainly and raise if the outputs differ (they must not)."""
    total = SpecDecodingStats(num_spec_tokens=k)
    for i, prompt in enumerate(prompts):
        run = speculative_greedy(target, head, prompt, k, max_new_tokens)
        total.merge(run.stats)
        if i < check_against_plain:
            plain = plain_greedy(target, prompt, max_new_tokens)
            if plain != run.output_ids:
                raise AssertionError(
                    f"prompt {i}: speculative output differs from plain greedy decoding"
                )
    return total
