"""Parameters created by linear methods, each with the ``weight_loader`` that writes checkpoint
tensors into it.

A loader is called as ``weight_loader(param, loaded, shard_id)``: ``shard_id`` is None for a
checkpoint tensor that covers the whole layer, or the id of one shard of a fused layer (q/k/v,
gate/up: ``Linear.shards``). Two layouts cover every tensor so far:

- ``row_loader``: dim 0 follows the layer's output rows, ``rows_per_entry`` rows to one entry
  (weights, biases and per-channel scales: 1; block scales: 128). A shard lands at its rows.
- ``shard_scalar_loader``: one value per shard (per-tensor scales), ``[number of shards]``.

Under tensor parallelism (kvik.layers.linear) a layer holds one rank's part: the loaders narrow
``loaded`` to it before the same writes, along dim 0 for a column-parallel layer (the output rows)
and dim 1 for a row-parallel one (the input columns; tensors without a dim 1, such as per-channel
scales and biases, are whole on every rank). ``loaded`` may be a ``CheckpointSlice``
(kvik.model_loader.weight_slice), of which only this rank's part is read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from kvik.model_loader.weight_slice import CheckpointSlice, materialize, narrow

if TYPE_CHECKING:
    from kvik.layers.linear import Linear

WeightLoader = Callable[[Tensor, "Tensor | CheckpointSlice", "int | str | None"], None]


def default_weight_loader(
    param: Tensor, loaded: Tensor | CheckpointSlice, shard_id: int | str | None = None
) -> None:
    """Copy a checkpoint tensor into a parameter (or a shard's view of one), cast to its dtype.
    Parameters without a ``weight_loader`` of their own load with this one (never sharded)."""
    loaded = materialize(loaded)
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint shape {tuple(loaded.shape)} != parameter {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


#: The dtypes a checkpoint tensor may be cast between as it loads (the same numbers, rounded).
PLAIN_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_dtype(param: Tensor, loaded: Tensor | CheckpointSlice) -> None:
    """Refuse a checkpoint tensor that the copy into ``param`` would cast to other numbers:
    integers, booleans or FP8 (values that mean something only with their scales) into a
    floating-point parameter, anything but its own FP8 dtype into an FP8 one. Integer parameters
    are their method's business."""
    if param.dtype in PLAIN_FLOATS:
        if loaded.dtype in PLAIN_FLOATS:
            return
        hint = (
            " (FP8 weights need their scales: a checkpoint quantized without config.json's "
            "quantization_config, or a layer its ignore list leaves unquantized)"
            if loaded.dtype.is_floating_point
            else ""
        )
    elif param.dtype.is_floating_point:  # FP8
        if loaded.dtype == param.dtype:
            return
        hint = " (the quantization_config says this layer is FP8)"
    else:
        return
    raise ValueError(f"checkpoint dtype {loaded.dtype} where the parameter is {param.dtype}{hint}")


def new_parameter(
    shape: tuple[int, ...] | list[int],
    dtype: torch.dtype,
    loader: WeightLoader,
    dummy_value: float | None = None,
) -> nn.Parameter:
    """An uninitialised parameter (on the current default device) with its loader.
    ``dummy_value``: what random-weight loading (kvik.model_loader.dummy) fills it with instead of
    random values (scales must be positive and fit their weights)."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    if dummy_value is not None:
        param.dummy_value = dummy_value
    return param


def shard_index(layer: Linear, shard_id: int | str) -> int:
    if shard_id not in layer.shards:
        raise ValueError(f"layer has no shard {shard_id!r} (its shards: {list(layer.shards)})")
    return list(layer.shards).index(shard_id)


def rank_part(
    layer: Linear,
    loaded: Tensor | CheckpointSlice,
    shard_id: int | str | None,
    target: Tensor,
    per_entry: int = 1,
) -> Tensor:
    """This rank's part of a checkpoint tensor (of the whole layer, or of shard ``shard_id``)
    that fills ``target``: ``target``'s length along the layer's split dim, from the rank's first
    row or column (``layer.tp_start``), ``per_entry`` of them to an entry (block scales: 128)."""
    dim = layer.tp_dim
    if dim is None or dim >= target.dim():
        return materialize(loaded)  # replicated, or whole on every rank (a row-parallel bias)
    length = layer.tp_length(shard_id)
    if length is not None and loaded.shape[dim] != -(-length // per_entry):
        # A larger tensor would have its first rows (or columns) read and the rest ignored.
        raise ValueError(
            f"checkpoint shape {tuple(loaded.shape)} has {loaded.shape[dim]} along dim {dim}, "
            f"where {layer.prefix or 'the layer'} takes {-(-length // per_entry)}"
        )
    start = layer.tp_start(shard_id)
    if start % per_entry:
        raise ValueError(
            f"{layer.prefix or 'a layer'}: rank {layer.tp_rank}'s part starts at {start} along "
            f"dim {dim}, inside a block of {per_entry}: the block scales cannot be split between "
            f"{layer.tp_size} ranks"
        )
    return narrow(loaded, dim, start // per_entry, target.shape[dim])


def row_loader(layer: Linear, rows_per_entry: int = 1) -> WeightLoader:
    """Loads tensors whose dim 0 follows the layer's output rows, ``rows_per_entry`` to an entry
    (the last entry of a layer may cover fewer). A shard must start and, unless it is the
    layer's last, end on an entry boundary (the methods check this when they build a layer).
    Block scales have ``rows_per_entry`` columns to an entry too (square blocks), which is what a
    row-parallel layer narrows them by."""

    def load(param: Tensor, loaded: Tensor | CheckpointSlice, shard_id: int | str | None = None):
        target = param.data
        if shard_id is not None:
            shard_index(layer, shard_id)
            offset, size = layer.shards[shard_id]
            target = target.narrow(0, offset // rows_per_entry, -(-size // rows_per_entry))
        loaded = rank_part(layer, loaded, shard_id, target, rows_per_entry)
        if loaded.dim() == target.dim() + 1 and loaded.shape[-1] == 1:
            loaded = loaded.squeeze(-1)  # per-channel scales stored as [N, 1]
        default_weight_loader(target, loaded)

    return load


def shard_scalar_loader(layer: Linear) -> WeightLoader:
    """Loads one value per shard (a per-tensor scale, stored as ``[]`` or ``[1]``) into entry
    ``shard index`` of a ``[max(1, number of shards)]`` parameter."""

    def load(param: Tensor, loaded: Tensor | CheckpointSlice, shard_id: int | str | None = None):
        loaded = materialize(loaded)
        if loaded.numel() != 1:
            raise ValueError(f"expected one per-tensor scale, got shape {tuple(loaded.shape)}")
        index = 0 if shard_id is None else shard_index(layer, shard_id)
        if shard_id is None and param.numel() != 1:
            raise ValueError(
                f"a fused layer of {param.numel()} shards takes one scale per shard, "
                "not one for the whole layer"
            )
        param.data[index] = loaded.reshape(()).to(param.dtype)

    return load
