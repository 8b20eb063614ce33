"""Applying a batch of token bitmasks to logits on the logits' device (CPU or GPU).

A bitmask row has one bit per vocabulary id, packed 32 to an int32 word (xgrammar's layout: id
``i`` is bit ``i % 32`` of word ``i // 32``; a set bit allows the id). Plain torch ops, so the same
code runs wherever the logits are.
"""

from __future__ import annotations

import torch
from torch import Tensor

_BIT_POSITIONS: dict[torch.device, Tensor] = {}


def _bit_positions(device: torch.device) -> Tensor:
    positions = _BIT_POSITIONS.get(device)
    if positions is None:
        positions = _BIT_POSITIONS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return positions


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """bitmask [N, W] int32 -> allowed [N, vocab_size] bool (ids past 32 * W are not allowed)."""
    bits = (bitmask.unsqueeze(-1) >> _bit_positions(bitmask.device)) & 1
    allowed = bits.view(bitmask.shape[0], -1).bool()
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = allowed.new_zeros(allowed.shape[0], vocab_size - allowed.shape[1])
    return torch.cat((allowed, pad), dim=1)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, rows: Tensor | None = None) -> None:
    """Set to -inf, in place, the logits of ids the bitmask forbids.

    logits [N, V]; bitmask [M, W] on the logits' device; ``rows`` [M] the logits rows the bitmask
    rows belong to (None: all N rows in order, M == N).
    """
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        selected = logits[rows]
        logits[rows] = selected.masked_fill(~allowed, float("-inf"))
