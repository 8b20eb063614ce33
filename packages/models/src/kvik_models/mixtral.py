"""Mixtral: Mistral's attention, 8 experts of which each token takes 2, their weights
renormalised over the two."""

from __future__ import annotations

from typing import Any

from kvik_models.moe_decoder import MoeForCausalLM, MoeSpec


class MixtralForCausalLM(MoeForCausalLM):
    # Mixtral's checkpoints call the sparse block "block_sparse_moe" (and its experts' projections
    # w1, w3, w2); transformers 5 saves its stacked experts under "mlp".
    renamed_modules = {".block_sparse_moe.": ".mlp."}

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        return MoeSpec(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            renormalize=True,
        )
