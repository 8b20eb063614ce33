"""kvik_cpu's C++ ops (csrc/), compiled on first use for this machine's CPU and cached.

The sources are built with ``torch.utils.cpp_extension`` (a C++ compiler and ninja, the same
toolchain TorchInductor needs on the CPU) into ``$KVIK_CACHE/torch_extensions`` (default
``~/.cache/kvik``), under a name that includes a hash of the sources, the torch version and the
CPU's flags: ``-march=native`` code must not run on another CPU. The first build is slow (a C++
compile); later processes load the cached library. Where building fails, ``load()`` says why and the
platform falls back to PyTorch's SDPA (kvik_cpu.attention).

Processes that start together (an engine's ranks, a test suite beside a server) build once: each
takes ``build.flock`` (an ``flock`` the kernel drops when its holder exits, however it exits) before
torch's own build step. torch's lock is a plain file that a killed builder leaves behind, and a
process waiting on it waits forever (CI's test of an installed kvik[cpu] hung 15 min behind one).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import torch

import kvik.ops  # noqa: F401  (defines the torch.ops.kvik.* ops whose CPU kernels load here)
from kvik_cpu.isa import cpu_flags

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(
    CSRC / name
    for name in (
        "paged_attention.cpp",
        "small_ops.cpp",
        "amx_linear.cpp",
        "bf16_linear.cpp",
        "decode_layers.cpp",
        "isa.cpp",
    )
)
HEADERS = (CSRC / "amx.h", CSRC / "ops.h", CSRC / "vector_math.h")


def _build_dir() -> Path:
    root = os.environ.get("KVIK_CACHE") or os.path.join(Path.home(), ".cache", "kvik")
    return Path(root) / "torch_extensions"


#: A build lock older than this was left by a process that died while building (a build takes a
#: minute or two): torch's lock has no owner to check, and every later process would wait on it
#: forever.
STALE_LOCK_S = 900


def clear_stale_lock(build_dir: Path, now: float | None = None) -> bool:
    """Remove ``build_dir``'s build lock if it is older than ``STALE_LOCK_S``; True if it did."""
    lock = build_dir / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False
    logger.warning(
        "removing %s, a build lock %.0f s old: a process building the CPU ops died holding it",
        lock, age,
    )  # fmt: skip
    lock.unlink(missing_ok=True)
    return True


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold ``build_dir``'s ``build.flock`` (waiting for a process building now to finish).

    Held, no other kvik process is building here, so torch's ``lock`` file, if there is one, was
    left by a builder that died: it is removed, or torch would wait on it forever. Where the file
    system has no ``flock``, torch's lock alone is used, with stale ones cleared by age.
    """
    torch_lock = build_dir / "lock"
    # Closing the file releases the flock.
    with open(build_dir / "build.flock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process building kvik_cpu's C++ ops in %s", build_dir)
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # no flock on this file system
            clear_stale_lock(build_dir)
            yield
            return
        if torch_lock.exists():
            logger.warning(
                "removing %s: a process building the CPU ops died holding it", torch_lock
            )
            torch_lock.unlink(missing_ok=True)
        yield


def announce_build(build_dir: Path, name: str) -> bool:
    """Say that the ops are about to be compiled when ``build_dir`` holds no library of them yet
    (the first start on a machine: about 20 s on two idle cores, minutes on busy ones, with
    nothing else printed meanwhile); True if it did."""
    if (build_dir / f"{name}.so").exists():
        return False
    logger.warning(
        "compiling kvik_cpu's C++ ops for this CPU with the system's C++ compiler (once, cached "
        "in %s)",
        build_dir,
    )
    return True


@cache
def load() -> str | None:
    """Build (or load the cached build of) the ops; None on success, else why it failed."""
    if hasattr(torch.ops.kvik_cpu, "paged_attention"):
        return None
    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(sorted(cpu_flags())).encode())
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    name = f"kvik_cpu_ops_{digest.hexdigest()[:16]}"
    build_dir = _build_dir() / name
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with build_lock(build_dir):
            announce_build(build_dir, name)
            _build_or_load(name, build_dir)
    except Exception as e:  # noqa: BLE001  (a missing compiler or ninja, a failed build)
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}"
        logger.warning("kvik_cpu's C++ ops did not build (%s); using PyTorch SDPA", reason)
        return reason
    _register_fakes()
    return None


#: The compiler's and linker's flags (in the library's name: a change builds it again).
CFLAGS = [
    "-O3",
    "-march=native",
    # at::parallel_for is inline OpenMP code: without -fopenmp it runs on one thread. The library
    # then needs libgomp.so.1, which torch has loaded already.
    "-fopenmp",
    # No -ffast-math: the kernels round where their references do, which approximate reciprocals
    # and finite-only math break (silu gave NaN below -89). expf's calls in omp simd loops go to
    # glibc's vector expf (libmvec) through vector_math.h; without errno they have no side effect
    # to keep in order.
    "-fno-math-errno",
]
LDFLAGS = ["-fopenmp", "-lmvec"]


def _build_or_load(name: str, build_dir: Path) -> None:
    """Load ``build_dir``'s library where one was built, else build it.

    The name already pins what the library depends on (sources, torch version, CPU flags, compiler
    flags), so a library there is loaded as it is: torch's own loader would compare its build
    file's include paths, which name the virtual environment that built it, and compile it all
    again for every other environment with the same torch (a minute on two cores).
    """
    library = build_dir / f"{name}.so"
    if library.exists():
        try:
            torch.ops.load_library(str(library))
            return
        except OSError as e:  # a truncated or foreign file: build it again below
            logger.warning("could not load %s (%s); building it again", library, e)
    from torch.utils.cpp_extension import load as load_extension

    load_extension(
        name=name,
        sources=[str(s) for s in SOURCES],
        extra_cflags=CFLAGS,
        extra_ldflags=LDFLAGS,
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )


def _register_fakes() -> None:
    """The output of each op a model's layers call, for torch.compile's tracing: dynamo runs the
    model on fake tensors, which the C++ kernels cannot read (a compiled bf16 model failed at its
    first linear layer without these)."""

    def linear(x, packed, out_features, bias_fp32=None, fp32_out=False):
        return x.new_empty(x.shape[0], out_features, dtype=torch.float32 if fp32_out else x.dtype)

    def amx_linear(x, packed, out_features, bias_fp32=None):
        return x.new_empty(x.shape[0], out_features)

    def moe_experts(rows, counts, gate_up, down, intermediate):
        return rows.new_empty(rows.shape)

    def moe(hidden, weights, ids, gate_up, down, intermediate):
        return hidden.new_empty(hidden.shape)

    for name, fake in (
        ("bf16_linear", linear),
        ("amx_linear", amx_linear),
        ("bf16_moe_experts", moe_experts),
        ("bf16_moe", moe),
    ):
        torch.library.register_fake(f"kvik_cpu::{name}", fake)
