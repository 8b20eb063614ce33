"""The CPU's KV cache in anonymous memory: zeros to every reader, resident only where written, and
unmapped once the tensor is freed (the engine's shutdown drops the cache; a leak here would hold
gigabytes)."""

from __future__ import annotations

import gc

import pytest
import torch

from kvik_cpu.platform import CpuPlatform

GIB = 1024**3


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_the_cache_reads_as_zeros_and_takes_writes(dtype: torch.dtype) -> None:
    shape = (7, 2, 16, 3, 64)  # blocks, k/v, block size, heads, head size
    cache = CpuPlatform.zeroed_kv_cache(shape, dtype, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert cache.data_ptr() % 64 == 0  # page-aligned: the C++ kernels' vector loads
    assert not cache.float().any()
    values = torch.randn(shape).to(dtype)
    cache.copy_(values)
    assert torch.equal(cache.float(), values.float())


def test_an_empty_cache() -> None:
    cache = CpuPlatform.zeroed_kv_cache((0, 2, 16, 1, 8), torch.float32, torch.device("cpu"))
    assert cache.shape == (0, 2, 16, 1, 8)


def test_only_written_pages_are_resident_and_freeing_unmaps() -> None:
    gc.collect()
    before = resident_bytes()
    cache = CpuPlatform.zeroed_kv_cache((65536, 2, 16, 4, 64), torch.bfloat16, torch.device("cpu"))
    assert cache.numel() * 2 == GIB
    # torch.zeros wrote all of it: a gibibyte resident at once.
    assert resident_bytes() - before < GIB // 8
    cache[:8192].fill_(1.0)  # an eighth of the blocks
    touched = resident_bytes() - before
    assert GIB // 8 <= touched < GIB // 4
    view = cache[:4]  # a view keeps the memory too
    del cache
    gc.collect()
    assert resident_bytes() - before >= GIB // 8
    assert view.float().sum() == 4 * 2 * 16 * 4 * 64
    del view
    gc.collect()
    assert resident_bytes() - before < GIB // 16
