"""The experts of a mixture-of-experts layer on the CPU's packed-weight kernels.

``PackedExperts`` is the ``kernel`` a bf16 ``FusedMoE`` gets at load time (``pack_expert_weights``,
from ``CpuPlatform.prepare_model``): each expert's gate/up and down projections packed once for
the matrix kernel of the engine's path (kvik_cpu.linear: ``AmxLinear`` on AMX, else
``Avx512Bf16Linear`` where the C++ ops built, else ``OneDnnLinear``; an expert's few rows in a
decode step cost oneDNN more per call than reading its weights takes), and
the step's tokens gathered per expert with index ops, as ``kvik.ops.grouped_experts`` does for the
reference: one loop over the experts that have tokens, none over tokens. On ``Avx512Bf16Linear``
all of it after the routing is one C++ call (``kvik_cpu::bf16_moe``, the same bits).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvik.layers.moe import FusedMoE
from kvik.ops import grouped_experts, moe_routing
from kvik.quantization.moe_methods import UnquantizedMoeMethod
from kvik_cpu.isa import CpuIsa
from kvik_cpu.linear import AmxLinear, Avx512Bf16Linear, OneDnnLinear, avx512_bf16_linear_runs


def expert_product(path: CpuIsa) -> type[AmxLinear] | type[Avx512Bf16Linear] | type[OneDnnLinear]:
    """The matrix kernel experts are packed for on kernel path ``path`` (avx512bf16 or amx)."""
    if path >= CpuIsa.AMX:
        return AmxLinear
    return Avx512Bf16Linear if avx512_bf16_linear_runs() else OneDnnLinear


class PackedExperts:
    def __init__(self, layer: FusedMoE, path: CpuIsa) -> None:
        kernel = expert_product(path)
        self.top_k, self.renormalize = layer.top_k, layer.renormalize
        self.gate_up = [kernel(w.contiguous(), None) for w in layer.gate_up_proj.detach()]
        self.down = [kernel(w.contiguous(), None) for w in layer.down_proj.detach()]
        # The C++ kernel where kvik_cpu's ops built (registered for torch.ops.kvik), else the
        # reference: the same op the dense MLPs call.
        self.silu_and_mul = torch.ops.kvik.silu_and_mul

        # AVX512-BF16 experts run in one C++ call (csrc/bf16_linear.cpp: the same kernels).
        self.in_one_call = kernel is Avx512Bf16Linear
        if self.in_one_call:
            self.gate_up_packed = [p.weight for p in self.gate_up]
            self.down_packed = [p.weight for p in self.down]
            self.intermediate = layer.intermediate_size

    def expert(self, e: int, x: Tensor) -> Tensor:
        return self.down[e](self.silu_and_mul(self.gate_up[e](x)))

    def all_experts(self, rows: Tensor, counts: list[int]) -> Tensor:
        return torch.ops.kvik_cpu.bf16_moe_experts(
            rows, counts, self.gate_up_packed, self.down_packed, self.intermediate
        )

    def __call__(self, hidden: Tensor, router_logits: Tensor) -> Tensor:
        if self.in_one_call:
            # After the routing, the rest of grouped_experts in one C++ call too (its grouping,
            # gather and weighted sum, the same bits): a decode step of a small MoE spent about
            # a tenth of its time in those ops (docs/benchmarks.md).
            weights, ids = moe_routing(router_logits, self.top_k, self.renormalize)
            return torch.ops.kvik_cpu.bf16_moe(
                hidden, weights, ids, self.gate_up_packed, self.down_packed, self.intermediate
            )
        return grouped_experts(hidden, router_logits, self.top_k, self.renormalize, self.expert)


def pack_expert_weights(model: nn.Module, path: CpuIsa) -> int:
    """Give each unquantized ``FusedMoE`` of ``model`` its ``PackedExperts`` and release the dense stacks
    (only the packed copies are read). Returns how many layers were packed."""
    packed = 0
    for module in model.modules():
        # Quantized experts keep their method's kernels.
        if isinstance(module, FusedMoE) and isinstance(module.quant_method, UnquantizedMoeMethod):
            module.kernel = PackedExperts(module, path)
            for param in (module.gate_up_proj, module.down_proj):
                param.data = param.data.new_empty(0)
            packed += 1
    return packed
