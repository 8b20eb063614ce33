"""The kernel case files on the CPU under the Triton interpreter, at small shapes, each in a pytest
process of its own (``TRITON_INTERPRET`` is read when kernels are defined); skipped where triton
is not installed (it comes with the GPU platform packages).

With ``KVIK_INTERPRETER_CASES=first`` only the first case of each test function runs: nox's
deps_latest session asks whether the newest triton still runs every kernel, which the whole files
(about 7 minutes of one core) answer on the pinned one in the tests session.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).parent
REPO = HERE.parents[2]
CASE_FILES = ["triton_kernel_cases.py", "fp8_kernel_cases.py", "fp8_moe_kernel_cases.py"]
INTERPRETER_ENV = {"TRITON_INTERPRET": "1", "KVIK_KERNEL_DEVICE": "cpu"}


def pytest_in_a_process_of_its_own(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    env = os.environ | INTERPRETER_ENV
    return subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)


def first_case_of_each_test(case_file: Path) -> list[str]:
    """The node ids of ``case_file``'s tests, the first parametrization of each function."""
    collected = pytest_in_a_process_of_its_own("--collect-only", str(case_file))
    assert collected.returncode == 0, collected.stdout[-20000:] + collected.stderr[-5000:]
    first: dict[str, str] = {}
    for line in collected.stdout.splitlines():
        if "::" in line and not line.startswith(" "):
            first.setdefault(line.split("[", 1)[0], line.strip())
    assert first, f"no test collected from {case_file}:\n{collected.stdout[-5000:]}"
    return list(first.values())


@pytest.mark.parametrize("case_file", CASE_FILES)
def test_kernel_cases_under_the_interpreter(case_file: str) -> None:
    selection = [str(HERE / case_file)]
    if os.environ.get("KVIK_INTERPRETER_CASES") == "first":
        selection = first_case_of_each_test(HERE / case_file)
    result = pytest_in_a_process_of_its_own(*selection)
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
