"""NVTX ranges around the phases of a step (``--enable-nvtx``), so that ``nsys`` shows the step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def nvtx_range(name: str, enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    import torch

    if not torch.cuda.is_available():  # NVTX is CUDA's; elsewhere the ranges cost nothing
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()
