"""kvik: an LLM inference and serving engine with hardware platforms as plugins.

``from kvik import LLM, SamplingParams`` is the offline API (vLLM's names). The engine is imported
lazily so that ``import kvik`` (and ``kvik env``) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvik.plugins.hookspecs import hookimpl
from kvik.plugins.manager import PLUGIN_API_VERSION

__version__ = "0.1.0"

if TYPE_CHECKING:
    from kvik.engine.llm import LLM
    from kvik.outputs import CompletionOutput, RequestError, RequestOutput
    from kvik.sampling_params import SamplingParams

_LAZY = {
    "LLM": "kvik.engine.llm",
    "SamplingParams": "kvik.sampling_params",
    "RequestOutput": "kvik.outputs",
    "CompletionOutput": "kvik.outputs",
    "RequestError": "kvik.outputs",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvik' has no attribute {name!r}")


__all__ = [
    "LLM",
    "PLUGIN_API_VERSION",
    "CompletionOutput",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "__version__",
    "hookimpl",
]
