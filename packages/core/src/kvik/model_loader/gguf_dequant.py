"""GGUF tensors to float32: llama.cpp's legacy block types (Q8_0, Q4_0, Q4_1) in torch, every other
type through gguf's own numpy ``dequantize``.

gguf's numpy dequantizer works a group of rows at a time in one thread: 2.1 s of each engine start
for the default model (Q4_1 and Q8_0); torch does the same arithmetic in whole-tensor operations
on every core. Results are bit for bit gguf's (the same float32 products and sums, in the same
order), which the tests check.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize


def _halves(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 stored at byte ``start`` of each block, as a float32 column."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The 32 4-bit values of each block: the 16 bytes' low nibbles, then their high ones."""
    packed = blocks[:, start : start + 16]
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _halves(blocks, 0)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _halves(blocks, 0) * (_nibbles(blocks, 2).to(torch.int8) - 8).float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _halves(blocks, 0) * _nibbles(blocks, 4).float() + _halves(blocks, 2)


_TORCH_DEQUANTIZERS = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
}


def dequantize(data: np.ndarray, kind: GGMLQuantizationType) -> torch.Tensor:
    """``data`` (a GGUFFile tensor's: elements, or each row's block bytes) as a float32 tensor of
    the elements' shape; F16/F32 and other element types keep their dtype, as gguf's do."""
    if kind not in _TORCH_DEQUANTIZERS:
        array = gguf_dequantize(data, kind)
        # the data of passthrough types is a read-only view of the memory-mapped file
        return torch.from_numpy(np.require(array, requirements="CW"))
    block_size, type_size = GGML_QUANT_SIZES[kind]
    raw = torch.from_numpy(np.array(data, copy=True))  # out of the read-only file mapping
    values = _TORCH_DEQUANTIZERS[kind](raw.view(-1, type_size))
    return values.reshape(*data.shape[:-1], data.shape[-1] // type_size * block_size)
