"""Qwen3: Llama's decoder with an RMSNorm over each query and key head before rope."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from kvik.layers.norm import RMSNorm
from kvik.layers.rotary import RotaryEmbedding
from kvik_models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, rotary_emb)
        self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps)

    def forward(self, positions: Tensor, hidden: Tensor) -> Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.unflatten(-1, (-1, self.head_size))).flatten(-2)  # [T, H*D]
        k = self.k_norm(k.unflatten(-1, (-1, self.head_size))).flatten(-2)  # [T, Hk*D]
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))  # [T, hidden]


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
