"""The attention layer models use; the chosen backend does the work behind one custom op."""

from __future__ import annotations

import torch
from torch import Tensor, nn

import kvik.ops  # noqa: F401  (defines torch.ops.kvik.*)
from kvik.attention.backend import AttentionImpl
from kvik.layers.rotary import HeadNorms, RotaryEmbedding
from kvik.quantization.activation import (
    FP8_PER_TOKEN_GROUP,
    QuantizedActivation,
    empty_group_quantized,
)
from kvik.worker.forward_context import get_forward_context


class Attention(nn.Module):
    """Paged attention over this layer's KV cache.

    The runner binds ``impl`` (from the chosen backend) and ``kv_cache`` before the first step and
    registers the layer by ``layer_name`` in the forward context.

    ``k_scale`` and ``v_scale`` (fp32 scalars, 1.0 unless the checkpoint has them:
    kvik.model_loader.kv_scales) are what an FP8 KV cache divides keys and values by. They are
    buffers, not parameters: a checkpoint without them loads, and the tensors stay where the
    kernels (and a captured CUDA graph) read them.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        layer_name: str,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_name = layer_name
        self.sliding_window = sliding_window
        self.impl: AttentionImpl | None = None
        self.kv_cache: Tensor | None = None
        # fp32 whatever the model's default dtype is while it is built.
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32), persistent=False)
        #: Set after loading where o_proj takes its input quantized
        #: (kvik.quantization.activation): the eager forward then returns it so wherever the
        #: backend's launch can write it (``AttentionImpl.quantizes_output``).
        self.quantize_output: str | None = None

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        positions: Tensor | None = None,
        rotary_emb: RotaryEmbedding | None = None,
        head_norms: HeadNorms | None = None,
    ) -> Tensor | QuantizedActivation:
        """q: [T, H*D]; k, v: [T, Hk*D]. With ``rotary_emb``, q and k are rotated at ``positions``
        first: the backend may fuse the rotation into its cache write (one launch instead of two).
        ``head_norms`` (with ``rotary_emb`` only; models pass them where ``takes_head_norms``)
        RMS-normalises each q and k head before the rotation. Returns [T, H*D], quantized per
        token group where ``quantize_output`` says so and the backend writes it."""
        if head_norms is not None and rotary_emb is None:
            raise ValueError("head_norms are applied where the rotation is: pass rotary_emb too")
        if torch.compiler.is_compiling():
            out = torch.empty_like(q)
            # Compiled code sees attention as one opaque op, the graph's split point. A backend
            # that rotates while it writes the cache gets the rotation inside that op; otherwise
            # the rotation stays in the compiled graph, where inductor may fuse it.
            if rotary_emb is not None and self.impl.fuses_rotary:
                norms = () if head_norms is None else tuple(head_norms)
                torch.ops.kvik.unified_attention_with_rotary(
                    q, k, v, positions, rotary_emb.cos_sin_cache, rotary_emb.head_size,
                    rotary_emb.is_neox, out, self.layer_name, *norms,
                )  # fmt: skip
                return out
            if head_norms is not None:
                q, k = head_norms(q, k, rotary_emb.head_size)
            if rotary_emb is not None:
                q, k = rotary_emb(positions, q, k)
            torch.ops.kvik.unified_attention(q, k, v, out, self.layer_name)
            return out
        # Eagerly, the same work without the custom op's dispatch (its cost in Python is a
        # noticeable share of a small model's decode step on the CPU).
        metadata = get_forward_context().attn_metadata
        if self.quantize_output == FP8_PER_TOKEN_GROUP and self.impl.quantizes_output(metadata):
            quantized = empty_group_quantized(q)
            out, extra = quantized.values, {"output_scales": quantized.scales}
        else:
            quantized, out, extra = None, torch.empty_like(q), {}
        if rotary_emb is None:
            self.impl.forward(q, k, v, self.kv_cache, metadata, out, **extra)
        else:
            self.impl.forward_with_rotary(
                positions, rotary_emb, q, k, v, self.kv_cache, metadata, out, head_norms, **extra
            )
        return out if quantized is None else quantized

    @property
    def takes_head_norms(self) -> bool:
        """Whether a model should hand its per-head q/k RMSNorms to ``forward`` (the backend
        applies them in its rotary launch) rather than normalise q and k itself."""
        return self.impl is not None and self.impl.fuses_head_norms
