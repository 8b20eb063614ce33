"""Each platform installed alone with its extra (``kvik[cpu]``, ``kvik[cuda]``, ``kvik[rocm]``) into
a fresh venv without this environment's packages, as a user installs it: every module of the
installed packages imports (so each package declares what it imports), ``kvik env`` lists the
platform as present and selected with its attention backends registered and no plugin errors, and
the platform's own attention backend is chosen once it is selected.

The GPUs are faked at the seam each platform detects them through: NVML for kvik-cuda (a stand-in
``pynvml`` module ahead of nvidia-ml-py's), and for kvik-rocm what a ROCm build of torch answers
(``torch.version.hip`` and ``torch.cuda``'s device queries, set by a sitecustomize).

Selected with ``-m packages_alone`` (or left out with ``-m "not packages_alone"``): it installs
from the package index, which pip's cache makes quick once warm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.packages_alone

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"

#: extra -> (package folders it installs beside core, import names to import every module of)
EXTRAS = {
    "cpu": (["platform-cpu", "models"], ["kvik", "kvik_cpu", "kvik_models"]),
    "cuda": (["platform-cuda", "models"], ["kvik", "kvik_cuda", "kvik_models"]),
    "rocm": (["platform-rocm", "models"], ["kvik", "kvik_rocm", "kvik_models"]),
}

FAKE_NVML = '''
"""A stand-in for nvidia-ml-py's pynvml: the NVML of a machine with one H100."""

from types import SimpleNamespace


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


def nvmlInit():
    pass


def nvmlShutdown():
    pass


def nvmlDeviceGetCount():
    return 1


def nvmlDeviceGetHandleByIndex(index):
    return index


def nvmlDeviceGetUUID(handle):
    return "GPU-4f1c2a3b-0000-0000-0000-000000000000"


def nvmlDeviceGetName(handle):
    return "NVIDIA H100 80GB HBM3"


def nvmlDeviceGetCudaComputeCapability(handle):
    return (9, 0)


def nvmlDeviceGetMemoryInfo(handle):
    return SimpleNamespace(total=80 * 1024**3, free=79 * 1024**3)
'''

FAKE_ROCM_TORCH = '''
"""sitecustomize: this CPU build of torch answers as a ROCm build with one MI300X."""

from types import SimpleNamespace

import torch

