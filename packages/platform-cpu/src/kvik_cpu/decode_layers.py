"""Decode steps of Llama-family models in one C++ call (csrc/decode_layers.cpp): the CPU's step
runner.

At decode batch sizes a layer's kernels take tens of microseconds, and the Python around them
(module calls, views, dispatch: about 35 calls a layer) as long again. ``DecodeLayers`` runs all
the decoder layers of a decode-only step as one call of the same kernels in the same order, so the
tokens are the same bits as the layer-by-layer path; the CPU's analogue of a CUDA graph for decode.
``CpuStepRunner`` (the CPU platform's implementation of kvik.worker.step_runner's seam) uses it for
the steps it covers and runs the model's layers otherwise; the model itself knows nothing of it.

It applies to ``LlamaModel`` (Llama, Mistral, Qwen2, SmolLM) when every matmul runs on AMX
(kvik_cpu.linear.AmxLinear), the small ops have their C++ kernels, and attention is CPU_PAGED; any
other step (prompt chunks, a mixed step) or model runs layer by layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvik.layers.activation import SiluAndMul
from kvik.layers.norm import RMSNorm
from kvik.worker.step_runner import StepRunner
from kvik_cpu.linear import AmxLinear
from kvik_cpu.paged_attention import CpuPagedImpl, PagedMetadata


def _no_bias() -> Tensor:
    return torch.empty(0)


class DecodeLayers:
    """The decoder layers and final norm of a ``LlamaModel``'s decode-only step, in one call."""

    def __init__(self, model) -> None:  # a kvik_models.llama.LlamaModel
        self.model = model
        first = model.layers[0].self_attn
        self.num_heads = first.attn.num_heads
        self.num_kv_heads = first.attn.num_kv_heads
        self.head_size = first.head_size
        self.scale = first.attn.scale
        self.intermediate_size = model.layers[0].mlp.gate_up_proj.kernel.out_features // 2
        self.eps = model.norm.eps
        self.rotary = first.rotary_emb
        weights: list[Tensor] = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for module in (
                layer.input_layernorm,
                attn.qkv_proj,
                attn.o_proj,
                layer.post_attention_layernorm,
                mlp.gate_up_proj,
                mlp.down_proj,
            ):
                if isinstance(module, RMSNorm):
                    weights.append(module.weight.detach())
                else:
                    kernel = module.kernel
                    weights += [kernel.weight, _no_bias() if kernel.bias is None else kernel.bias]
        self.weights = weights
        self.sliding_windows = [layer.self_attn.attn.sliding_window or 0 for layer in model.layers]
        self._ready: bool | None = None  # attention impls are bound after loading: checked later
        self._path: int | None = None  # their kernel path (kvik_cpu.isa), passed on to the kernel

    @staticmethod
    def supports(model) -> bool:
        """Whether ``model`` (a LlamaModel, packed) is made of exactly the parts the C++ loop runs."""
        from kvik_models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

        layers = list(getattr(model, "layers", []))
        if not layers or not isinstance(getattr(model, "norm", None), RMSNorm):
            return False
        first = layers[0].self_attn
        for layer in layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if not (
                type(layer).forward is LlamaDecoderLayer.forward
                and isinstance(attn, LlamaAttention)
                and type(attn).forward is LlamaAttention.forward
                and type(attn).qkv is LlamaAttention.qkv
                and type(mlp).forward is LlamaMLP.forward
                and type(mlp.act_fn) is SiluAndMul
                and all(
                    isinstance(m.kernel, AmxLinear)
                    for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
                )
                and attn.rotary_emb is first.rotary_emb
                and attn.attn.scale == first.attn.scale
                and attn.rotary_emb._rotary_embedding is torch.ops.kvik.rotary_embedding
                and all(
                    n.eps == model.norm.eps
                    for n in (layer.input_layernorm, layer.post_attention_layernorm)
                )
            ):
                return False
        return True

    def __call__(self, embedded: Tensor, positions: Tensor, metadata: object) -> Tensor | None:
        """The final hidden states, or None where this step must run layer by layer."""
        if type(metadata) is not PagedMetadata:
            return None
        layers = self.model.layers
        if self._ready is None:
            impls = [layer.self_attn.attn.impl for layer in layers]
            self._ready = all(type(impl) is CpuPagedImpl for impl in impls)
            self._path = int(impls[0].path) if self._ready else None
        if not self._ready:
            return None
        return torch.ops.kvik_cpu.llama_decode_layers(
            embedded,
            positions,
            self.weights,
            self.model.norm.weight,
            self.eps,
            self.rotary.cos_sin_cache,
            self.rotary.is_neox,
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            self.intermediate_size,
            [layer.self_attn.attn.kv_cache for layer in layers],
            self.sliding_windows,
            self.scale,
            metadata.common.slot_mapping,
            metadata.block_table,
            metadata.token_request,
            metadata.token_position,
            self._path,
        )


class CpuStepRunner(StepRunner):
    """Decode-only steps of a supported Llama-family model through ``DecodeLayers``; every other
    step (prompt chunks, mixed steps, other models) eagerly, layer by layer."""

    name = "cpu_decode_layers"

    def __init__(self, runner) -> None:
        super().__init__(runner)
        inner = getattr(self.model, "model", None)
        self.decode_layers = (
            DecodeLayers(inner) if inner is not None and DecodeLayers.supports(inner) else None
        )

    def forward_hidden(self, inputs) -> Tensor:
        if self.decode_layers is not None:
            embedded = self.model.model.embed_tokens(inputs.input_ids)
            hidden = self.decode_layers(embedded, inputs.positions, inputs.attn_metadata)
            if hidden is not None:
                return hidden
        return super().forward_hidden(inputs)
