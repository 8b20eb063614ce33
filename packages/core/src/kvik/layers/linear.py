"""Linear layers whose parameters carry their own ``weight_loader``.

Checkpoints store q/k/v and gate/up as separate matrices; kvik packs each group into one matmul, and
the packed layer's loader writes every checkpoint shard into its rows. Quantization will hook in
here: every matmul of a model goes through ``Linear.forward``. A platform may replace the matmul
after loading by setting ``kernel`` (the CPU's prepacked oneDNN weights, kvik_cpu.linear).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def default_weight_loader(param: Tensor, loaded: Tensor, shard_id: int | str | None = None) -> None:
    """Copy a checkpoint tensor into a parameter (or a shard's view of one), cast to its dtype.
    Parameters without a ``weight_loader`` of their own load with this one (never sharded)."""
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint shape {tuple(loaded.shape)} != parameter {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


class Linear(nn.Module):
    """y = x W^T + b. ``shards`` maps a shard id to its (row offset, rows) in the packed weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.shards: dict[int | str, tuple[int, int]] = {}
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.weight.weight_loader = self.weight_loader
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader
        #: Set by a platform after loading: computes the layer's product instead of ``F.linear``.
        self.kernel: Callable[[Tensor], Tensor] | None = None

    def weight_loader(
        self, param: Tensor, loaded: Tensor, shard_id: int | str | None = None
    ) -> None:
        if shard_id is not None:
            offset, size = self.shards[shard_id]
            param = param.data.narrow(0, offset, size)
        default_weight_loader(param, loaded)

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return F.linear(x, self.weight, self.bias)


class MergedColumnLinear(Linear):
    """Several projections of the same input stacked by rows; shard i is ``out_sizes[i]`` rows."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(out_sizes), bias)
        offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.shards = dict(enumerate(zip(offsets, out_sizes, strict=True)))


class QKVLinear(MergedColumnLinear):
    """q, k and v projections in one matmul: shards "q", "k", "v"."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias)
        self.shards = dict(zip("qkv", self.shards.values(), strict=True))
