"""Rotary position embeddings: a cos/sin table computed as Hugging Face does, applied by an op."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from kvik import ops


def rope_config(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling) of a transformers config: ``rope_parameters`` (transformers 5) or the older
    ``rope_theta`` + ``rope_scaling``."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        scaling = getattr(hf_config, "rope_scaling", None) or {}
        params = {"rope_theta": getattr(hf_config, "rope_theta", 10000.0), **scaling}
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return float(params.get("rope_theta", 10000.0)), scaling or None


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict[str, Any], max_position: int) -> Tensor:
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, those between interpolated.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling.get("original_max_position_embeddings", max_position)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def inv_freq(
    rotary_dim: int, base: float, scaling: dict[str, Any] | None, max_position: int
) -> Tensor:
    """Inverse frequencies [rotary_dim / 2] in fp32, bit for bit as transformers computes them."""
    freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return freq
    if rope_type == "linear":
        return freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(freq, scaling, max_position)
    raise ValueError(f"rope_type {rope_type!r} is not supported (default, linear, llama3 are)")


class Rotation(NamedTuple):
    """A rotary embedding's arguments outside its module (what ``kvik::unified_attention_with_rotary``
    receives), callable like the module."""

    head_size: int
    cos_sin_cache: Tensor
    is_neox: bool

    def __call__(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return ops.small_op("rotary_embedding")(
            positions, q, k, self.head_size, self.cos_sin_cache, self.is_neox
        )


class HeadNorms(NamedTuple):
    """RMSNorm weights over each query and key head (Qwen3's ``q_norm`` and ``k_norm``), for a
    backend that applies them where it rotates (``AttentionImpl.fuses_head_norms``)."""

    q_weight: Tensor  # [head_size]
    k_weight: Tensor  # [head_size]
    eps: float

    def __call__(self, q: Tensor, k: Tensor, head_size: int) -> tuple[Tensor, Tensor]:
        """q [T, H*D], k [T, Hk*D] with each head normalised, as the models' RMSNorm modules."""
        rms_norm = ops.small_op("rms_norm")
        q = rms_norm(q.unflatten(-1, (-1, head_size)), self.q_weight, self.eps).flatten(-2)
        k = rms_norm(k.unflatten(-1, (-1, head_size)), self.k_weight, self.eps).flatten(-2)
        return q, k


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, cos_sin_cache: Tensor, is_neox: bool) -> None:
        super().__init__()
        self.head_size = head_size
        self.is_neox = is_neox
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)
        self._rotary_embedding = ops.small_op("rotary_embedding")

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        # positions [T]; q [T, H*D]; k [T, Hk*D]
        return self._rotary_embedding(
            positions, q, k, self.head_size, self.cos_sin_cache, self.is_neox
        )


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    is_neox: bool = True,
) -> RotaryEmbedding:
    freq = inv_freq(rotary_dim, base, rope_scaling, max_position)
    t = torch.arange(max_position, dtype=torch.float32, device=freq.device)
    freqs = torch.outer(t, freq)  # [max_position, rotary_dim / 2]
    return RotaryEmbedding(head_size, torch.cat((freqs.cos(), freqs.sin()), dim=-1), is_neox)
