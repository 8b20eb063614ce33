"""Each architecture against transformers: one prefill of a tiny random model, loaded by kvik."""

from __future__ import annotations

import copy
import json
from contextlib import AbstractContextManager
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
from kvik.models.decoder_stack import DecoderStack, decoder_stack
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
    with torch.inference_mode(), prefill_context(model, len(input_ids)):
        return model.compute_logits(model(input_ids, torch.arange(len(input_ids))))


def prefill_context(model: nn.Module, t: int) -> AbstractContextManager:
    """The forward context of one request's t-token prefill, through the CPU's SDPA backend."""
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
    return forward_context(ForwardContext(metadata, layers))


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
    no_window = copy.deepcopy(CONFIGS["mistral"])
    no_window.sliding_window = 0
    assert [sliding_window(no_window, i) for i in range(2)] == [None, None]


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


def test_checkpoint_that_lacks_one_shard_of_a_fused_layer_is_an_error(tmp_path: Path) -> None:
    """gate_up_proj's weight written by up_proj alone would leave the gate rows uninitialised."""
    from safetensors.torch import load_file, save_file

    save_tiny(CONFIGS["qwen3"], tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del (
        weights["model.layers.1.mlp.gate_proj.weight"],
        weights["model.layers.0.self_attn.k_proj.bias"],
    )
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as error:
        load_model(load_model_config(str(tmp_path)), torch.device("cpu"))
    message = str(error.value)
    assert "model.layers.1.mlp.gate_up_proj.weight (from model.layers.1.mlp.gate_proj)" in message
    assert (
        "model.layers.0.self_attn.qkv_proj.bias (from model.layers.0.self_attn.k_proj)" in message
    )


def run_stack(stack: DecoderStack, input_ids: Tensor, positions: Tensor) -> Tensor:
    """The pre-norm decoder as kvik.models.decoder_stack declares it, from the stack's parts."""
    x, residual = stack.embed_tokens(input_ids), None
    for layer in stack.layers:
        if residual is None:
            h, residual = layer.input_norm(x), x
        else:
            h, residual = layer.input_norm(x, residual)
        q_size = layer.attention.num_heads * layer.attention.head_size
        kv_size = layer.attention.num_kv_heads * layer.attention.head_size
        q, k, v = layer.qkv_proj(h).split([q_size, kv_size, kv_size], dim=-1)
        q, k = stack.rotary(positions, q, k)
        h, residual = layer.post_attention_norm(layer.o_proj(layer.attention(q, k, v)), residual)
        # (The layers hand the rotary to the attention, which may fuse it: the same numbers.)
        gate, up = layer.gate_up_proj(h).chunk(2, dim=-1)
        x = layer.down_proj(nn.functional.silu(gate) * up)
    return stack.final_norm(x, residual)[0]


@pytest.mark.parametrize("kind", ["llama3", "llama_tied", "mistral", "qwen2", "qwen2_sliding"])
def test_decoder_stack_declares_what_the_model_computes(kind: str, tmp_path: Path) -> None:
    """The Llama family offers its layers through kvik.models.decoder_stack, and the declared
    decoder, run from those parts, gives the model's own hidden states."""
    save_tiny(CONFIGS[kind], tmp_path)
    model = load_model(load_model_config(str(tmp_path)), torch.device("cpu"))
    stack = decoder_stack(model)
    assert stack is not None and len(stack.layers) == CONFIGS[kind].num_hidden_layers
    input_ids = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(len(input_ids))
    with torch.inference_mode(), prefill_context(model, len(input_ids)):
        expected = model(input_ids, positions)
        got = run_stack(stack, input_ids, positions)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_models_that_compute_anything_else_offer_no_stack(tmp_path: Path) -> None:
    """Qwen3's query and key norms are not in the declared decoder, nor is a layer whose forward
    a subclass replaced: a platform then runs the model's own forward."""
    save_tiny(CONFIGS["qwen3"], tmp_path / "qwen3")
    assert decoder_stack(load_model(load_model_config(str(tmp_path / "qwen3")), "cpu")) is None

    save_tiny(CONFIGS["llama3"], tmp_path / "llama")
    model = load_model(load_model_config(str(tmp_path / "llama")), torch.device("cpu"))
    assert decoder_stack(model) is not None
    mlp = model.model.layers[1].mlp

    class ScaledMLP(type(mlp)):
        def forward(self, x: Tensor) -> Tensor:
            return 2 * super().forward(x)

    mlp.__class__ = ScaledMLP
    assert decoder_stack(model) is None
    assert decoder_stack(nn.Linear(2, 2)) is None  # a model without the protocol
