"""Processes whose parent died while they started leave: the engine core whose front end died,
the ranks whose engine died. Each test starts real processes and waits for them to build an
engine (tens of seconds on 2 cores), so nox runs this file in the background group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from process_checks import alive

_FRONT_END_DYING_AT_START = """
import asyncio, os, sys
from kvik.engine.args import EngineArgs
from kvik.engine.core_client import EngineCoreClient

config = EngineArgs(
    model=sys.argv[1], dtype="float32", device="cpu", num_kv_blocks=32, max_model_len=128
).create_engine_config()
client = EngineCoreClient(config)

async def main():
    asyncio.ensure_future(client.start())
    while client.process is None or client.process.pid is None:
        await asyncio.sleep(0.01)
    with open(sys.argv[2], "w") as f:
        f.write(str(client.process.pid))
    os._exit(0)  # dies (as by SIGKILL) while its engine core is still being built

asyncio.run(main())
"""


def test_an_engine_core_whose_front_end_died_during_start_up_exits(tiny_model, tmp_path):
    """The core leaves when its front end is gone (it ignores SIGTERM); it took the parent's pid
    once its engine was built, so a front end that died during start-up left a core that took
    init for its parent and never left."""
    pid_file = tmp_path / "core.pid"
    subprocess.run(
        [sys.executable, "-c", _FRONT_END_DYING_AT_START, str(tiny_model("llama")), pid_file],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,  # not a pipe: the core would hold it open
        stderr=subprocess.DEVNULL,
        timeout=120,
        check=True,
    )
    core = int(pid_file.read_text())
    try:
        deadline = time.monotonic() + 90
        while alive(core) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(core), "the engine core outlived its front end"
    finally:
        if alive(core):
            os.kill(core, signal.SIGKILL)


_ENGINE_DYING_AS_RANKS_START = """
import multiprocessing, os, sys, threading, time
from kvik import LLM

def die_once_ranks_run():
    while len(ranks := multiprocessing.active_children()) < 2:
        time.sleep(0.01)
    with open(sys.argv[2], "w") as f:
        f.write(" ".join(str(p.pid) for p in ranks))
    os._exit(0)  # dies (as by SIGKILL) while its ranks build their workers

threading.Thread(target=die_once_ranks_run, daemon=True).start()
LLM(sys.argv[1], dtype="float32", device="cpu", num_kv_blocks=32, max_model_len=128,
    tensor_parallel_size=2)
time.sleep(600)
"""


def test_ranks_whose_engine_died_during_start_up_exit(tiny_model, tmp_path):
    """As the engine core's: a rank took its parent's pid once its worker was built, so an engine
    that died meanwhile left ranks that took init for their parent and never left."""
    pid_file = tmp_path / "ranks.pid"
    subprocess.run(
        [sys.executable, "-c", _ENGINE_DYING_AS_RANKS_START, str(tiny_model("llama")), pid_file],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,  # not pipes: the ranks would hold them open
        stderr=subprocess.DEVNULL,
        timeout=120,
        check=True,
    )
    ranks = [int(pid) for pid in pid_file.read_text().split()]
    try:
        deadline = time.monotonic() + 90
        while any(alive(rank) for rank in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(rank) for rank in ranks), "a rank outlived its engine"
    finally:
        for rank in ranks:
            if alive(rank):
                os.kill(rank, signal.SIGKILL)
