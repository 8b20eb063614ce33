"""Linear layers whose parameters come from their quantization method.

Checkpoints store q/k/v and gate/up as separate matrices; kvik packs each group into one matmul,
and the packed layer's loaders write every checkpoint shard into its rows. Every matmul of a model
goes through ``Linear.forward``, which calls the layer's ``quant_method``
(kvik.quantization): the method chosen for this layer as it is built (by the model's
``QuantizationConfig``, from its name ``prefix``; unquantized without one) creates the parameters,
processes them after loading and computes the product with the kernel its platform gives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from kvik.quantization.parameters import default_weight_loader, new_parameter, row_loader
from kvik.quantization.unquantized import UnquantizedLinearMethod

if TYPE_CHECKING:
    from kvik.quantization.base import QuantizationConfig

__all__ = ["Linear", "MergedColumnLinear", "QKVLinear", "default_weight_loader"]


class Linear(nn.Module):
    """y = x W^T + b, computed by ``quant_method``.

    ``shards`` maps a fused layer's shard ids to their (row offset, rows); a plain layer has none.
    ``prefix`` is the layer's module name in the model (``model.layers.0.mlp.down_proj``): the
    quantization config reads its ignore list by it.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        shard_sizes: dict[int | str, int] | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.prefix = prefix
        self.shards: dict[int | str, tuple[int, int]] = {}
        if shard_sizes:
            offset = 0
            for shard_id, size in shard_sizes.items():
                self.shards[shard_id] = (offset, size)
                offset += size
            if offset != out_features:
                raise ValueError(f"shard sizes {shard_sizes} do not add up to {out_features} rows")
        self.quant_method = (
            UnquantizedLinearMethod()
            if quant_config is None
            else quant_config.get_linear_method(self, prefix)
        )
        self.quant_method.create_weights(self, torch.get_default_dtype())
        self.bias = (
            new_parameter((out_features,), torch.get_default_dtype(), row_loader(self))
            if bias
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.quant_method.apply(self, x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, quant_method={self.quant_method!r}"
        )


class MergedColumnLinear(Linear):
    """Several projections of the same input stacked by rows; shard i is ``out_sizes[i]`` rows."""

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        bias: bool = False,
        *,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(
            in_features,
            sum(out_sizes),
            bias,
            quant_config=quant_config,
            prefix=prefix,
            shard_sizes=dict(enumerate(out_sizes)),
        )


class QKVLinear(Linear):
    """q, k and v projections in one matmul: shards "q", "k", "v"."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        *,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
        super().__init__(
            hidden_size,
            q_size + 2 * kv_size,
            bias,
            quant_config=quant_config,
            prefix=prefix,
            shard_sizes={"q": q_size, "k": kv_size, "v": kv_size},
        )
