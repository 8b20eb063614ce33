"""Which of kvik_cpu's kernel paths an engine takes: the best this CPU runs, or the one that
``KVIK_CPU_ISA`` forces.

The paths, each needing what the one before needs and more:

- ``plain`` (any CPU): the portable paths. ``dtype="auto"`` is float32; in bfloat16 the matrix
  products are PyTorch's ``F.linear`` and paged attention takes its portable loops.
- ``avx512bf16`` (AVX512-BF16): bfloat16 by default; the matrix products on weights packed for
  AVX512-BF16 dot products (``Avx512Bf16Linear``; oneDNN's ``OneDnnLinear`` where the C++ ops did
  not build), paged attention's bf16 dot products in AVX512-BF16.
- ``amx`` (AMX tiles, and Linux's permission to use them): the matrix products on AMX tiles
  (``AmxLinear``), paged attention's query-key scores on AMX, a decode step's layers in one C++ call
  (kvik_cpu.decode_layers).

``KVIK_CPU_ISA=plain|avx512bf16|amx`` (``auto`` or unset: the best) forces one, so that the tests
run every path the CPU can run, not only its best: a path that only a CPU without AMX takes is
otherwise never run on a machine with it. A path the CPU cannot run is an error that says what it
lacks. ``selected_isa()`` is the one place the variable is read; an engine reads it while it is
built (its default dtype, its weights' packing, its attention layers) and keeps what it read.

A forced path below the CPU's best also caps oneDNN, which chooses its own kernels by the CPU
(``ONEDNN_MAX_CPU_ISA``, unless already set), so that PyTorch's own bf16 matrix products (prompt
attention, ``OneDnnLinear``) run as on a CPU without the features the path lacks. oneDNN reads the
cap when it first runs: the ``kvik`` commands and servers select the platform before any model runs,
but a process that used oneDNN before keeps oneDNN's first choice.
"""

from __future__ import annotations

import enum
import logging
import os
from functools import cache

logger = logging.getLogger(__name__)

ENV_VAR = "KVIK_CPU_ISA"


class CpuIsa(enum.IntEnum):
    PLAIN = 0  # values as csrc/ops.h's Isa: the kernels take them as their max_isa argument
    AVX512BF16 = 1
    AMX = 2

    @property
    def label(self) -> str:
        return self.name.lower()


#: What /proc/cpuinfo must list for each path (every CPU with AVX512-BF16 has AVX-512's base).
REQUIRED_FLAGS = {
    CpuIsa.PLAIN: frozenset(),
    CpuIsa.AVX512BF16: frozenset({"avx512_bf16"}),
    CpuIsa.AMX: frozenset({"avx512_bf16", "amx_tile", "amx_bf16"}),
}

#: oneDNN's cap (ONEDNN_MAX_CPU_ISA) for a path forced below the CPU's best: AVX-512 without its
#: BF16 extension for plain, AVX512-BF16 without AMX for avx512bf16.
ONEDNN_CAP = {CpuIsa.PLAIN: "AVX512_CORE", CpuIsa.AVX512BF16: "AVX512_CORE_BF16"}


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, as /proc/cpuinfo lists them (none where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_isa() -> CpuIsa:
    """The best path this CPU's flags allow (AMX's permission and the build are checked later,
    by ``kernel_isa``)."""
    flags = cpu_flags()
    return max(isa for isa, needed in REQUIRED_FLAGS.items() if needed <= flags)


def runnable_isas() -> list[CpuIsa]:
    """Every path this CPU can run, best last; what the tests force in turn."""
    return [isa for isa in CpuIsa if isa <= cpu_isa()]


def _parse(value: str) -> CpuIsa | None:
    value = value.strip().lower()
    if value in ("", "auto"):
        return None
    for isa in CpuIsa:
        if value == isa.label:
            return isa
    choices = ", ".join(["auto", *(isa.label for isa in CpuIsa)])
    raise ValueError(f"{ENV_VAR}={value!r} is not a CPU kernel path: choose one of {choices}")


def forced_isa() -> CpuIsa | None:
    """The path ``KVIK_CPU_ISA`` asks for; None where it is unset or ``auto``."""
    return _parse(os.environ.get(ENV_VAR, ""))


def selected_isa() -> CpuIsa:
    """The forced path, checked against this CPU's flags, else the CPU's best."""
    best = cpu_isa()
    forced = forced_isa()
    if forced is None:
        return best
    if forced > best:
        missing = ", ".join(sorted(REQUIRED_FLAGS[forced] - cpu_flags()))
        runnable = ", ".join(isa.label for isa in runnable_isas())
        raise ValueError(
            f"{ENV_VAR}={forced.label} needs CPU features this CPU lacks ({missing}); "
            f"it runs {runnable}"
        )
    return forced


def kernel_isa(built: CpuIsa | None) -> CpuIsa:
    """The path the engine's kernels take: ``selected_isa()`` within what the C++ ops' build runs
    (``built``: their ``built_isa()``; None where they did not build, and then the path decides
    only the dtype and the oneDNN packing, which need no build, and AMX cannot run). A forced path
    that cannot run is an error; the CPU's best gives way, with a warning, to what runs (AMX
    without the kernel's permission, say)."""
    isa = selected_isa()
    runs = CpuIsa.AVX512BF16 if built is None else built
    if isa <= runs:
        return isa
    if built is None:
        why = "kvik_cpu's C++ ops did not build"
    else:
        why = f"this build of kvik_cpu's C++ ops runs up to {runs.label}"
        if isa is CpuIsa.AMX:
            why += " (AMX needs a compiler that targets it and Linux's leave to use the tiles)"
    if forced_isa() is not None:
        raise ValueError(f"{ENV_VAR}={isa.label} cannot run: {why}")
    _warn_once(f"kvik_cpu takes the {runs.label} path: {why}")
    return runs


@cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def engine_isa() -> CpuIsa:
    """``kernel_isa`` for the C++ ops of this process (built here on first use)."""
    import torch

    from kvik_cpu import extension

    built = None if extension.load() is not None else CpuIsa(torch.ops.kvik_cpu.built_isa())
    return kernel_isa(built)


def cap_onednn(isa: CpuIsa) -> None:
    """Cap oneDNN's kernels at ``isa``'s features where it is forced below the CPU's best
    (module docstring); a cap the user set is left alone."""
    if isa >= cpu_isa() or "ONEDNN_MAX_CPU_ISA" in os.environ or "DNNL_MAX_CPU_ISA" in os.environ:
        return
    os.environ["ONEDNN_MAX_CPU_ISA"] = ONEDNN_CAP[isa]
