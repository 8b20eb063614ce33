"""RMSNorm, with the residual add fused in when a residual is passed."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvik import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self._rms_norm = ops.small_op("rms_norm")
        self._fused_add_rms_norm = ops.small_op("fused_add_rms_norm")

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """norm(x), or with a residual (norm(x + residual), x + residual)."""
        if residual is None:
            return self._rms_norm(x, self.weight, self.eps)
        return self._fused_add_rms_norm(x, residual, self.weight, self.eps)
