"""RMSNorm, with the residual add fused in when a residual is passed."""

from __future__ import annotations

import torch
from torch import Tensor, nn

import kvik.ops  # noqa: F401  (defines torch.ops.kvik.*)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """norm(x), or with a residual (norm(x + residual), x + residual)."""
        if residual is None:
            return torch.ops.kvik.rms_norm(x, self.weight, self.eps)
        return torch.ops.kvik.fused_add_rms_norm(x, residual, self.weight, self.eps)
