"""Deterministic random weights, for speed runs of shapes whose weights we do not have."""

from __future__ import annotations

import torch
from torch import nn

#: Small, as vLLM's dummy weights: activations stay finite through any depth in fp16.
DUMMY_RANGE = 1e-3


def load_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter with uniform values in ±DUMMY_RANGE: the same for the same seed and
    device (drawn on the parameters' device, so a large model fills fast)."""
    generator = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    for param in model.parameters():
        param.data.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=generator)
