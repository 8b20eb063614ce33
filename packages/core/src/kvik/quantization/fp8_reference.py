"""FP8 (e4m3) numerics in PyTorch: the CPU's kernels and the oracle of every platform's kernels.

The rules every FP8 kernel of kvik follows (a platform's Triton kernels are tested against these):

- quantize: ``q = clamp(x / s, -448, 448)`` cast to ``torch.float8_e4m3fn`` (round to nearest even,
  what torch's cast does); dequantize: ``q.float() * s``;
- dynamic activation scales: ``max(|x|)`` over the row or the group, in fp32, over 448, at least
  ``MIN_SCALE`` (an all-zero row quantizes to zeros, never NaN);
- block-scaled weights (``fp8_block_linear``): activations quantized per token in groups of
  ``BLOCK`` consecutive input features, weights e4m3 ``[N, K]`` with one fp32 scale per
  ``BLOCK x BLOCK`` tile, ``[ceil(N/BLOCK), ceil(K/BLOCK)]``, multiplied (Hugging Face calls it
  ``weight_scale_inv``, but it is not inverted);
- per-tensor / per-channel weights (``fp8_scaled_linear``): e4m3 ``[N, K]`` with scales ``[1]``
  or ``[N]``; activations with a static scale ``[1]`` or dynamic per-token scales.

Products accumulate in fp32 and come back in the activations' dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
#: The smallest dynamic scale: an all-zero row or group gets this rather than 0 (no 0/0).
MIN_SCALE = 1e-10
#: Input features per activation group and the side of a weight tile, for block-scaled FP8.
BLOCK = 128


def quantize_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """``x / scale`` clamped to e4m3's range and rounded to nearest even, as e4m3. ``scale``
    broadcasts against ``x``."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dynamic_scale(amax: Tensor) -> Tensor:
    """The scale that maps ``amax`` (fp32) onto 448."""
    return (amax.float() / FP8_MAX).clamp(min=MIN_SCALE)


def quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1]): one dynamic scale per row."""
    scale = dynamic_scale(x.float().abs().amax(dim=-1, keepdim=True))
    return quantize_fp8(x, scale), scale


def quantize_per_token_group(x: Tensor, group: int = BLOCK) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K/group)]): one dynamic scale per row and
    group of ``group`` consecutive features (the last group may be shorter)."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = dynamic_scale(padded.abs().amax(dim=-1))  # [M, groups]
    q = quantize_fp8(padded, scale.unsqueeze(-1)).view(m, groups * group)[:, :k]
    return q, scale


def quantize_weight_blocks(w: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """Weights [..., N, K] (N and K multiples of ``block``) -> (e4m3 [..., N, K], fp32 scales
    [..., N/block, K/block]): one dynamic scale per ``block x block`` tile, the layout of
    block-FP8 checkpoints (and of stacked experts, with a leading expert dim)."""
    *lead, n, k = w.shape
    tiles = w.float().reshape(*lead, n // block, block, k // block, block)
    scale = dynamic_scale(tiles.abs().amax(dim=(-3, -1)))
    return quantize_fp8(tiles, scale[..., :, None, :, None]).reshape(w.shape), scale


def expand_block_scales(scale: Tensor, rows: int, cols: int, block: int = BLOCK) -> Tensor:
    """Tile scales [ceil(rows/block), ceil(cols/block)] -> one per element, [rows, cols]."""
    return scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]


def check_block_scales(weight: Tensor, weight_scale: Tensor) -> None:
    n, k = weight.shape
    tiles = (-(-n // BLOCK), -(-k // BLOCK))
    if tuple(weight_scale.shape) != tiles:
        raise ValueError(
            f"block scales {tuple(weight_scale.shape)} do not tile a [{n}, {k}] weight in "
            f"{BLOCK}x{BLOCK} blocks (expected {tiles})"
        )


def fp8_block_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None = None
) -> Tensor:
    """x [..., K] @ (e4m3 weight [N, K] with tile scales [ceil(N/128), ceil(K/128)])^T (+ bias),
    the activations quantized per token in groups of 128 first. Returns [..., N] in x's dtype."""
    n, k = weight.shape
    check_block_scales(weight, weight_scale)
    q, scale = quantize_per_token_group(x.reshape(-1, k))
    out = fp8_block_linear_quantized(q, scale, weight, weight_scale, bias, x.dtype)
    return out.view(*x.shape[:-1], n)


def fp8_block_linear_quantized(
    q: Tensor,
    scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """``fp8_block_linear`` on activations already quantized per token group: e4m3 ``q`` [..., K]
    and fp32 ``scale`` [..., ceil(K/128)] -> [..., N] in ``out_dtype``."""
    n, k = weight.shape
    check_block_scales(weight, weight_scale)
    groups = -(-k // BLOCK)
    if q.shape[-1] != k or tuple(scale.shape) != (*q.shape[:-1], groups):
        raise ValueError(
            f"quantized activations {tuple(q.shape)} with scales {tuple(scale.shape)} do not fit "
            f"a [{n}, {k}] weight: expected [..., {k}] and [..., {groups}]"
        )
    rows, scales = q.reshape(-1, k), scale.reshape(-1, groups)
    a = rows.float() * scales.repeat_interleave(BLOCK, 1)[:, :k]
    w = weight.float() * expand_block_scales(weight_scale.float(), n, k)
    y = a @ w.T
    if bias is not None:
        y += bias.float()
    return y.to(out_dtype).view(*q.shape[:-1], n)


def fp8_scaled_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    input_scale: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """x [..., K] @ (e4m3 weight [N, K] with scales [1] or [N])^T (+ bias), the activations
    quantized with ``input_scale`` [1] (static) or, when it is None, one dynamic scale per token.
    Returns [..., N] in x's dtype."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if input_scale is None:
        q, a_scale = quantize_per_token(rows)
    else:
        a_scale = input_scale.float().reshape(1, 1)
        q = quantize_fp8(rows, a_scale)
    y = (q.float() @ weight.float().T) * a_scale * weight_scale.float().reshape(1, -1)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], n)
