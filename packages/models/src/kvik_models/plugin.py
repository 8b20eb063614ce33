"""Entry point ``models`` of the ``kvik`` group: the built-in model architectures."""

from __future__ import annotations

import kvik

KVIK_PLUGIN_API = kvik.PLUGIN_API_VERSION


@kvik.hookimpl
def kvik_register_models(register):
    register("LlamaForCausalLM", "kvik_models.llama:LlamaForCausalLM")
    register("MistralForCausalLM", "kvik_models.llama:MistralForCausalLM")
    register("Qwen2ForCausalLM", "kvik_models.llama:Qwen2ForCausalLM")
    register("Qwen3ForCausalLM", "kvik_models.qwen3:Qwen3ForCausalLM")
    register("Qwen3MoeForCausalLM", "kvik_models.qwen_moe:Qwen3MoeForCausalLM")
    register("Qwen2MoeForCausalLM", "kvik_models.qwen_moe:Qwen2MoeForCausalLM")
    register("MixtralForCausalLM", "kvik_models.mixtral:MixtralForCausalLM")
    register("OlmoeForCausalLM", "kvik_models.olmoe:OlmoeForCausalLM")
