"""Each architecture against transformers: one prefill of a tiny random model, loaded by kvik."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from kvik.attention.backend import AttentionMetadata
from kvik.layers.attention import Attention
from kvik.model_loader import load_model, load_model_config
from kvik.worker.forward_context import ForwardContext, forward_context
from kvik_cpu.attention import TorchSdpaBackend

BLOCK_SIZE = 16
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.1,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CONFIGS: dict[str, PretrainedConfig] = {
    "llama3": LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE),
    "llama_tied": LlamaConfig(**COMMON, tie_word_embeddings=True),  # SmolLM2's shape
    "mistral": MistralConfig(**COMMON, sliding_window=8),
    "qwen2": Qwen2Config(**COMMON),
    "qwen2_sliding": Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=1
    ),
    "qwen3": Qwen3Config(**COMMON, attention_bias=True, tie_word_embeddings=True),
}


def save_tiny(config: PretrainedConfig, folder: Path, **save_kwargs) -> nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    model.save_pretrained(folder, **save_kwargs)
    return model.eval()


def prefill_logits(model: nn.Module, input_ids: Tensor) -> Tensor:
    """One request's prefill through kvik's CPU attention backend: logits [T, vocab]."""
    t = len(input_ids)
    num_blocks = -(-t // BLOCK_SIZE)
    common = AttentionMetadata(
        num_actual_tokens=t,
        num_reqs=1,
        query_start_loc=torch.tensor([0, t], dtype=torch.int32),
        query_lens=torch.tensor([t], dtype=torch.int32),
        seq_lens=torch.tensor([t], dtype=torch.int32),
        block_table=torch.arange(num_blocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(t),
        max_query_len=t,
        max_seq_len=t,
        block_size=BLOCK_SIZE,
    )
    layers = {m.layer_name: m for m in model.modules() if isinstance(m, Attention)}
    for layer in layers.values():
        layer.impl = TorchSdpaBackend.impl_class()(
            layer.num_heads, layer.head_size, layer.scale, layer.num_kv_heads, layer.sliding_window
        )
        shape = TorchSdpaBackend.kv_cache_shape(
            num_blocks, BLOCK_SIZE, layer.num_kv_heads, layer.head_size
        )
        layer.kv_cache = torch.zeros(shape)
    metadata = TorchSdpaBackend.build_metadata(common)
    with torch.inference_mode(), forward_context(ForwardContext(metadata, layers)):
        return model.compute_logits(model(input_ids, torch.arange(t)))


@pytest.mark.parametrize("kind", CONFIGS)
def test_prefill_matches_transformers(kind: str, tmp_path: Path) -> None:
    hf_model = save_tiny(CONFIGS[kind], tmp_path)
    model = load_model(load_model_config(str(tmp_path)), torch.device("cpu"))
    input_ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = hf_model(input_ids[None]).logits[0]
    got = prefill_logits(model, input_ids)
    assert (got - expected).abs().max() / expected.abs().max() <= 1e-4


def test_sliding_window_follows_transformers_per_layer() -> None:
    from kvik_models.llama import sliding_window

    assert [sliding_window(CONFIGS["mistral"], i) for i in range(2)] == [8, 8]
    assert [sliding_window(CONFIGS["qwen2_sliding"], i) for i in range(2)] == [None, 8]
    assert [sliding_window(CONFIGS[k], i) for k in ("llama3", "qwen2") for i in range(2)] == [
        None
    ] * 4


def test_tied_head_shares_the_embedding(tmp_path: Path) -> None:
    save_tiny(CONFIGS["llama_tied"], tmp_path)
    model = load_model(load_model_config(str(tmp_path)), torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path) -> None:
    save_tiny(CONFIGS["qwen2"], tmp_path / "single")
    save_tiny(CONFIGS["qwen2"], tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    single = load_model(load_model_config(str(tmp_path / "single")), torch.device("cpu"))
    sharded = load_model(load_model_config(str(tmp_path / "sharded")), torch.device("cpu"))
    expected = single.state_dict()
    for name, tensor in sharded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_checkpoint_that_lacks_a_weight_is_an_error(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_tiny(CONFIGS["llama3"], tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_model(load_model_config(str(tmp_path)), torch.device("cpu"))
