"""Qwen3: Llama's decoder with an RMSNorm over each query and key head before rope."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from kvik.layers.norm import RMSNorm
from kvik.layers.rotary import HeadNorms, RotaryEmbedding
from kvik_models.llama import LlamaAttention, LlamaForCausalLM

if TYPE_CHECKING:
    from kvik.quantization.base import QuantizationConfig


class Qwen3Attention(LlamaAttention):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(config, layer_idx, rotary_emb, quant_config, prefix)
        self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps)

    def qkv(self, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super().qkv(hidden)
        q = self.q_norm(q.unflatten(-1, (-1, self.head_size))).flatten(-2)  # [T, H*D]
        k = self.k_norm(k.unflatten(-1, (-1, self.head_size))).flatten(-2)  # [T, Hk*D]
        return q, k, v

    def forward(self, positions: Tensor, hidden: Tensor) -> Tensor:
        if not self.attn.takes_head_norms:
            return super().forward(positions, hidden)
        # The backend normalises each head in its rotary launch: two launches fewer a layer.
        q, k, v = LlamaAttention.qkv(self, hidden)
        norms = HeadNorms(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb, norms))


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
