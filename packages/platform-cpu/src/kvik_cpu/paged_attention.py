"""The CPU's default attention backend: decode steps in a C++ kernel that reads the paged cache in
place, steps with prompt tokens in PyTorch's SDPA.

``kvik_cpu::paged_attention`` (csrc/paged_attention.cpp) writes a step's keys and values into the
cache and attends each token over its context in one call per layer, with no gathered copy of the
context: at batch 1 a layer's attention costs about 40 us against SDPA's 100 us, mostly the calls
saved. It attends one query token at a time, though, so for prompt chunks (many query tokens per
request) SDPA's flash attention, built on matrix products, is about three times faster: a step that
holds any prompt tokens uses the SDPA backend's path (kvik_cpu.attention) for every request. The
kernel runs float32 and bfloat16; the backend is unavailable, and TORCH_SDPA chosen instead, where
it cannot be built (kvik_cpu.extension).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvik.attention.backend import AttentionImpl, AttentionMetadata
from kvik_cpu.attention import SdpaMetadata, TorchSdpaBackend, TorchSdpaImpl


@dataclass
class PagedMetadata:
    """A decode-only step's metadata (steps with prompt tokens get the SDPA backend's)."""

    common: AttentionMetadata
    block_table: Tensor  # [R, max_blocks] int32, contiguous
    token_request: Tensor  # [T] int32: the request (row of block_table) of each token
    token_position: Tensor  # [T] int32: each token's position in its sequence


class CpuPagedImpl(TorchSdpaImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from kvik_cpu import extension

        if (failure := extension.load()) is not None:
            raise RuntimeError(f"kvik_cpu's paged attention kernel did not build: {failure}")

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        metadata: PagedMetadata | SdpaMetadata,
        output: Tensor,
    ) -> None:
        if isinstance(metadata, SdpaMetadata):
            super().forward(query, key, value, kv_cache, metadata, output)
            return
        torch.ops.kvik_cpu.paged_attention(
            query,
            key,
            value,
            kv_cache,
            metadata.common.slot_mapping,
            metadata.block_table,
            metadata.token_request,
            metadata.token_position,
            self.scale,
            self.sliding_window or 0,
            output,
        )


class CpuPagedBackend(TorchSdpaBackend):
    name = "CPU_PAGED"
    supported_dtypes = (torch.float32, torch.bfloat16)

    @classmethod
    def unsupported_reason(cls, dtype: torch.dtype, head_size: int, block_size: int) -> str | None:
        reason = super().unsupported_reason(dtype, head_size, block_size)
        if reason is None:
            from kvik_cpu import extension

            if (failure := extension.load()) is not None:
                reason = f"its C++ kernel did not build: {failure}"
        return reason

    @classmethod
    def build_metadata(cls, common: AttentionMetadata) -> PagedMetadata | SdpaMetadata:
        if common.max_query_len > 1:
            return super().build_metadata(common)
        num_tokens = common.num_actual_tokens
        token_request = torch.repeat_interleave(
            torch.arange(common.num_reqs, dtype=torch.int32), common.query_lens.long()
        )
        first_position = (common.seq_lens - common.query_lens)[token_request]
        offset = torch.arange(num_tokens, dtype=torch.int32) - common.query_start_loc[token_request]
        return PagedMetadata(
            common=common,
            block_table=common.block_table.to(torch.int32).contiguous(),
            token_request=token_request,
            token_position=(first_position + offset).to(torch.int32),
        )

    @classmethod
    def impl_class(cls) -> type[AttentionImpl]:
        return CpuPagedImpl
