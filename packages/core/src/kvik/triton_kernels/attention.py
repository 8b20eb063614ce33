"""The Triton attention backend ("TRITON_ATTN"): the paged KV cache write and mixed-batch paged
attention as Triton kernels, over the same cache layout as the CPU backend."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from kvik.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
)
from kvik_cuda.kernels.kv_cache import reshape_and_cache
from kvik_cuda.kernels.paged_attention import (
    MAX_KV_SPLITS,
    attention_config,
    num_kv_splits,
    paged_attention,
)


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


@dataclass
class TritonMetadata:
    """The common metadata, and the launch choices that depend only on the step's shape."""

    common: AttentionMetadata
    arch: str
    #: Split-KV segments for a decode-only step: from the (padded) request count and
    #: max_model_len, never from this step's sequence lengths, so a replayed graph's choice holds.
    num_splits: int
    #: fp32 scratch views for split-KV partial results, from buffers allocated once (None: 1 split).
    part_acc: Tensor | None
    part_max: Tensor | None
    part_sum: Tensor | None


class TritonMetadataBuilder(AttentionMetadataBuilder):
    """Owns the split-KV scratch, sized for ``max_num_seqs`` decode tokens at the largest split
    count, shared by every layer (they run one after another)."""

    def __init__(self, backend: type[AttentionBackend], spec: AttentionSpec) -> None:
        super().__init__(backend, spec)
        self.arch, self.num_sms = device_arch(spec.device)
        head_pad = 1 << (spec.head_size - 1).bit_length()
        f32 = {"dtype": torch.float32, "device": spec.device}
        rows = spec.max_num_seqs * spec.num_heads * MAX_KV_SPLITS
        self.part_acc = torch.empty(rows * head_pad, **f32)
        self.part_max = torch.empty(rows, **f32)
        self.part_sum = torch.empty(rows, **f32)
        self.head_pad = head_pad

    def build(self, common: AttentionMetadata) -> TritonMetadata:
        splits = 1
        if common.max_query_len == 1:
            splits = num_kv_splits(
                common.num_reqs, self.spec.num_kv_heads, self.spec.max_model_len, self.num_sms
            )
        if splits == 1:
            return TritonMetadata(common, self.arch, 1, None, None, None)
        t, h = common.num_actual_tokens, self.spec.num_heads
        n = t * h * splits
        return TritonMetadata(
            common,
            self.arch,
            splits,
            self.part_acc[: n * self.head_pad].view(t, h, splits, self.head_pad),
            self.part_max[:n].view(t, h, splits),
            self.part_sum[:n].view(t, h, splits),
        )


class TritonAttentionImpl(AttentionImpl):
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        metadata: TritonMetadata,
        output: Tensor,
    ) -> None:
        c = metadata.common
        t, h, hk, d = c.num_actual_tokens, self.num_heads, self.num_kv_heads, self.head_size
        reshape_and_cache(
            key[:t].view(t, hk, d), value[:t].view(t, hk, d), kv_cache, c.slot_mapping
        )
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
            attention_config(metadata.arch, d, h // hk, c.max_query_len, kv_cache.dtype),
            metadata.num_splits,
            metadata.part_acc,
            metadata.part_max,
            metadata.part_sum,
        )


class TritonAttentionBackend(AttentionBackend):
    name = "TRITON_ATTN"

    @classmethod
    def builder_class(cls) -> type[AttentionMetadataBuilder]:
        return TritonMetadataBuilder

    @classmethod
    def impl_class(cls) -> type[AttentionImpl]:
        return TritonAttentionImpl
