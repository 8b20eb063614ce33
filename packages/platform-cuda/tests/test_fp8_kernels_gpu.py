"""The FP8 kernels' tests (core's tests/fp8_kernel_cases.py, and the block-FP8 fused MoE's
fp8_moe_kernel_cases.py) on the GPU, with this platform's launch configurations and its contract
functions (kvik_cuda.fp8); skipped without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
CASES = HERE.parents[1] / "core" / "tests"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cases", ["fp8_kernel_cases.py", "fp8_moe_kernel_cases.py"])
def test_fp8_kernels_on_the_gpu(cases: str) -> None:
    env = os.environ | {"KVIK_KERNEL_DEVICE": "cuda"}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(CASES / cases),
        ],
        env=env,
        cwd=HERE.parents[2],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
