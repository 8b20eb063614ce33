"""The block-FP8 fused MoE kernel tests of fp8_moe_kernel_cases.py on the CPU under the Triton
interpreter, at small shapes, in a pytest process of their own (``TRITON_INTERPRET`` is read when kernels are defined);
skipped where triton is not installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).parent


def test_fp8_kernels_under_the_interpreter() -> None:
    env = os.environ | {"TRITON_INTERPRET": "1", "KVIK_KERNEL_DEVICE": "cpu"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(HERE / "fp8_moe_kernel_cases.py"),
        ],
        env=env,
        cwd=HERE.parents[2],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
