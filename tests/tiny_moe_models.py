"""Tiny random-weight mixture-of-experts models saved by transformers, in either expert layout."""

from __future__ import annotations

from pathlib import Path

import torch

MOE_KINDS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]

# As tiny_models: a large initialisation keeps next-token distributions peaked (few greedy ties).
_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def moe_config(kind: str, hidden_size: int = 64):
    """A small config of ``kind``: 4 query and 2 KV heads of hidden_size / 4."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = _COMMON | {"hidden_size": hidden_size}
    if kind == "qwen3_moe":  # renormalised top-4 of 8, q/k norms, a dense layer
        return Qwen3MoeConfig(
            **common, head_dim=hidden_size // 4, intermediate_size=96, moe_intermediate_size=32,
            num_experts=8, num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[1],
        )  # fmt: skip
    if kind == "qwen2_moe":  # top-2 of 8 without renormalising, a gated shared expert
        return Qwen2MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=False, shared_expert_intermediate_size=48,
        )  # fmt: skip
    if kind == "mixtral":  # top-2 of 8, renormalised, a sliding window
        return MixtralConfig(
            **common, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
            sliding_window=24,
        )  # fmt: skip
    if kind == "olmoe":  # whole-q and whole-k norms, clipped q/k/v, top-3 of 8
        return OlmoeConfig(
            **common, intermediate_size=32, num_experts=8, num_experts_per_tok=3, clip_qkv=2.0
        )
    raise ValueError(f"unknown MoE kind {kind!r}")


def build_tiny_moe(
    kind: str, folder: Path, stacked: bool = False, seed: int = 0, hidden_size: int = 64
) -> Path:
    """Save a random model of ``kind``: a tensor per expert as checkpoints are published (and as
    transformers saves by default), or with ``stacked`` the experts as transformers 5 holds them
    (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        moe_config(kind, hidden_size), torch_dtype=torch.float32
    )
    model.save_pretrained(folder, save_original_format=not stacked)
    return folder
