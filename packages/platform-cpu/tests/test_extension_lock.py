"""A build lock left by a process that died while compiling the CPU ops is removed, so later
processes build instead of waiting on it forever; a fresh lock (a build in progress) is kept."""

from __future__ import annotations

import os
import time

from kvik_cpu.extension import STALE_LOCK_S, clear_stale_lock


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    assert not clear_stale_lock(tmp_path)  # no lock: nothing to do
    lock.touch()
    assert not clear_stale_lock(tmp_path) and lock.exists()
    old = time.time() - STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path) and not lock.exists()
