"""Linear layers whose parameters come from their quantization method, split between
tensor-parallel ranks.

Checkpoints store q/k/v and gate/up as separate matrices; kvik packs each group into one matmul,
and the packed layer's loaders write every checkpoint shard into its rows. Every matmul of a model
goes through ``Linear.forward``, which calls the layer's ``quant_method``
(kvik.quantization): the method chosen for this layer as it is built (by the model's
``QuantizationConfig``, from its name ``prefix``; unquantized without one) creates the parameters,
processes them after loading and computes the product with the kernel its platform gives.

Tensor parallelism (the group ``kvik.distributed.parallel_state.get_tp_group()``, of one rank
when no world was joined) splits the layers as Megatron-LM and vLLM do:

- ``ColumnParallelLinear`` (and the packed ``MergedColumnLinear``, ``QKVLinear``): each rank holds
  a slice of the output rows and computes its slice of the output, no communication. A packed
  layer slices every shard, so a rank's rows are its part of gate then its part of up (q, k, v).
- ``RowParallelLinear``: each rank holds a slice of the input columns, reads the matching slice
  of its input (a column-parallel layer's output) and the partial products are summed by an
  all-reduce. Its bias is added once, by rank 0.
- ``Linear``: whole on every rank.

Each layer's sizes (``in_features``, ``out_features``, ``shards``) are this rank's; the loaders
(kvik.quantization.parameters) cut the checkpoint's tensors to them with ``tp_dim`` and
``tp_start``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn

from kvik.distributed.parallel_state import get_tp_group
from kvik.quantization.parameters import default_weight_loader, new_parameter, row_loader
from kvik.quantization.unquantized import UnquantizedLinearMethod

if TYPE_CHECKING:
    from kvik.quantization.activation import QuantizedActivation
    from kvik.quantization.base import QuantizationConfig

__all__ = [
    "ColumnParallelLinear",
    "Linear",
    "MergedColumnLinear",
    "QKVLinear",
    "RowParallelLinear",
    "default_weight_loader",
    "divide",
]


def divide(total: int, parts: int, what: str) -> int:
    """``total / parts``, or an error naming ``what`` does not split between the ranks."""
    if total % parts:
        raise ValueError(
            f"{what}: {total} do not split between {parts} tensor-parallel ranks "
            f"({total} is not a multiple of {parts})"
        )
    return total // parts


class Linear(nn.Module):
    """y = x W^T + b, computed by ``quant_method``; whole on every rank.

    ``shards`` maps a fused layer's shard ids to their (row offset, rows); a plain layer has none.
    ``prefix`` is the layer's module name in the model (``model.layers.0.mlp.down_proj``): the
    quantization config reads its ignore list by it. ``tp_starts`` (parallel layers): where this
    rank's part begins along ``tp_dim`` in the checkpoint tensor of each shard (key None: of a
    layer that is not fused); ``tp_lengths``: that tensor's whole length along ``tp_dim`` (the
    loaders refuse a checkpoint tensor of another length instead of reading a part of it).
    """

    #: The dim of the checkpoint's weight that is split between ranks: 0 (the output rows,
    #: column-parallel), 1 (the input columns, row-parallel) or None (whole on every rank).
    tp_dim: ClassVar[int | None] = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        shard_sizes: dict[int | str, int] | None = None,
        tp_starts: dict[int | str | None, int] | None = None,
        tp_lengths: dict[int | str | None, int] | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.prefix = prefix
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self._tp_starts = tp_starts or {}
        self._tp_lengths = tp_lengths or {}
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

    def tp_start(self, shard_id: int | str | None) -> int:
        """Where this rank's part of shard ``shard_id`` (None: the whole layer) begins along
        ``tp_dim`` in the checkpoint's tensor."""
        return self._tp_starts.get(shard_id, 0)

    def tp_length(self, shard_id: int | str | None) -> int | None:
        """The whole length along ``tp_dim`` of the checkpoint's tensor of shard ``shard_id``
        (None: of the whole layer), or None where it is not known."""
        return self._tp_lengths.get(shard_id)

    def forward(self, x: Tensor) -> Tensor:
        return self.quant_method.apply(self, x)

    def extra_repr(self) -> str:
        parallel = (
            f", tp_dim={self.tp_dim}, tp_size={self.tp_size}" if self.tp_dim is not None else ""
        )
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}{parallel}, quant_method={self.quant_method!r}"
        )


class ColumnParallelLinear(Linear):
    """Each rank computes ``out_features / tp`` of the outputs, from its slice of the rows."""

    tp_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        tp = get_tp_group()
        rows = divide(out_features, tp.world_size, f"{prefix or 'a layer'}: output features")
        super().__init__(
            in_features,
            rows,
            bias,
            quant_config=quant_config,
            prefix=prefix,
            tp_starts={None: tp.rank_in_group * rows},
            tp_lengths={None: out_features},
        )


