"""Decode steps of Llama-family models in one C++ call (csrc/decode_layers.cpp): the CPU's step
runner.

At decode batch sizes a layer's kernels are short, and the Python around them (module calls,
views, dispatch: about 35 calls a layer) costs about as much (docs/benchmarks.md).
``DecodeLayers`` runs all the decoder layers of a decode-only step as one call of the same kernels
in the same order, so the tokens are the same bits as the layer-by-layer path; the CPU's analogue
of a CUDA graph for decode.
``CpuStepRunner`` (the CPU platform's implementation of kvik.worker.step_runner's seam) uses it for
the steps it covers and runs the model's layers otherwise.

It reaches the model only through ``kvik.models.decoder_stack``: a model that offers a
``DecoderStack`` (kvik_models' Llama, Mistral, Qwen2, SmolLM) declares that its layers compute the
pre-norm decoder the C++ loop computes. It applies when, in addition, every matmul runs on AMX
(kvik_cpu.linear.AmxLinear), the small ops have their C++ kernels, and attention is CPU_PAGED; any
other step (prompt chunks, a mixed step) or model runs layer by layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvik.models.decoder_stack import DecoderStack, decoder_stack
from kvik.worker.step_runner import StepRunner
from kvik_cpu.linear import AmxLinear, PackedLinearKernel
from kvik_cpu.paged_attention import CpuPagedImpl, PagedMetadata


def _amx_packed(linear) -> AmxLinear | None:
    """A linear layer's AMX-packed weights, where its method runs on them (the CPU's kernel of the
    unquantized method after packing), else None."""
    kernel = getattr(linear.quant_method, "kernel", None)
    if isinstance(kernel, PackedLinearKernel) and isinstance(kernel.packed, AmxLinear):
        return kernel.packed
    return None


def _linear_weights(linear) -> list[Tensor]:
    """An AMX-packed linear's weight and bias (an empty tensor for none), as the C++ loop takes them."""
    packed = _amx_packed(linear)
    return [packed.weight, torch.empty(0) if packed.bias is None else packed.bias]


class DecodeLayers:
    """The decoder layers and final norm of a model's ``DecoderStack``, for a decode-only step,
    in one call."""

    def __init__(self, stack: DecoderStack) -> None:
        self.stack = stack
        first = stack.layers[0].attention
        self.num_heads = first.num_heads
        self.num_kv_heads = first.num_kv_heads
        self.head_size = first.head_size
        self.scale = first.scale
        self.intermediate_size = stack.layers[0].gate_up_proj.out_features // 2
        self.eps = stack.final_norm.eps
        self.rotary = stack.rotary
        weights: list[Tensor] = []
        for layer in stack.layers:
            weights.append(layer.input_norm.weight.detach())
            for linear in (layer.qkv_proj, layer.o_proj):
                weights += _linear_weights(linear)
            weights.append(layer.post_attention_norm.weight.detach())
            for linear in (layer.gate_up_proj, layer.down_proj):
                weights += _linear_weights(linear)
        self.weights = weights
        self.sliding_windows = [layer.attention.sliding_window or 0 for layer in stack.layers]
        self._ready: bool | None = None  # attention impls are bound after loading: checked later
        self._path: int | None = None  # their kernel path (kvik_cpu.isa), passed on to the kernel

    @staticmethod
    def supports(stack: DecoderStack) -> bool:
        """Whether the C++ loop can run ``stack`` (its model's layers, packed): every linear on
        AMX, rope through the op that has a C++ kernel, one scale and one norm epsilon."""
        first = stack.layers[0].attention if stack.layers else None
        return first is not None and (
            stack.rotary._rotary_embedding is torch.ops.kvik.rotary_embedding
            and all(
                _amx_packed(linear) is not None
                and layer.attention.scale == first.scale
                and layer.input_norm.eps == layer.post_attention_norm.eps == stack.final_norm.eps
                for layer in stack.layers
                for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
            )
        )

    def __call__(self, embedded: Tensor, positions: Tensor, metadata: object) -> Tensor | None:
        """The final hidden states, or None where this step must run layer by layer."""
        if type(metadata) is not PagedMetadata:
            return None
        layers = self.stack.layers
        if self._ready is None:
            impls = [layer.attention.impl for layer in layers]
            self._ready = all(type(impl) is CpuPagedImpl for impl in impls)
            self._path = int(impls[0].path) if self._ready else None
        if not self._ready:
            return None
        return torch.ops.kvik_cpu.llama_decode_layers(
            embedded,
            positions,
            self.weights,
            self.stack.final_norm.weight,
            self.eps,
            self.rotary.cos_sin_cache,
            self.rotary.is_neox,
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            self.intermediate_size,
            [layer.attention.kv_cache for layer in layers],
            self.sliding_windows,
            [layer.attention.k_scale for layer in layers],  # used where the KV cache is FP8
            [layer.attention.v_scale for layer in layers],
            self.scale,
            metadata.common.slot_mapping,
            metadata.block_table,
            metadata.token_request,
            metadata.token_position,
            self._path,
        )


class CpuStepRunner(StepRunner):
    """Decode-only steps of a model that offers a supported ``DecoderStack`` through
    ``DecodeLayers``; every other step (prompt chunks, mixed steps, other models) eagerly, layer
    by layer."""

    name = "cpu_decode_layers"

    def __init__(self, runner) -> None:
        super().__init__(runner)
        stack = decoder_stack(self.model)
        self.decode_layers = (
            DecodeLayers(stack) if stack is not None and DecodeLayers.supports(stack) else None
        )

    def run_layers_in_python(self) -> None:
        super().run_layers_in_python()
        # The one-call decode runs the whole stack in C++: module hooks would not see its steps.
        self.decode_layers = None

    def forward_hidden(self, inputs) -> Tensor:
        if self.decode_layers is not None:
            embedded = self.decode_layers.stack.embed_tokens(inputs.input_ids)
            hidden = self.decode_layers(embedded, inputs.positions, inputs.attn_metadata)
            if hidden is not None:
                return hidden
        return super().forward_hidden(inputs)
