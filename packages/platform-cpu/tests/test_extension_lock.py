"""A build lock left by a process that died while compiling the CPU ops does not make later
processes wait on it forever: ``build.flock`` goes with its holder, and torch's lock file found
under it is removed; without flock, a torch lock older than a build can take is removed and a fresh
one (a build in progress) kept. A first build is announced (a minute or more with nothing else
printed), a cached one is not."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

from kvik_cpu.extension import STALE_LOCK_S, announce_build, build_lock, clear_stale_lock


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    assert not clear_stale_lock(tmp_path)  # no lock: nothing to do
    lock.touch()
    assert not clear_stale_lock(tmp_path) and lock.exists()
    old = time.time() - STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path) and not lock.exists()


def test_a_first_build_is_announced_and_a_cached_one_is_not(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="kvik_cpu.extension"):
        assert announce_build(tmp_path, "kvik_cpu_ops_0123")
        assert "compiling kvik_cpu's C++ ops" in caplog.text and str(tmp_path) in caplog.text
        caplog.clear()
        (tmp_path / "kvik_cpu_ops_0123.so").touch()
        assert not announce_build(tmp_path, "kvik_cpu_ops_0123")
        assert caplog.text == ""


def test_a_builder_killed_holding_the_build_lock_does_not_block_the_next(tmp_path):
    """A process that dies mid-build leaves torch's ``lock`` file; its ``build.flock`` goes with it.
    The next process waits while the builder lives, then takes the lock and drops torch's file (a
    waiter on that file alone waited forever: CI's kvik[cpu] test timed out behind one)."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, pathlib, sys, time\n"
            "d = pathlib.Path(sys.argv[1])\n"
            "f = open(d / 'build.flock', 'a')\n"
            "fcntl.flock(f, fcntl.LOCK_EX)\n"
            "(d / 'lock').touch()  # torch's lock, as a build in progress holds it\n"
            "print('held', flush=True)\n"
            "time.sleep(600)\n",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        acquired = threading.Event()

        def take() -> None:
            with build_lock(tmp_path):
                assert not (tmp_path / "lock").exists()
                acquired.set()

        waiter = threading.Thread(target=take, daemon=True)
        waiter.start()
        assert not acquired.wait(1.0)  # the builder is alive: wait for it
        holder.send_signal(signal.SIGKILL)
        assert acquired.wait(30.0)  # its flock went with it; its torch lock is removed
        waiter.join(30.0)
    finally:
        holder.kill()
        holder.wait()


def test_the_build_lock_is_taken_at_once_when_free_and_keeps_no_torch_lock(tmp_path):
    with build_lock(tmp_path):
        assert (tmp_path / "build.flock").exists() and not (tmp_path / "lock").exists()
    with build_lock(tmp_path):  # released on leaving: taken again
        pass


def test_a_built_library_is_loaded_without_the_builder(tmp_path):
    """Another process (another virtual environment, as nox's sessions are) with the same torch
    loads the cached library as it is: torch's builder, which would compile it all again for the
    other environment's include paths, is not called."""
    import pytest

    from kvik_cpu import extension

    if (failure := extension.load()) is not None:
        pytest.skip(f"kvik_cpu's C++ ops did not build here: {failure}")
    script = (
        "import torch, torch.utils.cpp_extension as builder\n"
        "def refuse(*args, **kwargs):\n"
        "    raise AssertionError('the cached library was built again')\n"
        "builder.load = refuse\n"
        "from kvik_cpu import extension\n"
        "assert extension.load() is None, extension.load()\n"
        "assert hasattr(torch.ops.kvik_cpu, 'paged_attention')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]


def test_an_unloadable_library_is_built_again(tmp_path, monkeypatch, caplog):
    """A file that is no library (a build killed while linking) is reported and handed to the
    builder, not loaded."""
    import torch.utils.cpp_extension as builder

    from kvik_cpu import extension

    (tmp_path / "kvik_cpu_ops_0123.so").write_bytes(b"not an ELF file")
    calls = []
    monkeypatch.setattr(builder, "load", lambda **kwargs: calls.append(kwargs))
    with caplog.at_level(logging.WARNING, logger="kvik_cpu.extension"):
        extension._build_or_load("kvik_cpu_ops_0123", tmp_path)
    assert "building it again" in caplog.text
    assert [c["name"] for c in calls] == ["kvik_cpu_ops_0123"]
    assert calls[0]["extra_cflags"] == extension.CFLAGS
