"""Activations of gated MLPs."""

from __future__ import annotations

import torch
from torch import Tensor, nn

import kvik.ops  # noqa: F401  (defines torch.ops.kvik.*)


class SiluAndMul(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        # [T, 2*I] (gate, up) -> [T, I]
        return torch.ops.kvik.silu_and_mul(x)
