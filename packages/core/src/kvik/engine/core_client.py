"""The front end's side of the EngineCore process: start it, send it requests, receive outputs,
notice at once when it dies."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from kvik.config import EngineConfig
from kvik.engine.core_proc import (
    EngineCoreOutputs,
    EngineCoreRequest,
    encode,
    run_engine_core,
)
from kvik.request import Request

logger = logging.getLogger(__name__)

_message_decoder = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)


class EngineDeadError(RuntimeError):
    """The engine core process is gone (or never came up); no request can be served."""


class EngineRequestError(RuntimeError):
    """The engine core could not take one request (the core's log says why, in full); the core
    and its other requests run on."""


class EngineCoreClient:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.process: multiprocessing.process.BaseProcess | None = None
        self.error: EngineDeadError | None = None
        self.on_death: Callable[[EngineDeadError], None] | None = None
        self.ready_info: dict = {}  # what the core said when ready: pid, platform, device, dtype
        self._folder = Path(tempfile.mkdtemp(prefix="kvik-engine-"))
        self._sync_context = zmq.Context()
        self._async_context = zmq.asyncio.Context()
        self._input = self._sync_context.socket(zmq.PUSH)
        self._output = self._async_context.socket(zmq.PULL)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, ready_timeout_s: float = 600.0) -> dict:
        """Start the process and wait until its engine is built; returns its ``ready`` info."""
        input_address = f"ipc://{self._folder / 'input'}"
        output_address = f"ipc://{self._folder / 'output'}"
        # Sends never block: a message to a dead core is dropped, and its death is seen apart.
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(input_address)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_address)
        context = multiprocessing.get_context("spawn")
        self.process = context.Process(
            target=run_engine_core,
            # Its parent's pid from here: the core may only look once it is running.
            args=(self.config, input_address, output_address, os.getpid()),
            name="kvik-engine-core",
            daemon=True,
        )
        self.process.start()
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.process.sentinel, self._process_ended)
        deadline = self._loop.time() + ready_timeout_s
        while not await self._output.poll(200):
            if self.error is not None:
                raise self.error
            if self._loop.time() > deadline:
                raise EngineDeadError(f"the engine core did not start in {ready_timeout_s:.0f} s")
        kind, payload = _message_decoder.decode(await self._output.recv())
        if kind != "ready":
            self._die(EngineDeadError(f"the engine core failed to start: {_text(payload)}"))
            raise self.error
        info = self.ready_info = msgspec.msgpack.decode(payload)
        logger.info("engine core ready in process %d", info["pid"])
        return info

    def add_request(self, request: Request) -> None:
        self._send(encode("add", EngineCoreRequest.from_request(request)))

    def abort_requests(self, request_ids: list[str]) -> None:
        with contextlib.suppress(EngineDeadError):  # a dead core holds no requests
            self._send(encode("abort", request_ids))

    def _send(self, message: bytes) -> None:
        if self.error is not None:
            raise self.error
        try:
            self._input.send(message, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # no peer: the core is gone, though its exit is not seen yet
            raise EngineDeadError(f"the engine core is not reachable ({e})") from e

    async def get_outputs(self) -> EngineCoreOutputs:
        """The next step's outputs; raises EngineDeadError when the core reports a failure."""
        kind, payload = _message_decoder.decode(await self._output.recv())
        if kind == "error":
            self._die(EngineDeadError(f"the engine core failed: {_text(payload)}"))
            raise self.error
        return _outputs_decoder.decode(payload)

    def _process_ended(self) -> None:
        self.process.join(1.0)  # the pipe closes just before the exit status is there
        self._die(
            EngineDeadError(
                f"the engine core process (pid {self.process.pid}) died "
                f"(exit code {self.process.exitcode})"
            )
        )

    def _die(self, error: EngineDeadError) -> None:
        if self._loop is not None and self.process is not None:
            self._loop.remove_reader(self.process.sentinel)
        if self.error is not None:
            return
        self.error = error
        logger.error("%s", error)
        if self.on_death is not None:
            self.on_death(error)

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Ask the core to stop, wait for it, then terminate or kill it; always reaps it."""
        process = self.process
        if process is not None:
            if self._loop is not None:
                self._loop.remove_reader(process.sentinel)
            if process.is_alive():
                with contextlib.suppress(zmq.ZMQError):
                    self._input.send(encode("shutdown", None), flags=zmq.NOBLOCK)
                    await asyncio.to_thread(process.join, timeout_s)
            for stop in (process.terminate, process.kill):
                if not process.is_alive():
                    break
                stop()
                await asyncio.to_thread(process.join, 2.0)
        if self.error is None:
            self.error = EngineDeadError("the engine has been shut down")
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._sync_context.term()
        self._async_context.term()
        shutil.rmtree(self._folder, ignore_errors=True)


def _text(payload: msgspec.Raw) -> str:
    return str(msgspec.msgpack.decode(payload))
