"""The example's attention backend ("EXAMPLE_SDPA"): the paged KV cache read back request by
request, attended with PyTorch's scaled_dot_product_attention.

Written for clarity, not speed: a vendor replaces ``forward`` with its own kernels. The contract
is ``kvik.attention.backend``'s: write the step's keys and values into the paged cache at
``slot_mapping``, then attend each query token causally (and within the layer's sliding window)
over its request's context, read through ``block_table``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvik.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadata


class ExampleAttentionImpl(AttentionImpl):
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        metadata: AttentionMetadata,
        output: Tensor,
    ) -> None:
        t, h, hk, d = metadata.num_actual_tokens, self.num_heads, self.num_kv_heads, self.head_size
        # kv_cache [2, num_blocks, block_size, Hk, D]: kvik's reference op writes the new tokens.
        torch.ops.kvik.reshape_and_cache(
            key[:t].view(t, hk, d), value[:t].view(t, hk, d), kv_cache, metadata.slot_mapping
        )
        starts = metadata.query_start_loc.tolist()
        for r, seq_len in enumerate(metadata.seq_lens.tolist()):
            first, last = starts[r], starts[r + 1]
            if first == last:
                continue
            num_blocks = -(-seq_len // metadata.block_size)
            blocks = metadata.block_table[r, :num_blocks].long()
            # This request's context, [Hk, S, D], in position order.
            k, v = (kv_cache[i][blocks].flatten(0, 1)[:seq_len].transpose(0, 1) for i in (0, 1))
            q = query[first:last].view(last - first, h, d).transpose(0, 1).to(k.dtype)
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=self._mask(seq_len - (last - first), last - first, seq_len),
                scale=self.scale,
                enable_gqa=h != hk,
            )  # [H, Q, D]
            output[first:last].copy_(out.transpose(0, 1).reshape(last - first, h * d))

    def _mask(self, context_len: int, query_len: int, seq_len: int) -> Tensor:
        """[Q, S]: query j (at position context_len + j) sees keys at or before it, and no
        further back than the sliding window."""
        q_pos = torch.arange(context_len, context_len + query_len).unsqueeze(1)
        k_pos = torch.arange(seq_len)
        allowed = k_pos <= q_pos
        if self.sliding_window is not None:
            allowed &= k_pos > q_pos - self.sliding_window
        return allowed


class ExampleAttentionBackend(AttentionBackend):
    name = "EXAMPLE_SDPA"
    supported_dtypes = (torch.float32, torch.bfloat16)

    @classmethod
    def impl_class(cls) -> type[AttentionImpl]:
        return ExampleAttentionImpl
