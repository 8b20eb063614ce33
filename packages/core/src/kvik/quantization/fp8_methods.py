"""The FP8 linear methods every FP8 format builds on.

- ``Fp8BlockLinearMethod``: e4m3 weights with one fp32 scale per 128 x 128 tile, activations
  quantized per token in groups of 128 (scheme ``fp8_block``).
- ``Fp8ScaledLinearMethod``: e4m3 weights with one scale per tensor or per output channel;
  activations with a static per-tensor scale from the checkpoint or dynamic per-token scales
  (scheme ``fp8_scaled``).
- ``OnlineFp8LinearMethod``: loads the checkpoint's unquantized weights and quantizes them per
  output channel after loading; dynamic per-token activations (scheme ``fp8_scaled``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from kvik.model_loader.dummy import DUMMY_RANGE
from kvik.quantization.base import LinearMethod
from kvik.quantization.fp8_reference import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    dynamic_scale,
    quantize_fp8,
)
from kvik.quantization.kernels import FP8_BLOCK, FP8_SCALED
from kvik.quantization.parameters import new_parameter, row_loader, shard_scalar_loader

if TYPE_CHECKING:
    from kvik.layers.linear import Linear
    from kvik.platforms.base import Platform

#: Dummy (random-weight) scales: e4m3 values of up to 448 times this are DUMMY_RANGE at most,
#: the range of the unquantized dummy weights.
DUMMY_SCALE = DUMMY_RANGE / FP8_MAX


def _fp8_weight(layer: Linear) -> nn.Parameter:
    return new_parameter((layer.out_features, layer.in_features), FP8_DTYPE, row_loader(layer))


def _replace(layer: nn.Module, name: str, data: torch.Tensor) -> None:
    """Set parameter ``name`` to ``data`` (a new tensor: its dtype or shape may differ)."""
    setattr(layer, name, nn.Parameter(data, requires_grad=False))


def _check_blocks_split(layer: Linear) -> None:
    """Under tensor parallelism a rank's part must be whole 128 x 128 blocks, so that its block
    scales are a slice of the checkpoint's (vLLM's rule too)."""
    if layer.tp_dim is None or layer.tp_size == 1:
        return
    if layer.tp_dim == 0:
        parts = {s: size for s, (_, size) in layer.shards.items()} or {None: layer.out_features}
        what = "output rows"
    else:
        parts, what = {None: layer.in_features}, "input columns"
    for shard_id, size in parts.items():
        if size % BLOCK:
            shard = "" if shard_id is None else f" of shard {shard_id!r}"
            raise ValueError(
                f"{layer.prefix or 'a layer'}: each of {layer.tp_size} tensor-parallel ranks holds "
                f"{size} {what}{shard}, not a multiple of the FP8 weight block size {BLOCK}, so "
                "the block scales cannot be split with the weights; use fewer ranks"
            )


class Fp8BlockLinearMethod(LinearMethod):
    """Checkpoint tensors ``weight`` (e4m3 [N, K]) and ``<scale_name>`` (fp32
    [ceil(N/128), ceil(K/128)]); after loading the scales are the layer's ``weight_scale``."""

    scheme = FP8_BLOCK

    def __init__(self, scale_name: str = "weight_scale_inv") -> None:
        super().__init__()
        self.scale_name = scale_name

    def create_weights(self, layer: Linear, params_dtype: torch.dtype) -> None:
        # A fused layer stacks its shards' scale rows as it stacks their weight rows: that holds
        # only when each shard covers whole 128-row tiles.
        if len(layer.shards) > 1:
            for shard_id, (_, size) in layer.shards.items():
                if size % BLOCK:
                    raise ValueError(
                        f"{layer.prefix or 'a fused layer'}: shard {shard_id!r} has {size} rows, "
                        f"not a multiple of the {BLOCK}-row weight blocks, so its block scales "
                        "cannot be stacked with the other shards'"
                    )
        _check_blocks_split(layer)
        layer.weight = _fp8_weight(layer)
        tiles = (-(-layer.out_features // BLOCK), -(-layer.in_features // BLOCK))
        scale = new_parameter(tiles, torch.float32, row_loader(layer, BLOCK), DUMMY_SCALE)
        setattr(layer, self.scale_name, scale)

    def process_weights_after_loading(self, layer: nn.Module, platform: type[Platform]) -> None:
        if self.scale_name != "weight_scale":
            scale = getattr(layer, self.scale_name)
            delattr(layer, self.scale_name)
            _replace(layer, "weight_scale", scale.data)
        self.use_platform_kernel(layer, platform)


class Fp8ScaledLinearMethod(LinearMethod):
    """Checkpoint tensors ``weight`` (e4m3 [N, K]), ``weight_scale`` ([] or [1] per tensor, or
    [N] or [N, 1] per channel) and, for static activations, ``input_scale`` ([] or [1])."""

    scheme = FP8_SCALED

    def __init__(self, weight_strategy: Literal["tensor", "channel"], static_input: bool) -> None:
        super().__init__()
        if weight_strategy not in ("tensor", "channel"):
            raise ValueError(
                f"FP8 weight scales are per 'tensor' or 'channel', not {weight_strategy!r}"
            )
        self.weight_strategy = weight_strategy
        self.static_input = static_input

    def create_weights(self, layer: Linear, params_dtype: torch.dtype) -> None:
        layer.weight = _fp8_weight(layer)
        shards = max(1, len(layer.shards))
        if self.weight_strategy == "channel":
            layer.weight_scale = new_parameter(
                (layer.out_features,), torch.float32, row_loader(layer), DUMMY_SCALE
            )
        else:
            layer.weight_scale = new_parameter(
                (shards,), torch.float32, shard_scalar_loader(layer), DUMMY_SCALE
            )
        if self.static_input:
            layer.input_scale = new_parameter(
                (shards,), torch.float32, shard_scalar_loader(layer), 1 / FP8_MAX
            )

    def process_weights_after_loading(self, layer: nn.Module, platform: type[Platform]) -> None:
        scale = layer.weight_scale.data
        if self.weight_strategy == "tensor" and scale.numel() > 1:
            if bool((scale == scale[0]).all()):
                _replace(layer, "weight_scale", scale[:1].clone())
            else:
                # Fused shards with their own per-tensor scales: each shard's scale repeated over
                # its rows, as per-channel scales. Exact, where requantizing every shard to the
                # largest scale (vLLM's choice, which keeps one scale) rounds the weights again.
                rows = torch.tensor([size for _, size in layer.shards.values()])
                _replace(layer, "weight_scale", scale.repeat_interleave(rows.to(scale.device)))
        if self.static_input and layer.input_scale.numel() > 1:
            # One activation feeds every shard; the largest scale clips none of them.
            _replace(layer, "input_scale", layer.input_scale.data.max().reshape(1))
        self.use_platform_kernel(layer, platform)


class OnlineFp8LinearMethod(LinearMethod):
    """``--quantization fp8`` of an unquantized checkpoint: the weight loads in the model's dtype
    and is quantized after loading, one scale per output channel (the largest magnitude of its
    row over 448); activations get dynamic per-token scales."""

    scheme = FP8_SCALED

    def create_weights(self, layer: Linear, params_dtype: torch.dtype) -> None:
        layer.weight = new_parameter(
            (layer.out_features, layer.in_features), params_dtype, row_loader(layer)
        )

    def process_weights_after_loading(self, layer: nn.Module, platform: type[Platform]) -> None:
        weight = layer.weight.data
        scale = dynamic_scale(weight.float().abs().amax(dim=1))  # [N]
        _replace(layer, "weight", quantize_fp8(weight, scale[:, None]))
        _replace(layer, "weight_scale", scale)
        self.use_platform_kernel(layer, platform)
