"""A build lock left by a process that died while compiling the CPU ops is removed, so later
processes build instead of waiting on it forever; a fresh lock (a build in progress) is kept. A
first build is announced (a minute or more with nothing else printed), a cached one is not."""

from __future__ import annotations

import logging
import os
import time

from kvik_cpu.extension import STALE_LOCK_S, announce_build, clear_stale_lock


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
