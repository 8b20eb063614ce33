"""The CPU platform's kernel paths (kvik_cpu.isa), forced one at a time: the tests that take the
``cpu_path`` fixture run once per path, so that a machine covers every path its CPU can run and
not only its best (the non-AMX path's bugs once passed CI on a machine with AMX).

A path the CPU cannot run is skipped with the reason; AMX needs the hardware, the avx512bf16 path
an x86 CPU with AVX512-BF16, and plain runs everywhere."""

from __future__ import annotations

import os

import pytest
import torch

from kvik_cpu import isa
from kvik_cpu.isa import CpuIsa


def _skip_reason(path: CpuIsa) -> str | None:
    if path > isa.cpu_isa():
        missing = ", ".join(sorted(isa.REQUIRED_FLAGS[path] - isa.cpu_flags()))
        return f"the {path.label} path needs CPU features this CPU lacks ({missing})"
    return None


PATHS = [
    pytest.param(
        path,
        id=path.label,
        marks=pytest.mark.skipif(_skip_reason(path) is not None, reason=str(_skip_reason(path))),
    )
    for path in CpuIsa
]


def force_path(path: CpuIsa, monkeypatch: pytest.MonkeyPatch) -> CpuIsa:
    """Set ``KVIK_CPU_ISA`` for what the test builds; skip where the C++ build cannot run it."""
    monkeypatch.setenv(isa.ENV_VAR, path.label)
    try:
        isa.engine_isa()
    except ValueError as e:  # e.g. AMX flags, but Linux refuses the tiles or the compiler lacks AMX
        pytest.skip(str(e))
    return path


@pytest.fixture(params=PATHS)
def cpu_path(request, monkeypatch):
    """Each kernel path in turn, forced with ``KVIK_CPU_ISA`` for what the test builds.

    In this process oneDNN keeps the machine's kernels on every path: it reads its cap
    (kvik_cpu.isa.cap_onednn) once, at its first use, and is made to read it here before any path
    sets one, so that no test's oneDNN depends on which test ran first. kvik's own choices (the
    packing, the C++ kernels' path) are the forced path's; a ``kvik`` subprocess started with
    ``KVIK_CPU_ISA`` caps oneDNN too. The cap's variable is undone afterwards, so that later tests
    and their subprocesses see the machine as it is."""
    torch.ops.mkldnn._is_mkldnn_bf16_supported()  # oneDNN reads ONEDNN_MAX_CPU_ISA now
    saved = {name: os.environ.get(name) for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    try:
        yield force_path(request.param, monkeypatch)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
