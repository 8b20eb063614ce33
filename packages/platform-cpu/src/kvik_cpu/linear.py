"""Matrix products with each bf16 weight packed once, at load time, for the CPU's fastest kernel.

At decode batch sizes (1 to a few dozen rows) a step's matrix products are bound by reading the
weights once. Two packings:

- ``AmxLinear`` (csrc/amx_linear.cpp): Intel AMX tiles over weights in AMX's own layout, one
  contiguous run per 32 output columns. It reads the weights close to the memory's speed, faster
  than oneDNN at decode batch sizes (docs/benchmarks.md), and a row's result does not depend on the
  other rows of the call.
- ``Avx512Bf16Linear`` (csrc/bf16_linear.cpp): AVX512-BF16 dot products over AMX's packing, for
  CPUs with bf16 but no AMX, where the C++ ops built: the dense layers and the mixture-of-experts
  layers' experts (kvik_cpu.moe). At decode batch sizes oneDNN's kernels spend more per call than
  reading the weights takes (docs/benchmarks.md). The LM head's logits come out as the fp32 sums:
  rounded to bf16 (a step of 0.125 between 16 and 32) two logits closer than that tie, and greedy
  decoding then takes the lower token id. The default model's answer to "What is the capital of
  France?" starts with such a pair ("The" 25.55, "L" 25.48), and rounded it read "L'Étoile, la
  Marseillaise, ...".
- ``OneDnnLinear``: oneDNN's blocked layout (reordered once instead of on every ``F.linear`` call),
  for the avx512bf16 path (CPUs with bf16 but no AMX, or forced there: kvik_cpu.isa). Same bits as
  ``F.linear``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvik.layers.embedding import LMHead, VocabEmbedding
from kvik.quantization.kernels import UNQUANTIZED, LinearKernel
from kvik_cpu.isa import CpuIsa

#: The batch size oneDNN chooses its weight layout for. Layouts for 1, 32 and 512 rows differ
#: little at decode batch sizes (docs/benchmarks.md); 32 is the middle of a decode batch's range.
BATCH_SIZE_HINT = 32


def packed_linear_supported(dtype: torch.dtype) -> bool:
    return (
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        # private op: no public torch API says whether oneDNN runs bf16 on this CPU
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class AmxLinear:
    """y = x W^T + b on AMX tiles; W packed by ``kvik_cpu::amx_pack``."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        self.out_features = weight.shape[0]
        self.weight = torch.ops.kvik_cpu.amx_pack(weight.detach())
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = torch.ops.kvik_cpu.amx_linear(rows, self.weight, self.out_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


class Avx512Bf16Linear:
    """y = x W^T + b in AVX512-BF16; W packed by ``kvik_cpu::amx_pack`` (needs the C++ ops:
    ``avx512_bf16_linear_runs``). y is bf16, or with ``fp32_out`` the fp32 sums unrounded."""

    def __init__(self, weight: Tensor, bias: Tensor | None, fp32_out: bool = False) -> None:
        self.out_features = weight.shape[0]
        self.weight = torch.ops.kvik_cpu.amx_pack(weight.detach())
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.fp32_out = fp32_out

    def __call__(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = torch.ops.kvik_cpu.bf16_linear(
            rows, self.weight, self.out_features, self.bias, self.fp32_out
        )
        return y.view(*x.shape[:-1], self.out_features)


def avx512_bf16_linear_runs() -> bool:
    """Whether kvik_cpu's C++ ops built here with AVX512-BF16 (what ``Avx512Bf16Linear`` runs)."""
    from kvik_cpu import extension

    return extension.load() is None and torch.ops.kvik_cpu.built_isa() >= CpuIsa.AVX512BF16


class OneDnnLinear:
    """y = x W^T + b, W held in oneDNN's layout (an opaque ``mkldnn`` tensor).

    Through torch's private ``mkldnn._reorder_linear_weight`` and ``_linear_pointwise`` ops (those
    TorchInductor's CPU backend uses): no public torch API keeps a weight prepacked between calls.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        self.out_features = weight.shape[0]
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_SIZE_HINT)
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: Tensor) -> Tensor:
        if x.shape[0] == 0:  # oneDNN refuses empty inputs
            return x.new_empty(0, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


Product = AmxLinear | Avx512Bf16Linear | OneDnnLinear


class PackedLinearKernel(LinearKernel):
    """The CPU's kernel of the unquantized scheme: the weight packed once after loading
    (``AmxLinear``, ``Avx512Bf16Linear`` or ``OneDnnLinear``), the product on the packed copy.

    A linear layer's dense weight is then released (only the packed copy is read); an
    embedding-shaped layer (the LM head) keeps it, since a tied embedding looks tokens up in it.
    On ``Avx512Bf16Linear`` the LM head's logits are fp32 (the module's docstring says why)."""

    scheme = UNQUANTIZED

    def __init__(self, product: type[Product]) -> None:
        self.product_class = product
        self.packed: Product | None = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        bias = getattr(layer, "bias", None)
        if self.product_class is Avx512Bf16Linear and isinstance(layer, LMHead):
            self.packed = Avx512Bf16Linear(layer.weight, bias, fp32_out=True)
        else:
            self.packed = self.product_class(layer.weight, bias)
        if not isinstance(layer, VocabEmbedding):
            layer.weight.data = layer.weight.data.new_empty(0)

    def apply(self, layer: nn.Module, x: Tensor) -> Tensor:
        return self.packed(x)

    def __repr__(self) -> str:
        return f"PackedLinearKernel({self.product_class.__name__})"


def packed_linear_kernel(layer: nn.Module, path: CpuIsa) -> PackedLinearKernel | None:
    """The packed kernel of an unquantized layer on kernel path ``path``: AMX on the amx path,
    AVX512-BF16 (oneDNN where the C++ ops did not build) on avx512bf16, none on plain (F.linear:
    what a CPU without native bf16 runs) or where oneDNN cannot run the weight's dtype."""
    if path < CpuIsa.AVX512BF16 or not packed_linear_supported(layer.weight.dtype):
        return None
    if path >= CpuIsa.AMX:
        return PackedLinearKernel(AmxLinear)
    return PackedLinearKernel(Avx512Bf16Linear if avx512_bf16_linear_runs() else OneDnnLinear)
