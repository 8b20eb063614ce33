"""The Triton attention backend ("TRITON_ATTN"): the paged KV cache write and mixed-batch paged
attention as Triton kernels, over the same cache layout as the CPU backend."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kvik.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadata
from kvik_cuda.kernels.kv_cache import reshape_and_cache
from kvik_cuda.kernels.paged_attention import attention_config, num_kv_splits, paged_attention


@functools.cache
def device_arch(device: torch.device) -> tuple[str, int]:
    """(architecture, multiprocessor count): ("sm90", 132) on an H200, ("gfx942", 304) on an
    MI300X; CPU tensors only reach the kernels under the Triton interpreter."""
    if device.type == "cpu":
        return "interpreter", 1
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip is not None:
        return props.gcnArchName.split(":")[0], props.multi_processor_count
    return f"sm{props.major}{props.minor}", props.multi_processor_count


class TritonAttentionImpl(AttentionImpl):
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        metadata: AttentionMetadata,
        output: Tensor,
    ) -> None:
        c = metadata
        t, h, hk, d = c.num_actual_tokens, self.num_heads, self.num_kv_heads, self.head_size
        reshape_and_cache(
            key[:t].view(t, hk, d), value[:t].view(t, hk, d), kv_cache, c.slot_mapping
        )
        arch, num_sms = device_arch(query.device)
        splits = 1
        if c.max_query_len == 1:
            splits = num_kv_splits(c.num_reqs, hk, c.max_seq_len, num_sms)
        paged_attention(
            query[:t].view(t, h, d),
            kv_cache[0],
            kv_cache[1],
            output[:t].view(t, h, d),
            c.query_start_loc,
            c.seq_lens,
            c.block_table,
            self.scale,
            self.sliding_window,
            attention_config(arch, d, h // hk, c.max_query_len, kv_cache.dtype),
            splits,
        )


class TritonAttentionBackend(AttentionBackend):
    name = "TRITON_ATTN"

    @classmethod
    def impl_class(cls) -> type[AttentionImpl]:
        return TritonAttentionImpl
