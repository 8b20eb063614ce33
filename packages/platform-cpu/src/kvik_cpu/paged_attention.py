"""The CPU's default attention backend: decode tokens in a C++ kernel that reads the paged cache in
place, prompt chunks in PyTorch's SDPA.

``kvik_cpu::paged_attention`` (csrc/paged_attention.cpp) writes a step's keys and values into the
cache and attends each token over its context in one call per layer, with no gathered copy of the
context: at batch 1 it is several times faster than SDPA, mostly through the calls it saves
(docs/benchmarks.md). It attends one query token at a time, though, so for prompt chunks (many
query tokens per request) SDPA's flash attention, built on matrix products, is faster: prompt
chunks go through the SDPA backend's path (kvik_cpu.attention). A step that holds both is split by
rows, so that a decode token is computed by the same kernel whatever else its step holds (the two
round differently in bf16, and a request's output should not depend on its batch). A speculative
verification's tokens (``AttentionMetadata.decode_requests``: the newest token and its drafts)
are decodes too, each attending up to its own position, so that greedy outputs do not depend on
whether speculation is on. The kernel runs float32 and bfloat16, in bfloat16 on the engine's
kernel path (kvik_cpu.isa: portable loops, AVX512-BF16, or AMX scores); the backend is
unavailable, and TORCH_SDPA chosen instead, where it cannot be built (kvik_cpu.extension). An FP8
KV cache (``--kv-cache-dtype fp8``) is written and read by the same kernel (its portable loops),
dequantized as it reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvik.attention.backend import AttentionImpl, AttentionMetadata
from kvik.attention.kv_quant import FP8_E4M3, write_slots
from kvik_cpu import isa
from kvik_cpu.attention import SdpaMetadata, TorchSdpaBackend, TorchSdpaImpl


@dataclass
class PagedMetadata:
    """The metadata of decode tokens, for the C++ kernel."""

    common: AttentionMetadata
    block_table: Tensor  # [R, max_blocks] int32, contiguous
    token_request: Tensor  # [T] int32: the request (row of block_table) of each token
    token_position: Tensor  # [T] int32: each token's position in its sequence


@dataclass
class MixedMetadata:
    """A step with both decodes and prompt chunks: each part runs on its own rows, so a decode
    token meets the same kernel whatever else its step holds."""

    decode_rows: Tensor  # [Nd] flat token indices of the decode tokens
    decode: PagedMetadata
    prompt_rows: Tensor  # [Np] flat token indices of the prompt tokens
    prompt: SdpaMetadata


class CpuPagedImpl(TorchSdpaImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from kvik_cpu import extension

        if (failure := extension.load()) is not None:
            raise RuntimeError(f"kvik_cpu's paged attention kernel did not build: {failure}")
        #: The highest kernel path the kernel may take (read when the engine builds its layers).
        self.path = isa.engine_isa()

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
        if isinstance(metadata, MixedMetadata):
            # The prompt chunks' keys and values go into the cache before any decode token
            # attends: a decode row may read blocks that a prompt chunk of this very step computes
            # (a prefix-cache hit on them, as a prompt's n > 1 completions have, which leaves one
            # token to compute). The SDPA path writes them again, unchanged, before it attends.
            self._write_cache(key, value, kv_cache, metadata.prompt_rows, metadata.prompt)
            for rows, part in (
                (metadata.decode_rows, metadata.decode),
                (metadata.prompt_rows, metadata.prompt),
            ):
                q, k, v = (x.index_select(0, rows) for x in (query, key, value))
                out = torch.empty_like(q)
                self.forward(q, k, v, kv_cache, part, out)
                output.index_copy_(0, rows, out)
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
            int(self.path),
            output,
            self.k_scale,
            self.v_scale,
        )

    def _write_cache(
        self, key: Tensor, value: Tensor, kv_cache: Tensor, rows: Tensor, part: SdpaMetadata
    ) -> None:
        """The keys and values of ``rows`` (a part's tokens, in its order) into their slots."""
        flat = kv_cache.view(2, kv_cache.shape[1] * kv_cache.shape[2], -1)
        slots = part.common.slot_mapping
        write_slots(flat[0], slots, key.index_select(0, rows).flatten(1), self.k_scale)
        write_slots(flat[1], slots, value.index_select(0, rows).flatten(1), self.v_scale)


class CpuPagedBackend(TorchSdpaBackend):
    name = "CPU_PAGED"
    supported_dtypes = (torch.float32, torch.bfloat16)
    supported_kv_cache_dtypes = (FP8_E4M3,)

    @classmethod
    def unsupported_reason(cls, dtype: torch.dtype, head_size: int, block_size: int) -> str | None:
        reason = super().unsupported_reason(dtype, head_size, block_size)
        if reason is None:
            from kvik_cpu import extension

            if (failure := extension.load()) is not None:
                reason = f"its C++ kernel did not build: {failure}"
        return reason

    @classmethod
    def build_metadata(
        cls, common: AttentionMetadata
    ) -> PagedMetadata | SdpaMetadata | MixedMetadata:
        if common.max_query_len == 1:
            return cls._decode_metadata(common)
        is_decode = common.query_lens == 1
        if common.decode_requests is not None:
            is_decode = common.decode_requests[: common.num_reqs]
        if not bool(is_decode.any()):
            return super().build_metadata(common)
        if bool(is_decode.all()):
            return cls._decode_metadata(common)
        token_is_decode = torch.repeat_interleave(is_decode, common.query_lens.long())
        return MixedMetadata(
            decode_rows=token_is_decode.nonzero().flatten(),
            decode=cls._decode_metadata(_requests(common, is_decode, token_is_decode)),
            prompt_rows=(~token_is_decode).nonzero().flatten(),
            prompt=super().build_metadata(_requests(common, ~is_decode, ~token_is_decode)),
        )

    @classmethod
    def _decode_metadata(cls, common: AttentionMetadata) -> PagedMetadata:
        """For requests whose query tokens are decodes: one each (token r is request r's, at
        position seq_lens[r] - 1), or a verification's few, each attending up to its own
        position (the kernel writes every new key before it attends)."""
        block_table = common.block_table.to(torch.int32).contiguous()
        if common.max_query_len == 1:
            return PagedMetadata(
                common=common,
                block_table=block_table,
                token_request=torch.arange(common.num_reqs, dtype=torch.int32),
                token_position=(common.seq_lens - 1).to(torch.int32),
            )
        query_lens = common.query_lens.long()
        token_request = torch.repeat_interleave(torch.arange(common.num_reqs), query_lens)
        first = (common.seq_lens - common.query_lens).long()
        start = common.query_start_loc[: common.num_reqs].long()
        offset = torch.arange(int(query_lens.sum())) - start[token_request]
        return PagedMetadata(
            common=common,
            block_table=block_table,
            token_request=token_request.to(torch.int32),
            token_position=(first[token_request] + offset).to(torch.int32),
        )

    @classmethod
    def impl_class(cls) -> type[AttentionImpl]:
        return CpuPagedImpl


def _requests(common: AttentionMetadata, keep: Tensor, token_keep: Tensor) -> AttentionMetadata:
    """The common metadata of the requests ``keep`` selects, their tokens renumbered from 0."""
    query_lens = common.query_lens[keep]
    seq_lens = common.seq_lens[keep]
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    torch.cumsum(query_lens, 0, out=query_start_loc[1:])
    return AttentionMetadata(
        num_actual_tokens=int(query_start_loc[-1]),
        num_reqs=len(query_lens),
        query_start_loc=query_start_loc,
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_table=common.block_table[keep],
        slot_mapping=common.slot_mapping[: len(token_keep)][token_keep],
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_size=common.block_size,
    )
