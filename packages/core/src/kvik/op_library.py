"""kvik's custom ops, defined straight on a ``torch.library.Library`` rather than through
``torch.library.custom_op``.

Both give an operator ``torch.ops.kvik.<name>`` with a schema inferred from the Python function's
annotations, a default (CompositeExplicitAutograd) implementation, per-device kernels a platform
registers (``torch.library.register_kernel``) and a fake implementation for ``torch.compile``.
What differs is the call: ``custom_op`` puts Python layers around every call (its ADInplaceOrView
and backend wrappers: version bumps, aliasing checks, a Python-side kernel table): on the 2-core
development machine a mutating op (``kvik::argmax_rows`` on one short row) took 66.2 µs a call
against 11.4 µs for its body, and takes 21.6 µs defined here (docs/benchmarks.md).
That is paid wherever an op runs outside a graph: a PIECEWISE step calls the attention op between
its pieces once a layer, and on the H200 a mixed step of 64 decodes and a 192-token prompt spent
16 ms of host time launching 9 ms of GPU work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

_LIBRARIES: dict[str, torch.library.Library] = {}


class KvikOp:
    """A defined op: calling it dispatches ``torch.ops.<namespace>.<name>``; ``register_fake``
    decorates its fake implementation (as a ``custom_op``'s does)."""

    def __init__(self, qualname: str, fn: Callable) -> None:
        namespace, name = qualname.split("::")
        self.qualname = qualname
        self.op = getattr(getattr(torch.ops, namespace), name)
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.op(*args, **kwargs)

    def register_fake(self, fake: Callable) -> Callable:
        return torch.library.register_fake(self.qualname)(fake)


def custom_op(qualname: str, fn: Callable | None = None, *, mutates_args: Iterable[str]) -> Any:
    """``torch.library.custom_op``'s signature (a decorator, or called with the function): defines
    ``qualname`` ("kvik::rms_norm") with ``fn`` as its implementation on every device."""

    def define(fn: Callable) -> KvikOp:
        namespace, name = qualname.split("::")
        library = _LIBRARIES.get(namespace)
        if library is None:
            library = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
        schema = torch.library.infer_schema(fn, mutates_args=tuple(mutates_args))
        library.define(name + schema)
        library.impl(name, fn, "CompositeExplicitAutograd")
        return KvikOp(qualname, fn)

    return define if fn is None else define(fn)
