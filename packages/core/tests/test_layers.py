"""kvik's layers against the Hugging Face code they replace."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from kvik.layers.activation import SiluAndMul
from kvik.layers.embedding import LMHead, VocabEmbedding
from kvik.layers.linear import Linear, MergedColumnLinear, QKVLinear
from kvik.layers.norm import RMSNorm
from kvik.layers.rotary import get_rope, inv_freq, rope_config

HEAD = 16
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
}


def llama_config(rope: dict) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=4 * HEAD,
        num_attention_heads=4,
        max_position_embeddings=128,
        rope_parameters=rope,
    )


@pytest.mark.parametrize("kind", ROPES)
def test_inv_freq_is_bitwise_transformers(kind: str) -> None:
    config = llama_config(ROPES[kind])
    init = ROPE_INIT_FUNCTIONS.get(kind, LlamaRotaryEmbedding.compute_default_rope_parameters)
    expected, scaling = init(config)  # no device: 5.25 dropped default rope's device parameter
    assert scaling == 1.0
    base, rope_scaling = rope_config(config)
    assert torch.equal(inv_freq(HEAD, base, rope_scaling, 128), expected)


@pytest.mark.parametrize("kind", ROPES)
def test_rotary_matches_transformers(kind: str) -> None:
    config = llama_config(ROPES[kind])
    rope = get_rope(HEAD, HEAD, 128, *rope_config(config))
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 128, (10,), generator=g)
    q, k = torch.randn(10, 4 * HEAD, generator=g), torch.randn(10, 2 * HEAD, generator=g)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    # transformers: [B, H, T, D]
    eq, ek = apply_rotary_pos_emb(
        q.view(1, 10, 4, HEAD).transpose(1, 2), k.view(1, 10, 2, HEAD).transpose(1, 2), cos, sin
    )
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, eq.transpose(1, 2).reshape(10, -1))
    torch.testing.assert_close(got_k, ek.transpose(1, 2).reshape(10, -1))


def test_rope_config_reads_old_and_new_configs() -> None:
    new = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert rope_config(new) == (1e6, {"rope_type": "default"})
    old = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_config(old) == (5e5, {"type": "linear", "factor": 2.0})
    assert rope_config(SimpleNamespace(rope_theta=1e4, rope_scaling=None)) == (1e4, None)
    assert torch.equal(
        inv_freq(8, 1e4, {"type": "linear", "factor": 2.0}, 64), inv_freq(8, 1e4, None, 64) / 2
    )
    with pytest.raises(ValueError, match="yarn"):
        inv_freq(8, 1e4, {"rope_type": "yarn", "factor": 2.0}, 64)


def test_rms_norm_matches_transformers() -> None:
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g)
    hf, norm = LlamaRMSNorm(32, eps=1e-5), RMSNorm(32, eps=1e-5)
    weight = torch.randn(32, generator=g)
    hf.weight.data.copy_(weight)
    norm.weight.data.copy_(weight)
    torch.testing.assert_close(norm(x), hf(x))
    normed, summed = norm(x, residual)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(normed, hf(x + residual))


def test_silu_and_mul() -> None:
    x = torch.randn(3, 8)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :4]) * x[:, 4:])


def _load(layer: Linear, shards: dict) -> None:
    for name in ("weight", "bias"):
        param = getattr(layer, name)
        for shard_id, (w, b) in shards.items():
            param.weight_loader(param, w if name == "weight" else b, shard_id)


def test_packed_linears_equal_their_separate_projections() -> None:
    x = torch.randn(3, 8)
    parts = {i: torch.nn.Linear(8, n) for i, n in enumerate([4, 6])}
    merged = MergedColumnLinear(8, [4, 6], bias=True)
    _load(merged, {i: (p.weight, p.bias) for i, p in parts.items()})
    torch.testing.assert_close(merged(x), torch.cat([p(x) for p in parts.values()], dim=-1))

    parts = {s: torch.nn.Linear(8, n) for s, n in zip("qkv", [3 * 2, 2, 2], strict=True)}
    qkv = QKVLinear(8, head_size=2, num_heads=3, num_kv_heads=1, bias=True)
    _load(qkv, {s: (p.weight, p.bias) for s, p in parts.items()})
    torch.testing.assert_close(qkv(x), torch.cat([p(x) for p in parts.values()], dim=-1))


def test_linear_rejects_a_mismatched_checkpoint_tensor() -> None:
    layer = Linear(8, 4)
    layer.weight.weight_loader(layer.weight, torch.ones(4, 8))
    assert torch.equal(layer.weight, torch.ones(4, 8))
    with pytest.raises(ValueError, match=r"\(1, 8\)"):
        layer.weight.weight_loader(layer.weight, torch.ones(1, 8))
    assert layer.bias is None


def test_embedding_and_tied_head() -> None:
    embedding, head = VocabEmbedding(10, 4), LMHead(10, 4)
    embedding.weight.data.normal_()
    head.tie(embedding)
    hidden = embedding(torch.tensor([1, 2]))  # [2, 4]
    assert torch.equal(hidden, embedding.weight[[1, 2]])
    torch.testing.assert_close(head(hidden), hidden @ embedding.weight.T)
    assert head.weight is embedding.weight


def test_lm_head_writes_logits_into_a_buffer() -> None:
    """``out``: the logits land in the buffer's rows (fp32 from a bf16 head: widened as the
    product's result would be) and the buffer is what comes back."""
    head = LMHead(10, 4).to(torch.bfloat16)
    head.weight.data.normal_()
    hidden = torch.randn(3, 4, dtype=torch.bfloat16)
    buffer = torch.full((5, 10), float("nan"))
    logits = head(hidden, out=buffer[:3])
    assert logits.data_ptr() == buffer.data_ptr() and logits.shape == (3, 10)
    assert torch.equal(buffer[:3], head(hidden).float())
    assert buffer[3:].isnan().all()
