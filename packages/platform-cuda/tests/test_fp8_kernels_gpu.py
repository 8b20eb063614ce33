"""The FP8 kernels' tests (core's tests/fp8_kernel_cases.py) on the GPU at full sizes, with this
platform's launch configurations and its contract functions (kvik_cuda.fp8); skipped without
CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
CASES = HERE.parents[1] / "core" / "tests" / "fp8_kernel_cases.py"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_kernels_on_the_gpu() -> None:
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
            str(CASES),
        ],
        env=env,
        cwd=HERE.parents[2],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
