"""Block-FP8 experts: the experts of a Hugging Face fine-grained FP8 checkpoint (DeepSeek-V3,
Qwen3-30B-A3B-FP8), every expert's projections e4m3 with one fp32 scale per 128 x 128 tile
(``experts.N.gate_proj.weight`` and ``...weight_scale_inv``, multiplied despite the name), and the
activations quantized per token in groups of 128 before each of the two products, as a block-FP8
linear layer's are (kvik.quantization.fp8_reference).

After loading, the layer holds:

- ``gate_up_proj`` e4m3 [E, 2I, H] and ``gate_up_proj_scale`` fp32 [E, 2I/128, ceil(H/128)];
- ``down_proj`` e4m3 [E, H, I] and ``down_proj_scale`` fp32 [E, ceil(H/128), I/128].

I must be a multiple of 128, so that the gate and up halves stack whole tiles (Qwen3-30B-A3B's 768
is). The product is ``kvik::fused_moe_fp8_block`` (kvik.quantization.ops): the PyTorch reference
below on the CPU, a Triton kernel where a GPU platform registers one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

import kvik.quantization.ops  # noqa: F401  (defines torch.ops.kvik.fused_moe_fp8_block)
from kvik.ops import check_fused_moe_shapes, grouped_experts
from kvik.quantization.fp8_reference import BLOCK, FP8_DTYPE, FP8_MAX, fp8_block_linear
from kvik.quantization.moe_methods import MoeMethod, expert_loader
from kvik.quantization.parameters import new_parameter

if TYPE_CHECKING:
    from kvik.layers.moe import FusedMoE


def _tiles(n: int) -> int:
    return -(-n // BLOCK)


def check_fp8_block_moe_shapes(
    hidden: Tensor,
    router_logits: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    top_k: int,
) -> None:
    """The block-FP8 fused MoE op's contract (a clear error, not a crash or a wrong answer)."""
    check_fused_moe_shapes(hidden, router_logits, w13, w2, top_k)
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(f"fused_moe_fp8_block: weights must be e4m3, not {w13.dtype}, {w2.dtype}")
    experts, two_inter, size = w13.shape
    inter = two_inter // 2
    if inter % BLOCK:
        raise ValueError(
            f"fused_moe_fp8_block: the intermediate size {inter} is not a multiple of {BLOCK}"
        )
    want13 = (experts, two_inter // BLOCK, _tiles(size))
    want2 = (experts, _tiles(size), inter // BLOCK)
    if tuple(w13_scale.shape) != want13 or tuple(w2_scale.shape) != want2:
        raise ValueError(
            f"fused_moe_fp8_block: block scales {tuple(w13_scale.shape)} and "
            f"{tuple(w2_scale.shape)} do not tile the weights {tuple(w13.shape)} and "
            f"{tuple(w2.shape)} in {BLOCK}x{BLOCK} blocks (expected {want13} and {want2})"
        )


def fused_moe_fp8_block(
    hidden: Tensor,
    router_logits: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    top_k: int,
    renormalize: bool,
) -> Tensor:
    """``kvik.ops.fused_moe`` with block-FP8 experts, in PyTorch (the CPU's path and every
    kernel's oracle): each expert's gate/up and down products are ``fp8_block_linear`` (the
    input quantized per token in groups of 128, the weight dequantized by its tile scales, fp32
    sums, the result in the input's dtype), with ``silu(gate) * up`` between them."""
    check_fp8_block_moe_shapes(hidden, router_logits, w13, w13_scale, w2, w2_scale, top_k)

    def expert(e: int, x: Tensor) -> Tensor:
        gate, up = fp8_block_linear(x, w13[e], w13_scale[e]).float().chunk(2, dim=-1)
        act = (torch.nn.functional.silu(gate) * up).to(x.dtype)
        return fp8_block_linear(act, w2[e], w2_scale[e])

    return grouped_experts(hidden, router_logits, top_k, renormalize, expert)


class Fp8BlockMoeMethod(MoeMethod):
    """Checkpoint tensors per expert: ``gate_proj``, ``up_proj``, ``down_proj`` each with
    ``weight`` (e4m3) and ``weight_scale_inv`` (fp32 tile scales); module docstring."""

    def create_weights(self, layer: FusedMoE, params_dtype: torch.dtype) -> None:
        from kvik.model_loader.dummy import DUMMY_RANGE

        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
        if i % BLOCK:
            raise ValueError(
                f"{layer.prefix or 'a mixture-of-experts layer'}: block-FP8 experts need an "
                f"intermediate size that is a multiple of the {BLOCK}-row weight blocks (the gate "
                f"and up projections stack whole blocks), got {i}"
            )
        dummy_scale = DUMMY_RANGE / FP8_MAX  # dummy e4m3 weights land in the dummy range
        rows, blocks = expert_loader(layer), expert_loader(layer, BLOCK)
        layer.gate_up_proj = new_parameter((e, 2 * i, h), FP8_DTYPE, rows)
        layer.gate_up_proj_scale = new_parameter(
            (e, 2 * i // BLOCK, _tiles(h)), torch.float32, blocks, dummy_scale
        )
        layer.down_proj = new_parameter((e, h, i), FP8_DTYPE, rows)
        layer.down_proj_scale = new_parameter(
            (e, _tiles(h), i // BLOCK), torch.float32, blocks, dummy_scale
        )

    def apply(self, layer: FusedMoE, hidden: Tensor, router_logits: Tensor) -> Tensor:
        return torch.ops.kvik.fused_moe_fp8_block(
            hidden,
            router_logits,
            layer.gate_up_proj,
            layer.gate_up_proj_scale,
            layer.down_proj,
            layer.down_proj_scale,
            layer.top_k,
            layer.renormalize,
        )
