"""An EAGLE-3 proposal's indices in one launch (``kvik.ops.eagle3_indices``, whose docstring says
what each output holds), where PyTorch takes about twenty small ones: on the H200 those cost
~35 µs of a ~0.8 ms proposal at batch 1, each a launch of a few µs that moves a few bytes.

Program j owns proposing request j (then padding): its last known row, and for every draft step
its position, KV slot and sequence length, and its block-table row. Program 0 also writes the
per-request rows and tokens and the batched pass's tokens: a request's last known row is read
from its base row and accepted count (recomputed where program j needs it, so that no program
waits for another), and the pass's tokens are written in two phases with a barrier between, the
shifted step tokens then each request's next token over its last known row.

Reference: ``kvik.ops.eagle3_indices``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

#: Entries a loop step covers (requests, pass rows, block-table columns).
BLOCK = 256
WARPS = 4


@triton.jit
def _last_known(
    req,
    mask,
    sample_index_ptr,
    base_rows_ptr,
    prompt_next_ptr,
    num_accepted_ptr,
    verified_tokens_ptr,
    verified_stride,
    HAS_VERIFIED: tl.constexpr,
):
    """(last known row, its next token) of scheduled requests ``req``."""
    base = tl.load(base_rows_ptr + req, mask=mask, other=0)
    prompt_next = tl.load(prompt_next_ptr + req, mask=mask, other=0)
    if HAS_VERIFIED:
        sample = tl.load(sample_index_ptr + req, mask=mask, other=-1)
        samples = mask & (sample >= 0)
        accepted = tl.load(num_accepted_ptr + sample, mask=samples, other=0)
        token = tl.load(
            verified_tokens_ptr + sample * verified_stride + accepted, mask=samples, other=0
        )
        return base + accepted, tl.where(samples, token, prompt_next)
    return base, prompt_next


@triton.jit(
    do_not_specialize=["num_requests", "num_pass_rows", "num_hidden", "num_steps", "num_columns"]
)
def eagle3_indices_kernel(
    sample_index_ptr,  # [num_requests] int64: the request's row in the verified output, or -1
    base_rows_ptr,  # [num_requests] int64
    prompt_next_ptr,  # [num_requests] int64
    table_rows_ptr,  # [num_hidden] int64: proposing request j's row among the scheduled ones
    num_blocks_ptr,  # [num_hidden] int64
    num_accepted_ptr,  # [S] int64 (HAS_VERIFIED)
    verified_tokens_ptr,  # [S, W] int64 (HAS_VERIFIED)
    input_ids_ptr,  # [>= num_pass_rows] int64
    positions_ptr,  # [T] int64
    block_table_ptr,  # [R, max_blocks] int32
    last_rows_ptr,  # out [num_requests] int64
    next_ids_ptr,  # out [num_requests] int64
    rows_ptr,  # out [num_hidden] int64
    pass_tokens_ptr,  # out [num_pass_rows] int64
    draft_positions_ptr,  # out [num_steps, num_hidden] int64 (row stride draft_stride)
    draft_slots_ptr,  # out, the same layout
    draft_seq_lens_ptr,  # out [num_steps, num_hidden] int32 (row stride seq_lens_stride)
    draft_table_ptr,  # out [num_hidden, >= num_columns] int32 (row stride draft_table_stride)
    verified_stride,
    block_table_stride,
    draft_stride,
    seq_lens_stride,
    draft_table_stride,
    num_requests,
    num_pass_rows,
    num_hidden,
    num_steps,
    num_columns,
    block_size,
    max_model_len,
    HAS_VERIFIED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    j = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    if j == 0:
        # The pass's tokens: row p the step's token at p + 1, the last row 0 ...
        for start in range(0, num_pass_rows, BLOCK):
            p = start + lanes
            token = tl.load(input_ids_ptr + p + 1, mask=p < num_pass_rows - 1, other=0)
            tl.store(pass_tokens_ptr + p, token, mask=p < num_pass_rows)
        tl.debug_barrier()
        # ... then each request's last known row its next token.
        for start in range(0, num_requests, BLOCK):
            req = start + lanes
            mask = req < num_requests
            last, token = _last_known(
                req, mask, sample_index_ptr, base_rows_ptr, prompt_next_ptr, num_accepted_ptr,
                verified_tokens_ptr, verified_stride, HAS_VERIFIED,
            )  # fmt: skip
            tl.store(last_rows_ptr + req, last, mask=mask)
            tl.store(next_ids_ptr + req, token, mask=mask)
            tl.store(pass_tokens_ptr + last, token, mask=mask)
    if j >= num_hidden:
        return  # no proposing request: program 0 only wrote the pass's indices
    # Proposing request (or padding row) j: its row and draft steps.
    table_row = tl.load(table_rows_ptr + j)
    first = lanes == 0
    row_vec, _ = _last_known(
        table_row + lanes * 0, first, sample_index_ptr, base_rows_ptr, prompt_next_ptr,
        num_accepted_ptr, verified_tokens_ptr, verified_stride, HAS_VERIFIED,
    )  # fmt: skip
    row = tl.sum(tl.where(first, row_vec, 0), axis=0)
    tl.store(rows_ptr + j, row)
    if num_steps > 0:
        num_blocks = tl.load(num_blocks_ptr + j)
        table = block_table_ptr + table_row * block_table_stride
        last_position = tl.load(positions_ptr + row)
        for start in range(0, num_steps, BLOCK):
            step = start + lanes
            mask = step < num_steps
            position = tl.minimum(last_position + step + 1, max_model_len - 1)
            block = position // block_size
            column = tl.minimum(block, tl.maximum(num_blocks - 1, 0))
            entry = tl.load(table + column, mask=mask, other=0).to(tl.int64)
            slot = tl.where(block < num_blocks, entry * block_size + position % block_size, -1)
            tl.store(draft_positions_ptr + step * draft_stride + j, position, mask=mask)
            tl.store(draft_slots_ptr + step * draft_stride + j, slot, mask=mask)
            tl.store(
                draft_seq_lens_ptr + step * seq_lens_stride + j,
                (position + 1).to(tl.int32),
                mask=mask,
            )
        for start in range(0, num_columns, BLOCK):
            column = start + lanes
            mask = column < num_columns
            entry = tl.load(table + column, mask=mask)
            tl.store(draft_table_ptr + j * draft_table_stride + column, entry, mask=mask)


def eagle3_indices(
    sample_index: Tensor,
    base_rows: Tensor,
    prompt_next: Tensor,
    table_rows: Tensor,
    num_blocks: Tensor,
    num_accepted: Tensor | None,
    verified_tokens: Tensor | None,
    input_ids: Tensor,
    positions: Tensor,
    block_table: Tensor,
    last_rows: Tensor,
    next_ids: Tensor,
    rows: Tensor,
    pass_tokens: Tensor,
    draft_positions: Tensor,
    draft_slots: Tensor,
    draft_seq_lens: Tensor,
    draft_block_table: Tensor,
    block_size: int,
    max_model_len: int,
) -> None:
    """``kvik.ops.eagle3_indices`` in one launch. The 1-D tensors are contiguous (the proposer's
    staging views), the draft outputs row-strided views of its buffers."""
    has_verified = num_accepted is not None and verified_tokens is not None
    if has_verified and verified_tokens.stride(-1) != 1:
        verified_tokens = verified_tokens.contiguous()
    num_hidden = rows.numel()
    # Program 0 runs without proposing requests too (the pass's indices).
    eagle3_indices_kernel[(max(num_hidden, 1),)](
        sample_index, base_rows, prompt_next, table_rows, num_blocks,
        num_accepted if has_verified else base_rows,  # unread without HAS_VERIFIED
        verified_tokens if has_verified else base_rows,
        input_ids, positions, block_table, last_rows, next_ids, rows, pass_tokens,
        draft_positions, draft_slots, draft_seq_lens, draft_block_table,
        verified_tokens.stride(0) if has_verified else 0,
        block_table.stride(0), draft_positions.stride(0), draft_seq_lens.stride(0),
        draft_block_table.stride(0),
        last_rows.numel(), pass_tokens.numel(), num_hidden, draft_positions.shape[0],
        draft_block_table.shape[1], block_size, max_model_len,
        HAS_VERIFIED=has_verified, BLOCK=BLOCK, num_warps=WARPS,
    )  # fmt: skip
