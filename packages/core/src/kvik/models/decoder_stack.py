"""What a model offers a platform that runs its decoder layers its own way (kvik_cpu's one-call
decode step): the layers' parts, declared, so that the platform needs no model classes.

A model implements ``DecoderStackModel``: ``decoder_stack()`` returns a ``DecoderStack`` when
every layer computes exactly the pre-norm decoder below from the parts it names, and None otherwise
(a layer with extra parts, such as Qwen3's query and key norms, or a subclass that changes a
forward). A platform then checks only what its own kernels need (how the linears are packed, the
attention backend) and falls back to the model's own forward for a model that offers no stack.

With ``x`` a layer's input hidden states and ``residual`` the residual stream (None before the
first layer), each layer computes, as ``kvik_models.llama.LlamaDecoderLayer`` does::

    h, residual = input_norm(x, residual)                 # fused add + RMSNorm (plain before layer 0)
    q, k, v = qkv_proj(h).split([H*D, Hk*D, Hk*D])        # one packed projection: q, then k, then v
    h = o_proj(attention(q, k, v, positions, rotary))     # paged attention over the layer's KV cache
                                                          # of q and k rotated by the stack's rotary
    h, residual = post_attention_norm(h, residual)
    x = down_proj(silu_and_mul(gate_up_proj(h)))          # gate_up packed: gate rows, then up rows

and after the last layer ``final_norm(x, residual)`` gives the hidden states the LM head reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvik.distributed.parallel_state import get_tp_group
from kvik.layers.attention import Attention
from kvik.layers.embedding import VocabEmbedding
from kvik.layers.linear import Linear
from kvik.layers.norm import RMSNorm
from kvik.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class DecoderLayerParts:
    """One layer's modules, in the order the layer runs them (the module docstring's formula)."""

    input_norm: RMSNorm
    qkv_proj: Linear
    attention: Attention
    o_proj: Linear
    post_attention_norm: RMSNorm
    gate_up_proj: Linear
    down_proj: Linear


@dataclass(frozen=True)
class DecoderStack:
    """A model's embedding, decoder layers and final norm, with the rotary embedding they share."""

    embed_tokens: VocabEmbedding
    layers: Sequence[DecoderLayerParts]
    rotary: RotaryEmbedding
    final_norm: RMSNorm


@runtime_checkable
class DecoderStackModel(Protocol):
    """A model (the class a ``kvik_register_models`` hook registers) that offers its layers."""

    def decoder_stack(self) -> DecoderStack | None:
        """The model's layers as a ``DecoderStack``, or None where some layer computes anything
        else than the declared decoder (then a platform runs the model's own forward)."""
        ...


def decoder_stack(model: object) -> DecoderStack | None:
    """``model``'s stack where it offers one, else None (a model that does not implement the
    protocol, or declines, or runs under tensor parallelism: the declared decoder has no
    all-reduces, so a platform's own decode would sum nothing between the ranks)."""
    if not isinstance(model, DecoderStackModel) or get_tp_group().world_size > 1:
        return None
    return model.decoder_stack()
