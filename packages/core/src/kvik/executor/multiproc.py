"""One process per rank on this host (``--distributed-executor-backend mp``).

The engine core's process holds the scheduler; each rank's process holds a ``Worker``
(kvik.executor.rank_process). Each step's schedule is encoded once (only what the ranks do not
have yet: kvik.executor.schedule_wire) and the same bytes are handed to every rank's ZMQ socket
without a copy; rank 0 alone sends its sampled tokens back. Rank processes are watched through
their sentinels: one that dies, reports an error or does not answer in time stops the engine with
``RankFailedError``, and ``shutdown`` ends every rank (asked, then terminated, then killed).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from kvik.executor.base import Executor, RankFailedError
from kvik.executor.rank_process import encode, run_rank
from kvik.executor.schedule_wire import ScheduleSender
from kvik.worker.step_io import ModelRunnerOutput

if TYPE_CHECKING:
    from kvik.config import EngineConfig
    from kvik.platforms.base import Platform
    from kvik.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)

#: The longest wait for a rank's answer (model loading and profiling included) before the engine
#: gives up on it; a rank that dies is noticed at once.
RANK_TIMEOUT_S = float(os.environ.get("KVIK_RANK_TIMEOUT_S", "600"))
#: How long ranks get to leave on their own at shutdown before they are terminated.
SHUTDOWN_GRACE_S = 5.0

_reply_decoder = msgspec.msgpack.Decoder(tuple[int, str, msgspec.Raw])
_output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)


class MultiprocExecutor(Executor):
    name = "mp"

    def __init__(self, config: EngineConfig, platform: type[Platform]) -> None:
        super().__init__(config, platform)
        self._closed = False
        self._folder = Path(tempfile.mkdtemp(prefix="kvik-ranks-"))
        self._context = zmq.Context()
        self._replies = self._context.socket(zmq.PULL)
        self._replies.setsockopt(zmq.LINGER, 0)
        self._replies.bind(f"ipc://{self._folder / 'replies'}")
        self._inputs = []
        for rank in range(self.world_size):
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"ipc://{self._folder / f'rank{rank}'}")
            self._inputs.append(sock)
        self._sender = ScheduleSender()
        self._num_launched = 0
        self._outputs: dict[int, ModelRunnerOutput] = {}
        self._num_received = 0
        self._processes: list[multiprocessing.process.BaseProcess] = []
        try:
            self._start_ranks()
            self._wait_all("ready")
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d ranks ready in processes %s", self.world_size, self.rank_pids)

    @property
    def rank_pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def _start_ranks(self) -> None:
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        context = multiprocessing.get_context("spawn")
        with _children_allowed():
            for rank in range(self.world_size):
                process = context.Process(
                    target=run_rank,
                    args=(
                        self.config,
                        self.platform,
                        rank,
                        rank,  # one host: the local rank is the rank
                        init_method,
                        f"ipc://{self._folder / f'rank{rank}'}",
                        f"ipc://{self._folder / 'replies'}",
                        os.getpid(),  # the rank may only look once it is running
                    ),
                    name=f"kvik-rank-{rank}",
                    daemon=True,
                )
                process.start()
                self._processes.append(process)

    # --- talking to ranks -----------------------------------------------------------------
    def _broadcast(self, message: bytes) -> None:
        self.check_health()
        for sock in self._inputs:  # one buffer, handed to every rank's socket without a copy
            sock.send(message, copy=False)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        self._broadcast(encode("rpc", [method, list(args)]))
        return self._wait_all("rpc")

    def launch(self, scheduler_output: SchedulerOutput) -> _MultiprocPending:
        self._broadcast(encode("step", self._sender.message(scheduler_output)))
        index = self._num_launched
        self._num_launched += 1
        return _MultiprocPending(self, index)

    def _output(self, index: int) -> ModelRunnerOutput:
        while index not in self._outputs:
            self._receive(f"the output of step {index}")
        return self._outputs.pop(index)

    def _wait_all(self, kind: str) -> list[Any]:
        results: dict[int, Any] = {}
        while len(results) < self.world_size:
            reply = self._receive(f"every rank's {kind!r}")
            if reply is not None and reply[1] == kind:
                results[reply[0]] = msgspec.msgpack.decode(reply[2])
        return [results[rank] for rank in range(self.world_size)]

    def _receive(self, awaited: str) -> tuple[int, str, msgspec.Raw] | None:
        """One reply (a step's output is stored, not returned); raises when a rank fails."""
        deadline = time.monotonic() + RANK_TIMEOUT_S
        while not self._replies.poll(100):
            self.check_health()
            if time.monotonic() > deadline:
                self._fail(
                    f"no rank answered in {RANK_TIMEOUT_S:.0f} s while waiting for {awaited}"
                )
        rank, kind, payload = _reply_decoder.decode(self._replies.recv())
        if kind == "error":
            self._fail(f"rank {rank} failed: {msgspec.msgpack.decode(payload)}")
        if kind == "step":
            self._outputs[self._num_received] = _output_decoder.decode(payload)
            self._num_received += 1
            return None
        return rank, kind, payload

    def check_health(self) -> None:
        if self._closed:
            raise RankFailedError("the executor has been shut down")
        sentinels = [p.sentinel for p in self._processes]
        if multiprocessing.connection.wait(sentinels, timeout=0):
            dead = [p for p in self._processes if not p.is_alive()]
            for p in dead:
                p.join(1.0)  # the sentinel fires just before the exit status is there
            self._fail(
                "rank process died: "
                + ", ".join(f"{p.name} (pid {p.pid}, exit code {p.exitcode})" for p in dead)
            )

    def _fail(self, message: str) -> None:
        logger.error("%s; stopping every rank", message)
        self.shutdown()
        raise RankFailedError(message)

    # --- stopping -------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        alive = [p for p in self._processes if p.is_alive()]
        if alive:
            with contextlib.suppress(zmq.ZMQError):
                for sock in self._inputs:
                    sock.send(encode("shutdown", None), flags=zmq.NOBLOCK)
            deadline = time.monotonic() + SHUTDOWN_GRACE_S
            for p in alive:
                p.join(max(0.0, deadline - time.monotonic()))
        for stop in ("terminate", "kill"):
            alive = [p for p in self._processes if p.is_alive()]
            for p in alive:
                getattr(p, stop)()
            for p in alive:
                p.join(2.0)
        for sock in [*self._inputs, self._replies]:
            sock.close(linger=0)
        self._context.term()
        shutil.rmtree(self._folder, ignore_errors=True)


class _MultiprocPending:
    def __init__(self, executor: MultiprocExecutor, index: int) -> None:
        self._executor = executor
        self._index = index
        self._output: ModelRunnerOutput | None = None

    def collect(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._executor._output(self._index)
        return self._output


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """Let a daemonic process (the server's engine core) start the rank processes.

    multiprocessing refuses children to a daemonic process because it would not reap them when it
    is terminated. Here nothing is left behind: the executor ends its ranks at shutdown, on any
    failure and when its process exits (they are daemonic themselves), and a rank whose parent is
    gone exits on its own (kvik.executor.rank_process).
    """
    config = multiprocessing.current_process()._config
    daemon = config.pop("daemon", None)
    try:
        yield
    finally:
        if daemon is not None:
            config["daemon"] = daemon
