"""The fused MoE's TMA kernels launch at the deepest pipeline that fits in shared memory.

A configuration tuned for the pointer-load GEMM can need more shared memory in the TMA form (on
an H100, ``KVIK_MOE_TMA_UP=1`` with the 2048-token bf16 row asked 237,592 bytes of 232,448), and
only the compiled kernel knows its need, so the launch retries shallower. The real kernels run
under the interpreter in the kernel cases, where shared memory is never short; here a stand-in
kernel raises Triton's own error above a depth and records the launches it accepted.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from triton.runtime.errors import OutOfResources  # noqa: E402

from kvik.triton_kernels import fused_moe_tma  # noqa: E402


class _StandInKernel:
    """``kernel[grid](*args, num_stages=...)`` that fits only up to ``deepest`` stages."""

    def __init__(self, deepest: int) -> None:
        self.deepest, self.tried, self.launched = deepest, [], []

    def __getitem__(self, grid):
        def launch(*args, num_stages, **kwargs):
            self.tried.append(num_stages)
            if num_stages > self.deepest:
                raise OutOfResources(50_000 * num_stages, 232_448, "shared memory")
            self.launched.append((grid, args, kwargs, num_stages))

        return launch


@pytest.fixture(autouse=True)
def _fresh_depths(monkeypatch):
    monkeypatch.setattr(fused_moe_tma, "_FITTING_STAGES", {})


def test_a_launch_that_fits_runs_once_at_the_configured_depth() -> None:
    kernel = _StandInKernel(deepest=4)
    fused_moe_tma._launch_within_shared_memory(kernel, (8,), ("k",), 4, 1, 2, FLAG=True)
    assert kernel.tried == [4]
    assert kernel.launched == [((8,), (1, 2), {"FLAG": True}, 4)]


def test_a_launch_too_deep_runs_shallower_and_the_depth_is_kept() -> None:
    kernel = _StandInKernel(deepest=2)
    fused_moe_tma._launch_within_shared_memory(kernel, (8,), ("k",), 4, "a")
    assert kernel.tried == [4, 3, 2]
    assert [depth for *_, depth in kernel.launched] == [2]
    kernel.tried.clear()
    fused_moe_tma._launch_within_shared_memory(kernel, (8,), ("k",), 4, "b")
    assert kernel.tried == [2]  # no second search for the same key
    other = _StandInKernel(deepest=2)
    fused_moe_tma._launch_within_shared_memory(other, (8,), ("other",), 3, "c")
    assert other.tried == [3, 2]


def test_a_kernel_that_fits_at_no_depth_raises_tritons_error() -> None:
    kernel = _StandInKernel(deepest=0)
    with pytest.raises(OutOfResources, match="shared memory"):
        fused_moe_tma._launch_within_shared_memory(kernel, (8,), ("k",), 3)
    assert kernel.tried == [3, 2, 1] and not kernel.launched
