"""The first maximal index of each row, ``x [N, V] -> [N]`` int64: greedy sampling (and the
exponential race's draw) over a large vocabulary, one program per row.

Reference: ``kvik.ops.argmax`` (``x.max(dim=-1).indices``: the first maximum, NaN counted as the
largest value). PyTorch's reduction gives a lone row's output one block of threads; this kernel
also walks the row with one program, but with a whole block's worth of loads in flight per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def argmax_kernel(x_ptr, out_ptr, V, x_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK)
    # Lane l sees entries l, l + BLOCK, ...; it keeps its first maximum (strict comparison), and
    # its first NaN over any number.
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = lane
    for start in range(0, V, BLOCK):
        index = start + lane
        x = tl.load(x_ptr + row * x_stride + index, mask=index < V, other=float("-inf"))
        x = x.to(tl.float32)
        better = (x > best) | ((x != x) & (best == best))
        best = tl.where(better, x, best)
        best_index = tl.where(better, index, best_index)
    # Across lanes: the smallest index holding a NaN if there is one, else holding the maximum.
    is_nan = best != best
    first_nan = tl.min(tl.where(is_nan, best_index, V), axis=0)
    top = tl.max(tl.where(is_nan, float("-inf"), best), axis=0)
    first_top = tl.min(tl.where((best == top) & ~is_nan, best_index, V), axis=0)
    tl.store(out_ptr + row, tl.where(first_nan < V, first_nan, first_top).to(tl.int64))


ARGMAX_BLOCK = 4096
ARGMAX_WARPS = 8


def argmax(x: Tensor) -> Tensor:
    """x [N, V] (rows contiguous) -> the first maximal index of each row, [N] int64."""
    assert x.dim() == 2 and x.stride(-1) == 1
    n, v = x.shape
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    if n > 0 and v > 0:
        argmax_kernel[(n,)](x, out, v, x.stride(0), BLOCK=ARGMAX_BLOCK, num_warps=ARGMAX_WARPS)
    return out
