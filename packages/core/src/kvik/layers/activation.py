"""Activations of gated MLPs."""

from __future__ import annotations

from torch import Tensor, nn

from kvik import ops


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._silu_and_mul = ops.small_op("silu_and_mul")

    def forward(self, x: Tensor) -> Tensor:
        # [T, 2*I] (gate, up) -> [T, I]
        return self._silu_and_mul(x)
