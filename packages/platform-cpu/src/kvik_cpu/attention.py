"""The CPU attention backend: PyTorch SDPA over the paged KV cache, the whole batch at once.

Each step gathers every request's context from its blocks into a padded [R, Hk, S, D] tensor and
pads the queries to [R, H, Q, D]; one boolean mask per distinct sliding window (shared by all layers)
encodes causality, context length and window. Padding costs some work on ragged batches but keeps
the hot path free of Python loops over requests.

Everything that depends only on the step (the flat block list, the query layout, the masks) is built
once per step in ``build_metadata``, not once per layer: a layer runs the cache write, the gather and
SDPA, about eight PyTorch calls. A step of decodes only (one query token per request) needs no query
padding, and a single request's context needs no mask at all. An FP8 KV cache is quantized as it is
written and dequantized after the gather (kvik.attention.kv_quant).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from kvik.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadata
from kvik.attention.kv_quant import FP8_E4M3, from_cache, is_fp8, write_slots


@dataclass
class SdpaMetadata:
    common: AttentionMetadata
    query_index: Tensor  # [R, Q] flat token index of each padded query slot (0 for padding)
    query_valid: Tensor  # [R, Q] bool
    query_pos: Tensor  # [R, Q] position of each query token in its sequence
    key_block_table: Tensor  # [R, ceil(S / block_size)]
    key_blocks: Tensor  # [R * ceil(S / block_size)] the same, flat, int64 for index_select
    #: One query token per request: queries need no padding (Q = 1, token r is request r's).
    decode_only: bool
    #: Keys to read in a single request's step, which then needs no mask (else None).
    single_request_len: int | None
    masks: dict[int | None, Tensor | None] = field(default_factory=dict)  # window -> [R,1,Q,S]

    def mask(self, sliding_window: int | None) -> Tensor | None:
        if sliding_window not in self.masks:
            c = self.common
            if self.single_request_len is not None and (
                sliding_window is None or self.single_request_len <= sliding_window
            ):
                # One request, one query token: it sees every key of its context.
                self.masks[sliding_window] = None
                return None
            s = self.key_block_table.shape[1] * c.block_size
            key_pos = torch.arange(s, dtype=torch.int32)  # [S]
            q_pos = self.query_pos.unsqueeze(-1)  # [R, Q, 1]
            allowed = key_pos <= q_pos
            if sliding_window is not None:
                allowed &= key_pos > q_pos - sliding_window
            # Padded query rows attend to key 0 only, so their (discarded) softmax stays finite.
            allowed |= (~self.query_valid).unsqueeze(-1) & (key_pos == 0)
            self.masks[sliding_window] = allowed.unsqueeze(1)
        return self.masks[sliding_window]


class TorchSdpaImpl(AttentionImpl):
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        metadata: SdpaMetadata,
        output: Tensor,
    ) -> None:
        c = metadata.common
        t, h, hk, d = c.num_actual_tokens, self.num_heads, self.num_kv_heads, self.head_size
        # The cache write (kvik.ops.reshape_and_cache without its op dispatch and padding check:
        # the CPU runner never pads, so every slot is valid).
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        flat = kv_cache.view(2, num_blocks * block_size, hk * d)
        write_slots(flat[0], c.slot_mapping, key[:t], self.k_scale)
        write_slots(flat[1], c.slot_mapping, value[:t], self.v_scale)

        r, nb = metadata.key_block_table.shape
        # index_select over flattened blocks is about twice as fast as advanced indexing here.
        # [R * nb, block * Hk * D] -> [R, Hk, S, D]
        k, v = (
            torch.index_select(kv_cache[i].flatten(1), 0, metadata.key_blocks)
            .view(r, nb * c.block_size, hk, d)
            .transpose(1, 2)
            for i in (0, 1)
        )
        if metadata.single_request_len is not None and metadata.mask(self.sliding_window) is None:
            k = k[:, :, : metadata.single_request_len]
            v = v[:, :, : metadata.single_request_len]
        if is_fp8(kv_cache.dtype):  # dequantized after the gather, which moves a byte an element
            k = from_cache(k, query.dtype, self.k_scale)
            v = from_cache(v, query.dtype, self.v_scale)
        if metadata.decode_only:
            q = query[:t].view(t, h, 1, d)  # [R, H, 1, D]
        else:
            q = query[:t].view(t, h, d)[metadata.query_index].transpose(1, 2)  # [R, H, Q, D]
        out = F.scaled_dot_product_attention(
            q.to(k.dtype),
            k,
            v,
            attn_mask=metadata.mask(self.sliding_window),
            scale=self.scale,
            enable_gqa=h != hk,
        )
        if metadata.decode_only:
            out = out.view(t, h * d)
        else:
            out = out.transpose(1, 2)[metadata.query_valid].reshape(t, h * d)  # token order
        output[:t].copy_(out)


class TorchSdpaBackend(AttentionBackend):
    name = "TORCH_SDPA"
    supported_kv_cache_dtypes = (FP8_E4M3,)

    @classmethod
    def build_metadata(cls, common: AttentionMetadata) -> SdpaMetadata:
        starts = common.query_start_loc[:-1].long()  # [R]
        max_q = common.max_query_len
        offsets = torch.arange(max_q)  # [Q]
        query_valid = offsets < common.query_lens.unsqueeze(1)
        query_index = torch.where(query_valid, starts.unsqueeze(1) + offsets, 0)
        first_pos = (common.seq_lens - common.query_lens).unsqueeze(1)
        query_pos = (first_pos + offsets).to(torch.int32)
        num_key_blocks = -(-common.max_seq_len // common.block_size)
        key_block_table = common.block_table[:, :num_key_blocks].long()
        decode_only = max_q == 1
        return SdpaMetadata(
            common=common,
            query_index=query_index,
            query_valid=query_valid,
            query_pos=query_pos,
            key_block_table=key_block_table,
            key_blocks=key_block_table.flatten(),
            decode_only=decode_only,
            single_request_len=common.max_seq_len if decode_only and common.num_reqs == 1 else None,
        )

    @classmethod
    def impl_class(cls) -> type[AttentionImpl]:
        return TorchSdpaImpl
