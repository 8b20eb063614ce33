"""kvik.triton_kernels.launch: the cache key that lets a launch skip ``JITFunction.run``.

The real launches (compiled kernels, the CUDA launcher) run on the H200 in the kernel cases
(``KVIK_KERNEL_DEVICE=cuda pytest packages/core/tests/triton_kernel_cases.py``), where every
wrapper launches through a ``FastLauncher``. Here: that the key keeps apart the arguments Triton
compiles apart, and the launcher's bookkeeping (which launches take which path, the arguments the
compiled kernel's launcher receives) against a stand-in kernel that records its calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from kvik.triton_kernels import launch  # noqa: E402


def test_specialization_keeps_apart_what_triton_compiles_apart() -> None:
    spec = launch.specialization
    bf16 = torch.empty(64, dtype=torch.bfloat16)
    assert spec(bf16) != spec(bf16[1:])  # 16-byte alignment
    assert spec(bf16) == spec(bf16[8:])
    assert spec(bf16) != spec(torch.empty(64, dtype=torch.float16))
    assert spec(1) != spec(2)  # 1 is compiled in as a constant
    assert spec(16) != spec(17) and spec(16) == spec(32)
    assert spec(2**31) != spec(2**4)  # 64-bit integers
    assert spec(0.5) == spec(2.0)  # floats are not specialized


@dataclass
class _Param:
    name: str
    default: object = None


@dataclass
class _Compiled:
    launches: list = field(default_factory=list)
    function: int = 7
    packed_metadata: tuple = (1, 2)

    def run(self, *args) -> None:
        self.launches.append(args)


class _RecordingKernel:
    """Stands in for a JITFunction: ``kernel[grid](*args, **kwargs)`` records the launch and
    returns the compiled kernel, as Triton's does."""

    def __init__(self) -> None:
        self.params = [_Param("x"), _Param("n"), _Param("BLOCK"), _Param("FLAG", default=True)]
        self.jit_launches: list = []
        self.compiled = _Compiled()

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.jit_launches.append((grid, args, kwargs))
            return self.compiled

        return run


@pytest.fixture
def no_gpu_driver(monkeypatch):
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 99)
    monkeypatch.setattr(launch, "driver", SimpleNamespace(active=active))
    monkeypatch.setattr(launch, "ENABLED", True)
    monkeypatch.setattr(launch, "_INTERPRET", False)


def test_a_new_key_launches_through_triton_and_a_known_one_straight(no_gpu_driver) -> None:
    kernel = _RecordingKernel()
    launcher = launch.FastLauncher(kernel)
    x = torch.empty(32, dtype=torch.bfloat16)

    launcher((4,), (x, 32), {"BLOCK": 16}, num_warps=4)
    assert kernel.jit_launches == [((4,), (x, 32), {"BLOCK": 16, "num_warps": 4})]
    assert kernel.compiled.launches == []

    launcher((5, 2), (x, 48), {"BLOCK": 16}, num_warps=4)  # same specialization
    assert len(kernel.jit_launches) == 1
    # grid padded to three dims, the stream, no launch hooks, then every argument in order with
    # the kernel's default for the constexpr not given
    assert kernel.compiled.launches == [(5, 2, 1, 99, 7, (1, 2), None, None, None, x, 48, 16, True)]

    launcher((5,), (x[1:], 48), {"BLOCK": 16}, num_warps=4)  # unaligned: Triton's own path
    launcher((5,), (x, 48), {"BLOCK": 32}, num_warps=4)  # another constexpr
    launcher((5,), (x, 48), {"BLOCK": 16}, num_warps=8)  # another option
    launcher((5,), (x, 1), {"BLOCK": 16}, num_warps=4)  # 1 is compiled in
    assert len(kernel.jit_launches) == 5
    assert len(kernel.compiled.launches) == 1


def test_a_launch_hook_or_the_switch_keeps_the_plain_path(no_gpu_driver, monkeypatch) -> None:
    kernel = _RecordingKernel()
    launcher = launch.FastLauncher(kernel)
    x = torch.empty(32, dtype=torch.bfloat16)
    launcher((4,), (x, 32), {"BLOCK": 16}, num_warps=4)
    hooks = launch.knobs.runtime.launch_enter_hook
    hooks.add(print)
    try:
        launcher((4,), (x, 32), {"BLOCK": 16}, num_warps=4)
    finally:
        hooks.remove(print)
    with monkeypatch.context() as patch:
        patch.setattr(launch.knobs.runtime, "launch_enter_hook", print)  # a bare hook
        launcher((4,), (x, 32), {"BLOCK": 16}, num_warps=4)
    monkeypatch.setattr(launch, "ENABLED", False)
    launcher((4,), (x, 32), {"BLOCK": 16}, num_warps=4)
    assert len(kernel.jit_launches) == 4 and kernel.compiled.launches == []
