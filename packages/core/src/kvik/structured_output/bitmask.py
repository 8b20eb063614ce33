"""Applying a batch of token bitmasks to logits on the logits' device (CPU or GPU).

A bitmask row has one bit per vocabulary id, packed 32 to an int32 word (xgrammar's layout: id
``i`` is bit ``i % 32`` of word ``i // 32``, little-endian; a set bit allows the id). On the CPU
xgrammar's own kernel applies it; elsewhere plain torch ops do (a byte-to-bits table), so the
same code runs on every GPU platform without a kernel of its own.
"""

from __future__ import annotations

import torch
from torch import Tensor

_BYTE_BITS: dict[torch.device, Tensor] = {}


def _byte_bits(device: torch.device) -> Tensor:
    """[256, 8] bool: the bits of each byte value, least significant first."""
    table = _BYTE_BITS.get(device)
    if table is None:
        values = torch.arange(256, dtype=torch.int32).unsqueeze(1)
        table = ((values >> torch.arange(8, dtype=torch.int32)) & 1).bool()
        table = _BYTE_BITS[device] = table.to(device)
    return table


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """bitmask [N, W] int32 -> allowed [N, vocab_size] bool (ids past 32 * W are not allowed)."""
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # [N, 4W], little-endian words
    allowed = _byte_bits(bitmask.device)[as_bytes].view(bitmask.shape[0], -1)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = allowed.new_zeros(allowed.shape[0], vocab_size - allowed.shape[1])
    return torch.cat((allowed, pad), dim=1)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, rows: list[int] | None = None) -> None:
    """Set to -inf, in place, the logits of ids the bitmask forbids.

    logits [N, V] fp32; bitmask [M, W] int32 on the logits' device; ``rows``: the M logits rows
    the bitmask rows belong to, increasing (None: all N rows in order, M == N).
    """
    if logits.device.type == "cpu":
        _apply_on_cpu(logits, bitmask, rows)
        return
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _apply_on_cpu(logits: Tensor, bitmask: Tensor, rows: list[int] | None) -> None:
    import xgrammar as xgr

    if rows is not None and len(rows) != logits.shape[0]:
        # xgrammar's indices pick rows of the logits and of the bitmask alike: spread the
        # bitmask over all rows (the others allow everything, and are skipped anyway).
        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
        full[rows] = bitmask
        xgr.apply_token_bitmask_inplace(logits, full, vocab_size=logits.shape[1], indices=rows)
        return
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1])
