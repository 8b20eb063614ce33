"""Hugging Face config classes imported without transformers' generated docstrings.

transformers (5.x) decorates each config class with ``@auto_docstring``, which builds the class's
docstring when its module is first imported, and to build it imports the auto-modeling modules
(``modeling_auto``, the generation utilities, ``masking_utils`` and through it ``torch._dynamo``).
A process that only reads a config pays for all of them: ``from transformers import LlamaConfig``
took 3.3 s after ``PretrainedConfig`` on a 2-core machine, 1.7 s without the docstrings. Every
kvik process reads one (the front end, the engine core, each rank), and none shows a config's
docstring, so the configs kvik reads, and the ones it unpickles in the processes it spawns, have
their classes imported with the docstring step skipped: the class keeps the docstring its source
wrote. Where transformers has no such step (another version), nothing changes.
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import threading
from collections.abc import Iterator
from typing import Any

#: transformers' module whose ``auto_class_docstring`` the decorator calls at class creation.
_AUTO_DOCSTRING_MODULE = "transformers.utils.auto_docstring"

_lock = threading.RLock()


def _as_written(cls: type, *args: Any, **kwargs: Any) -> type:
    return cls


@contextlib.contextmanager
def without_generated_docstrings() -> Iterator[None]:
    """Within the block, transformers classes imported for the first time keep the docstring
    their source wrote (see the module's doc); transformers is as it was afterwards."""
    with _lock:
        try:
            module = importlib.import_module(_AUTO_DOCSTRING_MODULE)
        except ImportError:
            module = None
        original = getattr(module, "auto_class_docstring", None)
        if original is None or original is _as_written:  # another version, or nested
            yield
            return
        module.auto_class_docstring = _as_written
        try:
            yield
        finally:
            module.auto_class_docstring = original


def loads_hf_config(data: bytes) -> Any:
    """A config pickled on its own (``pickle.dumps``), its class imported without generated
    docstrings."""
    with without_generated_docstrings():
        return pickle.loads(data)
