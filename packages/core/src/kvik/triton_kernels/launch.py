"""Launching a Triton kernel for less host time than ``kernel[grid](...)``.

A step that is not one captured graph (a PIECEWISE step: prompts beside decodes) launches its
attention from Python between the captured pieces, two or three Triton launches a layer. On the
H200 machine such a step was bound by the host (64 decodes and a 192-token prompt: 8.5-13 ms of
launching for 9.3 ms of kernels), and ``JITFunction.run`` took ~50-60 µs of it a launch: it binds
every argument through a generated function, builds a string cache key, reads Triton's knobs,
makes the launch metadata, and only then calls the compiled kernel's launcher (~9 µs). Through
this launcher a ``paged_attention`` launch costs ~25 µs and that step launches in ~6.5 ms, ahead
of the GPU (docs/benchmarks.md, "the twenty-fifth session's H200 calls").

``FastLauncher`` keeps each compiled kernel under a key of its own and calls the launcher straight.
The key holds everything Triton's specialization reads: the constexprs and launch options as
given, the device, and for each run-time argument Triton's own specialization of it
(``native_specialize_impl``, the function its binder calls: a tensor's dtype and 16-byte
alignment, an integer's width, alignment and being 1), taken at the finest setting, so two
launches that share a key always share a compiled kernel. A key not seen before launches through
``kernel[grid]`` (compiling if Triton must) and keeps what that returns. The interpreter
(``TRITON_INTERPRET=1``), a launch hook (a profiler's) and a backend whose compiled kernels are
not launched this way all take the plain path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.runtime.driver import driver

#: ``KVIK_FAST_TRITON_LAUNCH=0`` launches every kernel through ``kernel[grid]`` (read at import).
ENABLED = os.environ.get("KVIK_FAST_TRITON_LAUNCH", "1") == "1"
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def specialization(arg: Any) -> Any:
    """Triton's specialization of one run-time argument, at its finest (the part of the kernel
    cache key an argument contributes): ``("*bf16", "D")`` for a 16-byte aligned bf16 tensor,
    ``("i32", "")`` for an unaligned 32-bit integer, ``("constexpr", 1)`` for the integer 1."""
    return native_specialize_impl(BaseBackend, arg, False, True, True)


def _launch_hooks() -> bool:
    """Whether a launch hook is registered (a profiler's, such as proton's): those get Triton's
    launch metadata, which only ``kernel[grid]`` makes. Triton keeps them in a ``HookChain``
    (Triton 3.6-3.9); a hook assigned in its place counts as registered."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


class FastLauncher:
    """``FastLauncher(kernel)(grid, args, constexprs, num_warps=..., num_stages=...)`` launches
    as ``kernel[grid](*args, **constexprs, num_warps=..., num_stages=...)`` does. ``args`` are
    the kernel's leading run-time arguments in order; ``constexprs`` names every later argument
    (or takes the kernel's default)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._compiled: dict[tuple, tuple[Any, tuple]] = {}

    def __call__(
        self, grid: tuple[int, ...], args: tuple, constexprs: Mapping[str, Any], **options: int
    ) -> None:
        if not ENABLED or _INTERPRET or _launch_hooks():
            self.kernel[grid](*args, **constexprs, **options)
            return
        device = driver.active.get_current_device()
        key = (
            device,
            tuple(constexprs.items()),
            tuple(options.items()),
            *[specialization(a) for a in args],
        )
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **constexprs, **options)
            if hasattr(compiled, "result"):
                compiled = compiled.result()  # compiled asynchronously
            if not hasattr(compiled, "packed_metadata"):
                return  # a backend launched another way: keep the plain path for it
            tail = tuple(
                constexprs[p.name] if p.name in constexprs else p.default
                for p in self.kernel.params[len(args) :]
            )
            self._compiled[key] = (compiled, tail)
            return
        compiled, tail = entry
        stream = driver.active.get_current_stream(device)
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        compiled.run(
            grid[0], grid_1, grid_2, stream, compiled.function, compiled.packed_metadata,
            None, None, None, *args, *tail,
        )  # fmt: skip
