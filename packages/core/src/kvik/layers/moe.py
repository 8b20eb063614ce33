"""A sparse mixture of gated SiLU experts, its weights stacked over the experts.

``FusedMoE`` holds every expert's gate and up projections as one ``gate_up_proj`` [E, 2I, H] (gate
rows first) and the down projections as ``down_proj`` [E, H, I], the names and orientation
transformers 5 gives its stacked experts, so such a checkpoint loads as it is. Checkpoints with a
tensor per expert (``experts.N.gate_proj.weight`` ..., Mixtral's ``experts.N.w1/w2/w3``) load into
the same stacks through the parameters' loaders, with shard ids ``(expert, "gate" | "up")`` and
``expert`` (``expert_shard``); so do a block-FP8 checkpoint's per-expert
``experts.N.gate_proj.weight_scale_inv`` into ``gate_up_proj_scale`` (and down's likewise).

Which parameters the layer has, and how it computes, is its quantization method's
(``quant_method``, kvik.quantization.moe_methods), chosen as the layer is built from the model's
quantization config the way a linear layer's is: unquantized, the layer computes through one op,
``kvik::fused_moe`` (kvik.ops: routing and experts from the router's logits), whose kernels the
platforms register; a platform may instead give an unquantized layer a ``kernel`` after loading
(the CPU's packed per-expert weights, kvik_cpu.moe).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from kvik.quantization.moe_methods import MoeMethod, UnquantizedMoeMethod, expert_loader

if TYPE_CHECKING:
    from kvik.quantization.base import QuantizationConfig

#: A checkpoint's per-expert tensor: "<prefix>.experts.<N>.<projection>.<tensor>", where the
#: projection is transformers' (gate_proj, up_proj, down_proj) or Mixtral's (w1, w3, w2) and the
#: tensor its weight or, in block FP8, its block scales (``weight_scale_inv``).
_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<tensor>weight|weight_scale_inv)$"
)
_PROJECTIONS = {
    "gate_proj": ("gate_up_proj", "gate"),
    "w1": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    "w3": ("gate_up_proj", "up"),
    "down_proj": ("down_proj", None),
    "w2": ("down_proj", None),
}
#: The stacked parameter of each per-expert tensor kind.
_TENSOR_SUFFIX = {"weight": "", "weight_scale_inv": "_scale"}
#: The checkpoint's per-expert projections, as transformers names them (ignore lists use these).
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def expert_shard(name: str) -> tuple[str, tuple[int, str] | int] | None:
    """A per-expert checkpoint name -> (the stacked parameter's name, its shard id), or None when
    ``name`` is not one. ``model.layers.0.mlp.experts.7.up_proj.weight`` ->
    ``("model.layers.0.mlp.experts.gate_up_proj", (7, "up"))``;
    ``...experts.7.down_proj.weight_scale_inv`` -> ``("...experts.down_proj_scale", 7)``."""
    match = _PER_EXPERT.match(name)
    if match is None or match["proj"] not in _PROJECTIONS:
        return None
    target, half = _PROJECTIONS[match["proj"]]
    expert = int(match["expert"])
    target += _TENSOR_SUFFIX[match["tensor"]]
    return f"{match['prefix']}.{target}", expert if half is None else (expert, half)


def is_stacked_expert_param(name: str) -> bool:
    """Whether ``name`` is one of a FusedMoE's stacked parameters (weights or scales)."""
    parent, _, leaf = name.rpartition(".")
    return parent.endswith("experts") and leaf.startswith(("gate_up_proj", "down_proj"))


class FusedMoE(nn.Module):
    """Experts [E] of intermediate size I over hidden size H, ``top_k`` of them per token.
    ``quant_config`` and ``prefix`` (the layer's module name, ``model.layers.0.mlp.experts``)
    choose its quantization method, as for a linear layer."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        *,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}] experts, got {top_k}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.prefix = prefix
        self.quant_method: MoeMethod = (
            UnquantizedMoeMethod()
            if quant_config is None
            else quant_config.get_moe_method(self, prefix)
        )
        self.quant_method.create_weights(self, torch.get_default_dtype())
        #: Set by a platform after loading: computes the layer instead of the method (same
        #: arguments); only an unquantized layer's weights are packed this way.
        self.kernel: Callable[[Tensor, Tensor], Tensor] | None = None

    def weight_loader(
        self, param: Tensor, loaded: Tensor, shard_id: tuple[int, str] | int | None = None
    ) -> None:
        """Loads a stacked weight whole (shard None), or one expert's tensor: ``(expert, "gate" |
        "up")`` of gate_up_proj, ``expert`` of down_proj."""
        expert_loader(self)(param, loaded, shard_id)

    def forward(self, hidden: Tensor, router_logits: Tensor) -> Tensor:
        # hidden [T, H], router_logits [T, E] -> [T, H]
        if self.kernel is not None:
            return self.kernel(hidden, router_logits)
        return self.quant_method.apply(self, hidden, router_logits)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, quant_method={self.quant_method!r}"
        )
