"""Qwen3-MoE (Qwen3's attention, renormalised top-k routing) and Qwen2-MoE (Qwen2's attention,
a shared expert beside the routed ones)."""

from __future__ import annotations

from typing import Any

from kvik_models.llama import LlamaAttention, Qwen2Attention
from kvik_models.moe_decoder import MoeForCausalLM, MoeSpec
from kvik_models.qwen3 import Qwen3Attention


def _qwen_spec(config: Any, shared_intermediate_size: int = 0) -> MoeSpec:
    return MoeSpec(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        shared_intermediate_size=shared_intermediate_size,
    )


class Qwen3MoeForCausalLM(MoeForCausalLM):
    attention_cls = Qwen3Attention

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        return _qwen_spec(config)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        return _qwen_spec(config, config.shared_expert_intermediate_size)

    @classmethod
    def attention_class(cls, config: Any) -> type[LlamaAttention]:
        # Biases on q, k and v unless the config says otherwise (``qkv_bias``, default true).
        return Qwen2Attention if getattr(config, "qkv_bias", True) else LlamaAttention
