"""Deterministic random weights, for speed runs of shapes whose weights we do not have."""

from __future__ import annotations

import torch
from torch import nn

#: Small, as vLLM's dummy weights: activations stay finite through any depth in fp16.
DUMMY_RANGE = 1e-3

#: The largest e4m3 value: FP8 weights are drawn over their whole range, their scales (a
#: parameter's ``dummy_value``) bring them back to ±DUMMY_RANGE.
_FP8_MAX = 448.0


def load_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter with uniform values in ±DUMMY_RANGE: the same for the same seed and
    device (drawn on the parameters' device, so a large model fills fast). A parameter with a
    ``dummy_value`` (a quantization scale) is filled with that value; an FP8 one with values
    drawn over the format's range."""
    generator = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    for param in model.parameters():
        if hasattr(param, "dummy_value"):
            param.data.fill_(param.dummy_value)
        elif param.dtype.itemsize == 1 and param.dtype.is_floating_point:
            values = torch.empty(param.shape, device=param.device, dtype=torch.float32)
            values.uniform_(-_FP8_MAX, _FP8_MAX, generator=generator)
            param.data.copy_(values.to(param.dtype))
        else:
            param.data.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=generator)
