"""How a mixture-of-experts layer (kvik.layers.moe.FusedMoE) stores, loads and computes its
experts: the MoE counterpart of ``LinearMethod``, chosen the same way as the layer is built
(``QuantizationConfig.get_moe_method``).

A ``MoeMethod`` owns one layer's stacked expert parameters:

- ``create_weights(layer, params_dtype)``: registers them, each with a loader that places one
  expert's tensor (``expert_loader``) or takes a whole stack;
- ``process_weights_after_loading(layer, platform)``: once the checkpoint is read;
- ``apply(layer, hidden, router_logits)``: the layer's output, every step.

``UnquantizedMoeMethod`` is the plain path: ``gate_up_proj`` [E, 2I, H] and ``down_proj``
[E, H, I] in the model's dtype, computed by ``kvik::fused_moe``. The block-FP8 experts are in
kvik.quantization.fp8_moe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvik import ops
from kvik.quantization.parameters import WeightLoader, default_weight_loader, new_parameter

if TYPE_CHECKING:
    from kvik.layers.moe import FusedMoE
    from kvik.model_loader.weight_slice import CheckpointSlice
    from kvik.platforms.base import Platform


def expert_loader(layer: FusedMoE, rows_per_entry: int = 1) -> WeightLoader:
    """Loads a stacked expert tensor [E, rows, ...] whole (shard None) or one expert's part:
    shard ``(expert, "gate" | "up")`` is the gate or up half of that expert's rows, ``expert``
    all of them. ``rows_per_entry`` rows of the projection to an entry (block scales: 128; the
    halves must then be whole blocks, which the method checks as the layer is built)."""

    def load(
        param: Tensor,
        loaded: Tensor | CheckpointSlice,
        shard_id: tuple[int, str] | int | None = None,
    ) -> None:
        if shard_id is None:
            default_weight_loader(param, loaded)
            return
        expert, half = shard_id if isinstance(shard_id, tuple) else (shard_id, None)
        if not 0 <= expert < layer.num_experts:
            raise ValueError(f"expert {expert} is out of range: the layer has {layer.num_experts}")
        target = param.data[expert]
        if half is not None:
            if half not in ("gate", "up"):
                raise ValueError(f"gate_up_proj's shards are 'gate' and 'up', not {half!r}")
            size = layer.intermediate_size // rows_per_entry
            target = target.narrow(0, 0 if half == "gate" else size, size)
        default_weight_loader(target, loaded)

    return load


class MoeMethod:
    """How one FusedMoE stores, loads and computes its experts (module docstring)."""

    def create_weights(self, layer: FusedMoE, params_dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: FusedMoE, platform: type[Platform]) -> None:
        """Nothing by default: the op's kernels take the tensors as loaded."""

    def apply(self, layer: FusedMoE, hidden: Tensor, router_logits: Tensor) -> Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__


class UnquantizedMoeMethod(MoeMethod):
    def create_weights(self, layer: FusedMoE, params_dtype: torch.dtype) -> None:
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
        layer.gate_up_proj = new_parameter((e, 2 * i, h), params_dtype, expert_loader(layer))
        layer.down_proj = new_parameter((e, h, i), params_dtype, expert_loader(layer))
        self._fused_moe = ops.small_op("fused_moe")

    def apply(self, layer: FusedMoE, hidden: Tensor, router_logits: Tensor) -> Tensor:
        return self._fused_moe(
            hidden,
            router_logits,
            layer.gate_up_proj,
            layer.down_proj,
            layer.top_k,
            layer.renormalize,
        )
