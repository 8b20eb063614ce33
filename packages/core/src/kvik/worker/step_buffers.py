"""The runner's persistent step inputs: device buffers sized once, filled through pinned host twins.

A step's inputs (token ids, positions, slot mapping, query starts, sequence lengths, the block table,
the rows that sample) live in buffers allocated at start-up for ``max_num_batched_tokens`` tokens
and ``max_num_seqs`` requests. Each step writes the host side with numpy and copies the used prefix
to the device once per buffer; a CUDA graph captured over a prefix replays on whatever the buffers
hold. On the CPU the host and device sides are one tensor, so nothing is copied.

Later inputs (embeddings in place of ids, several rows of positions for multimodal rotary, one block
table per KV-cache group) are more buffers of the same two kinds: a ``StagedBuffer`` per input, and a
``BlockTable`` per KV-cache group.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


class StagedBuffer:
    """A 1-D device tensor with a pinned host twin; ``np`` is the host side as a numpy array.

    ``separate`` keeps two tensors even on the CPU (tests use it to run the copy path there).
    """

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        device: torch.device,
        fill: int = 0,
        separate: bool | None = None,
    ) -> None:
        on_host = device.type == "cpu" and not separate
        # Normal tensors even when made inside a step (under inference mode): steps and tools
        # outside inference mode write them too.
        with torch.inference_mode(False):
            pin = device.type != "cpu"
            self.host = torch.full((size,), fill, dtype=dtype, pin_memory=pin)
            self.device = (
                self.host if on_host else torch.full((size,), fill, dtype=dtype, device=device)
            )
        self.np = self.host.numpy()

    def upload(self, n: int) -> Tensor:
        """Copy the first ``n`` host entries to the device (without blocking the host); their view."""
        if self.device is not self.host and n > 0:
            self.device[:n].copy_(self.host[:n], non_blocking=True)
        return self.device[:n]


class BlockTable:
    """``[max_num_seqs, cdiv(max_model_len, block_size)]`` int32: row r holds the block ids of the
    step's r-th request. Its width never changes, so kernels see one stride and graphs one pointer.

    Rows are updated incrementally: a row that holds the same request (same admission) as in the
    previous step gets only its new blocks. On a device the changed entries travel as (flat index,
    value) pairs and are scattered there, so a step's copy is proportional to what changed, not to
    the table. ``np`` mirrors the device table on the host (slot mappings are computed from it).
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_blocks: int,
        device: torch.device,
        separate: bool | None = None,
    ) -> None:
        self.max_blocks = max_blocks
        self._separate = separate
        on_host = device.type == "cpu" and not separate
        self.host = torch.zeros((max_num_seqs, max_blocks), dtype=torch.int32)
        self.np = self.host.numpy()
        self.device = self.host if on_host else self.host.to(device, copy=True)
        self._owner: list[object] = [None] * max_num_seqs  # per row: (request, admission)
        self._num_written = [0] * max_num_seqs
        self._delta_index: StagedBuffer | None = None
        self._delta_value: StagedBuffer | None = None
        self._target = device

    def update(self, rows: Sequence[tuple[object, list[int]]]) -> None:
        """Row r of the step holds ``rows[r] = (owner key, block ids)``."""
        flat_index: list[np.ndarray] = []
        values: list[list[int]] = []
        width = self.max_blocks
        for r, (owner, block_ids) in enumerate(rows):
            n = len(block_ids)
            start = self._num_written[r] if self._owner[r] == owner else 0
            if n < start:  # cannot happen for one admission; rewrite rather than trust it
                start = 0
            if n > start:
                new = block_ids[start:] if start else block_ids
                self.np[r, start:n] = new
                if self.device is not self.host:
                    flat_index.append(np.arange(r * width + start, r * width + n))
                    values.append(new)
            self._owner[r] = owner
            self._num_written[r] = n
        if flat_index:
            self._scatter(np.concatenate(flat_index), np.fromiter(_chain(values), np.int32))

    def _scatter(self, index: np.ndarray, value: np.ndarray) -> None:
        n = len(index)
        if self._delta_index is None or len(self._delta_index.np) < n:
            size = max(n, 4096, 2 * len(self._delta_index.np) if self._delta_index else 0)
            self._delta_index = StagedBuffer(size, torch.int64, self._target, 0, self._separate)
            self._delta_value = StagedBuffer(size, torch.int32, self._target, 0, self._separate)
        self._delta_index.np[:n] = index
        self._delta_value.np[:n] = value
        self.device.view(-1).index_copy_(
            0, self._delta_index.upload(n), self._delta_value.upload(n)
        )

    def forget(self) -> None:
        """Forget which request owns which row (after rows were overwritten behind its back)."""
        self._owner = [None] * len(self._owner)


def _chain(lists: list[list[int]]):
    for values in lists:
        yield from values