torch.version.hip = "6.4.0"
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_properties = lambda index=0: SimpleNamespace(
    name="AMD Instinct MI300X", gcnArchName="gfx942:sramecc+:xnack-", total_memory=192 * 1024**3
)
'''

#: The fake device of each extra: (file name, source), put on PYTHONPATH.
FAKES = {"cuda": ("pynvml.py", FAKE_NVML), "rocm": ("sitecustomize.py", FAKE_ROCM_TORCH)}

IMPORT_ALL = """
import importlib, pkgutil, sys
# What an extra brings, by the modules that need it: kvik.triton_kernels needs triton (only the
# GPU platforms install it), kvik bench serve's client aiohttp (kvik[bench]).
optional = {"kvik.triton_kernels.": "triton", "kvik.bench.http_client": "aiohttp"}
for top in sys.argv[1:]:
    package = importlib.import_module(top)
    for module in pkgutil.walk_packages(package.__path__, top + "."):
        if module.name.endswith(".__main__"):
            continue  # runs the command line
        try:
            importlib.import_module(module.name)
        except ModuleNotFoundError as e:
            if not any(
                module.name.startswith(prefix) and e.name == extra
                for prefix, extra in optional.items()
            ):
                raise SystemExit(f"{module.name}: {e}")
"""

SELECTED_BACKEND = """
import json, torch
from kvik.attention.selector import select_attention_backend
from kvik.platforms.selection import select_platform
platform = select_platform()
platform.on_selected()
backend = select_attention_backend(platform, torch.bfloat16, 128, 16)
report = {"platform": platform.name, "backend": backend.name}
if backend.name == "TRITON_ATTN":
    from kvik.triton_kernels.attention import attention_config
    arch = {"cuda": "sm90", "rocm": "gfx942"}[platform.name]
    report["config"] = list(vars(attention_config(arch, 128, 4, 1, torch.bfloat16)).values())
print(json.dumps(report))
"""


def run(python: Path, *args: str, env: dict[str, str] | None = None, timeout: int = 900) -> str:
    result = subprocess.run(
        [str(python), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, f"{args[:4]}:\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv without this environment's site-packages, holding torch and hatchling only."""
    path = tmp_path_factory.mktemp("base") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    # torch alone first: 2.13.0 resolves to the CPU build. hatchling: the kvik packages build
    # without isolation, from the venv.
    run(path / "bin" / "python", "-m", "pip", "install", "--quiet", "torch==2.13.0", "hatchling")
    return path


def fresh_venv(base: Path, path: Path, extra: str) -> Path:
    """A copy of the base venv (hard links: unpacking torch again would take a minute, and pip
    only ever adds or removes files, never rewrites one in place) with core and ``extra``
    installed from the package folders; pip resolves kvik-cpu etc. to the folders given beside
    it, and everything else from the package index."""
    subprocess.run(["cp", "-al", str(base), str(path)], check=True, timeout=300)
    python = path / "bin" / "python"
    folders, _ = EXTRAS[extra]
    run(
        python,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-build-isolation",
        f"{PACKAGES / 'core'}[{extra}]",
        *(str(PACKAGES / folder) for folder in folders),
    )
    return python


def clean_env(python: Path, fake_dir: Path | None) -> dict[str, str]:
    """The environment of an activated venv (its bin first on PATH: ninja is there), no KVIK_*
    settings, and the fake device's folder as PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVIK_", "PYTHON"))}
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    if fake_dir is not None:
        env["PYTHONPATH"] = str(fake_dir)
    return env


@pytest.fixture(scope="module")
def installed(base_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future]:
    """Each extra's venv, installed by three pips at once (each mostly waits on the index and
    the disk: one after another they took 4 of CI's minutes)."""
    with ThreadPoolExecutor(max_workers=len(EXTRAS)) as pool:
        return {
            extra: pool.submit(
                fresh_venv, base_venv, tmp_path_factory.mktemp(extra) / "venv", extra
            )
            for extra in EXTRAS
        }


@pytest.mark.parametrize("extra", list(EXTRAS))
def test_platform_installed_alone_with_its_extra(
    extra: str, installed: dict[str, Future], tmp_path: Path
) -> None:
    python = installed[extra].result()  # the install's error, if it failed
    _, modules = EXTRAS[extra]

    # Every module of every installed package imports: nothing undeclared is missing.
    run(python, "-c", IMPORT_ALL, *modules, env=clean_env(python, None))

    fake_dir = None
    if extra in FAKES:
        fake_dir = tmp_path / "fake-device"
        fake_dir.mkdir()
        name, source = FAKES[extra]
        (fake_dir / name).write_text(textwrap.dedent(source))
    env = clean_env(python, fake_dir)

    report = json.loads(run(python, "-m", "kvik", "env", "--json", env=env))
    assert report["errors"] == []
    # core's own plugin registers its quantization methods
    assert {p["name"] for p in report["plugins"]} == {extra, "models", "quantization"}
    [platform] = report["platforms"]
    assert platform["name"] == extra and platform["present"] and platform["selected"]
    expected_methods = [] if extra == "rocm" else ["compressed-tensors", "fp8", "modelopt"]
    assert platform["quantization_methods"] == expected_methods
    assert report["selected_platform"] == extra
    registered = {b["name"]: b for b in report["attention_backends"]}
    assert platform["attention_backends"]
    for name in platform["attention_backends"]:
        assert registered[name]["plugin"] == extra, (name, registered)
    if extra == "cuda":
        [gpu] = platform["details"]["gpus"]
        assert (gpu["sm"], gpu["generation"]) == ("sm90", "Hopper")
    if extra == "rocm":
        [gpu] = platform["details"]["gpus"]
        assert (gpu["arch"], gpu["product"]) == ("gfx942", "MI300X")

    # Selected, the platform registers its kernels and its first backend is the one chosen; on
    # the GPUs, the launch configuration comes from that platform's own tuning.
    chosen = json.loads(run(python, "-c", SELECTED_BACKEND, env=env).strip().splitlines()[-1])
    assert chosen["platform"] == extra
    assert chosen["backend"] == platform["attention_backends"][0]
    if extra == "cuda":
        assert chosen["config"] == [16, 64, 2, 3]  # block_m, tile_n, warps, stages on sm90
    if extra == "rocm":
        assert chosen["config"] == [16, 32, 4, 1]  # MI300X's narrower tiles, no pipelining
