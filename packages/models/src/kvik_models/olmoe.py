"""OLMoE: an RMSNorm over all of the query and of the key (not per head), optional clipping of
q, k and v, and 64 experts of which each token takes 8."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from kvik.layers.norm import RMSNorm
from kvik.layers.rotary import RotaryEmbedding
from kvik_models.llama import LlamaAttention
from kvik_models.moe_decoder import MoeForCausalLM, MoeSpec

if TYPE_CHECKING:
    from kvik.quantization.base import QuantizationConfig


class OlmoeAttention(LlamaAttention):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(config, layer_idx, rotary_emb, quant_config, prefix)
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        # transformers sizes the key's norm from hidden_size / heads, which is the head size in
        # every OLMoE config; a config where it is not would not load (shape mismatch).
        kv_width = config.hidden_size // config.num_attention_heads * config.num_key_value_heads
        self.k_norm = RMSNorm(kv_width, config.rms_norm_eps)
        self.clip_qkv: float | None = getattr(config, "clip_qkv", None)

    def qkv(self, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super().qkv(hidden)
        q, k = self.q_norm(q), self.k_norm(k)  # [T, H*D], [T, Hk*D]
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        return q, k, v


class OlmoeForCausalLM(MoeForCausalLM):
    attention_cls = OlmoeAttention

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        return MoeSpec(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
        )
