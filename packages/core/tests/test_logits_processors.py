"""Logits processors keep a row samplable, whatever the request's (valid) parameters."""

from __future__ import annotations

import pytest
import torch

from kvik.layers.logits_processors import RepetitionPenaltyLogitsProcessor
from kvik.layers.sampler import Sampler, SamplingBatch


@pytest.mark.parametrize("penalty", [1e-308, 1e-40, 1e-37, 1e39, 1e308])
def test_extreme_repetition_penalties_sample_no_nan(penalty):
    """1e-308 is 0 in fp32: seen positive logits became inf, the row's softmax NaN, and the
    sampler returned token 0 every step (a server answered '<unk><unk>...' with a 200)."""
    logits = torch.tensor([[-1.0, 4.0, 3.0, 0.0, -2.0, 1.0]])
    seen = [1, 2, 3, 4]
    processor = RepetitionPenaltyLogitsProcessor(penalty, seen)
    row = processor([], logits[0].clone())
    assert not row.isnan().any(), row
    batch = SamplingBatch(
        temperature=torch.tensor([1e-5]),
        top_k=torch.tensor([0]),
        top_p=torch.tensor([1.0]),
        min_p=torch.tensor([0.0]),
        use_top_k=False,
        use_top_p=False,
        use_min_p=False,
        processors=[(0, [processor], [])],
    )
    token = Sampler(torch.Generator().manual_seed(0))(logits.clone(), batch).item()
    # A tiny penalty favours the seen tokens with positive logits; a huge one the unseen.
    assert token in ({1, 2} if penalty < 1 else {0, 5})


def test_ordinary_repetition_penalties_are_unchanged():
    logits = torch.tensor([-1.0, 4.0, 3.0, 0.0])
    row = RepetitionPenaltyLogitsProcessor(2.0, [0, 1])([3], logits.clone())
    assert row.tolist() == [-2.0, 2.0, 3.0, 0.0]
