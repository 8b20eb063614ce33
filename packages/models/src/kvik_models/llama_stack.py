"""The Llama family's side of ``kvik.models.decoder_stack``: its layers as a ``DecoderStack``
for platforms that run decoder layers their own way (kvik_cpu's one-call decode step).

Llama, Mistral, Qwen2 and SmolLM compute exactly the declared pre-norm decoder; a model whose
layers add parts or override a forward (Qwen3's query and key norms) offers no stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvik.layers.activation import SiluAndMul
from kvik.models.decoder_stack import DecoderLayerParts, DecoderStack
from kvik_models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel

if TYPE_CHECKING:
    from kvik_models.llama import LlamaForCausalLM


def llama_decoder_stack(model: LlamaForCausalLM) -> DecoderStack | None:
    """``model``'s layers as a ``DecoderStack``, or None where any of them (or the model's
    forward) is not the plain Llama computation."""
    from kvik_models.llama import LlamaForCausalLM

    inner = model.model
    layers = list(inner.layers)
    if (
        not layers
        or type(model).forward is not LlamaForCausalLM.forward
        or type(inner).forward is not LlamaModel.forward
    ):
        return None
    rotary = layers[0].self_attn.rotary_emb
    parts = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not (
            type(layer).forward is LlamaDecoderLayer.forward
            and isinstance(attn, LlamaAttention)
            and type(attn).forward is LlamaAttention.forward
            and type(attn).qkv is LlamaAttention.qkv
            and isinstance(mlp, LlamaMLP)
            and type(mlp).forward is LlamaMLP.forward
            and type(mlp.act_fn) is SiluAndMul
            and attn.rotary_emb is rotary
        ):
            return None
        parts.append(
            DecoderLayerParts(
                input_norm=layer.input_layernorm,
                qkv_proj=attn.qkv_proj,
                attention=attn.attn,
                o_proj=attn.o_proj,
                post_attention_norm=layer.post_attention_layernorm,
                gate_up_proj=mlp.gate_up_proj,
                down_proj=mlp.down_proj,
            )
        )
    return DecoderStack(inner.embed_tokens, tuple(parts), rotary, inner.norm)