class RowParallelLinear(Linear):
    """Each rank multiplies its slice of the input (``in_features / tp`` columns, the output of a
    column-parallel layer) by its columns of the weight; an all-reduce sums the ranks' products."""

    tp_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        tp = get_tp_group()
        columns = divide(in_features, tp.world_size, f"{prefix or 'a layer'}: input features")
        super().__init__(
            columns,
            out_features,
            bias,
            quant_config=quant_config,
            prefix=prefix,
            tp_starts={None: tp.rank_in_group * columns},
            tp_lengths={None: in_features},
        )
        if self.bias is not None and self.tp_rank != 0:
            # The bias is added before the sum, so only rank 0 holds it; the others hold zeros
            # (also under random weights).
            self.bias.weight_loader = _zero_loader
            self.bias.dummy_value = 0.0

    def forward(self, x: Tensor) -> Tensor:
        return get_tp_group().all_reduce(self.quant_method.apply(self, x))


def _zero_loader(param: Tensor, loaded: object, shard_id: int | str | None = None) -> None:
    param.data.zero_()


class MergedColumnLinear(ColumnParallelLinear):
    """Several projections of the same input stacked by rows; shard i is ``out_sizes[i]`` rows
    (``out_sizes[i] / tp`` on each rank: each projection is split, then stacked)."""

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        bias: bool = False,
        *,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        tp = get_tp_group()
        sizes = [
            divide(size, tp.world_size, f"{prefix or 'a layer'}: rows of shard {i}")
            for i, size in enumerate(out_sizes)
        ]
        Linear.__init__(
            self,
            in_features,
            sum(sizes),
            bias,
            quant_config=quant_config,
            prefix=prefix,
            shard_sizes=dict(enumerate(sizes)),
            tp_starts={i: tp.rank_in_group * size for i, size in enumerate(sizes)},
            tp_lengths={None: sum(out_sizes), **dict(enumerate(out_sizes))},
        )

    def silu_and_mul_quantized(self, x: QuantizedActivation) -> QuantizedActivation | None:
        """For a gate/up layer (two shards of equal rows) on quantized input: silu(gate) * up,
        quantized for the down projection (kvik.quantization.activation), computed by the
        kernel's one op; None where the layer is not such a pair or its kernel has no such op."""
        sizes = [size for _, size in self.shards.values()]
        if len(sizes) != 2 or sizes[0] != sizes[1]:
            return None
        return self.quant_method.kernel.apply_silu_and_mul(self, x)


def heads_per_rank(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) of one of ``tp_size`` ranks. The query heads are split; so are the
    KV heads where there are at least as many as ranks, else each KV head is replicated on
    ``tp_size / num_kv_heads`` ranks (vLLM's rule), one per rank."""
    if num_heads % tp_size:
        raise ValueError(
            f"{num_heads} attention heads do not split between {tp_size} tensor-parallel ranks "
            f"({num_heads} is not a multiple of {tp_size})"
        )
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(
                f"{num_kv_heads} KV heads do not split between {tp_size} tensor-parallel ranks "
                f"({num_kv_heads} is not a multiple of {tp_size})"
            )
        return num_heads // tp_size, num_kv_heads // tp_size
    if tp_size % num_kv_heads:
        raise ValueError(
            f"{num_kv_heads} KV heads cannot be replicated evenly over {tp_size} tensor-parallel "
            f"ranks ({tp_size} is not a multiple of {num_kv_heads})"
        )
    return num_heads // tp_size, 1


class QKVLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul: shards "q", "k", "v". On each rank, its query heads
    and its KV heads (``heads_per_rank``): ``num_heads`` and ``num_kv_heads`` are this rank's."""

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
        tp = get_tp_group()
        heads, kv_heads = heads_per_rank(num_heads, num_kv_heads, tp.world_size)
        q_size, kv_size = heads * head_size, kv_heads * head_size
        # Which block of KV heads this rank holds: its own, or with replication the one it shares
        # with the tp / num_kv_heads ranks around it.
        kv_block = (
            tp.rank_in_group * num_kv_heads // tp.world_size
            if num_kv_heads < tp.world_size
            else tp.rank_in_group
        )
        Linear.__init__(
            self,
            hidden_size,
            q_size + 2 * kv_size,
            bias,
            quant_config=quant_config,
            prefix=prefix,
            shard_sizes={"q": q_size, "k": kv_size, "v": kv_size},
            tp_starts={
                "q": tp.rank_in_group * q_size,
                "k": kv_block * kv_size,
                "v": kv_block * kv_size,
            },
            tp_lengths={
                None: (num_heads + 2 * num_kv_heads) * head_size,
                "q": num_heads * head_size,
                "k": num_kv_heads * head_size,
                "v": num_kv_heads * head_size,
            },
        )
        self.num_heads, self.num_kv_heads = heads, kv_heads
        self.q_size, self.kv_size = q_size, kv_size
