"""A quantization method from a plugin, registered through ``kvik_register_quantization_methods``
as core's own are: a model loads with it on the platforms it names, and fails with an error naming
method and platform where it does not run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, LlamaConfig

import kvik
from kvik import LLM, SamplingParams
from kvik.cli.env import collect
from kvik.layers.linear import Linear
from kvik.plugins.manager import get_plugin_manager
from kvik.quantization import LinearMethod, QuantizationConfig
from kvik.quantization.parameters import new_parameter, row_loader


class Int8WeightMethod(LinearMethod):
    """Weights rounded to int8 after loading, one scale per output channel; products on the
    dequantized weight (the method brings its own kernel instead of a platform's scheme)."""

    def create_weights(self, layer: Linear, params_dtype: torch.dtype) -> None:
        layer.weight = new_parameter(
            (layer.out_features, layer.in_features), params_dtype, row_loader(layer)
        )

    def process_weights_after_loading(self, layer: nn.Module, platform) -> None:
        weight = layer.weight.data.float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
        layer.weight = nn.Parameter(
            (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8), requires_grad=False
        )
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(self, layer: nn.Module, x: Tensor) -> Tensor:
        weight = (layer.weight.float() * layer.weight_scale[:, None]).to(x.dtype)
        return F.linear(x, weight, layer.bias)


class Int8WeightConfig(QuantizationConfig):
    """``--quantization toy-int8``: online int8 weights on the CPU, the LM head left alone."""

    name = "toy-int8"
    platforms = ("cpu",)

    @classmethod
    def from_flag(cls) -> Int8WeightConfig:
        return cls()

    def quantized_method(self, layer, prefix: str, names: list[str]) -> LinearMethod:
        return Int8WeightMethod()


class NowhereConfig(Int8WeightConfig):
    """The same method, declaring no platform: no installed platform lists it."""

    name = "toy-nowhere"
    platforms = ()


class ToyQuantizationPlugin:
    KVIK_PLUGIN_API = kvik.PLUGIN_API_VERSION

    @kvik.hookimpl
    def kvik_register_quantization_methods(self, register):
        register("toy-int8", lambda: Int8WeightConfig)  # a factory returning the config class
        register("toy-nowhere", lambda: NowhereConfig)


@pytest.fixture
def toy_plugin():
    """The toy plugin in this process's plugin manager, as an installed plugin would be."""
    manager = get_plugin_manager()
    assert manager.add_plugin(ToyQuantizationPlugin(), "toy-quantization", dist="toy")
    yield manager
    manager._drop("toy-quantization")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    folder = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
PROMPTS = [{"prompt_token_ids": [1, 17, 99, 3, 200, 45, 6]}, {"prompt_token_ids": [1, 80, 81]}]


def test_a_plugin_method_loads_a_model(toy_plugin, tiny_llama):
    assert toy_plugin.quantization_methods.owners["toy-int8"] == "toy-quantization"
    llm = LLM(str(tiny_llama), dtype="float32", quantization="toy-int8", num_kv_blocks=16)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.quant_method, Int8WeightMethod) for m in linears)
    assert all(m.weight.dtype == torch.int8 for m in linears)
    quantized = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    plain = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=16).generate(
        PROMPTS, GREEDY, use_tqdm=False
    )
    for q, p in zip(quantized, plain, strict=True):
        # int8 weights move a log-probability by far less than the tiny model's margins
        q_logprobs = [next(iter(step.values())).logprob for step in q.outputs[0].logprobs]
        p_logprobs = [next(iter(step.values())).logprob for step in p.outputs[0].logprobs]
        assert q.outputs[0].token_ids == p.outputs[0].token_ids
        assert max(abs(a - b) for a, b in zip(q_logprobs, p_logprobs, strict=True)) < 0.05
    report = collect(manager=toy_plugin)
    [cpu] = [p for p in report["platforms"] if p["name"] == "cpu"]
    assert "toy-int8" in cpu["quantization_methods"]
    assert "toy-nowhere" not in cpu["quantization_methods"]


def test_a_method_the_platform_lacks_fails_naming_both(toy_plugin, tiny_llama):
    with pytest.raises(ValueError) as error:
        LLM(str(tiny_llama), quantization="toy-nowhere", num_kv_blocks=16)
    message = str(error.value)
    assert "'toy-nowhere' is not supported on platform 'cpu'" in message
    assert "toy-int8" in message  # what the platform does run


def test_a_dropped_plugin_takes_its_methods_with_it(tiny_llama):
    with pytest.raises(ValueError, match="unknown quantization method 'toy-int8'"):
        LLM(str(tiny_llama), quantization="toy-int8", num_kv_blocks=16)
