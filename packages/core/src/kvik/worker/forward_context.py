"""The one explicit forward context: per-step metadata that reaches attention layers.

The runner enters it around the model's forward (``with forward_context(ctx): model(...)``), so the
model's signatures stay ``forward(input_ids, positions)``. A context variable, not a module global,
so two engines in one process (or threads) do not see each other's steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvik.layers.attention import Attention


@dataclass
class ForwardContext:
    attn_metadata: Any  # the chosen backend's metadata for this step
    attention_layers: dict[str, Attention]  # layer name -> layer (its impl and kv_cache bound)


_current: ContextVar[ForwardContext | None] = ContextVar("kvik_forward_context", default=None)


@contextlib.contextmanager
def forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


def get_forward_context() -> ForwardContext:
    context = _current.get()
    if context is None:
        raise RuntimeError(
            "attention ran outside a forward context (use kvik.worker.forward_context)"
        )
    return context
