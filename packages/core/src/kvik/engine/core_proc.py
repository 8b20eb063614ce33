"""The EngineCore in a process of its own, driven over ZMQ by ``EngineCoreClient``.

Wire format (msgspec msgpack), each message a ``(kind, payload)`` pair:

- front end -> core: ``("add", EngineCoreRequest)``, ``("abort", [request ids])``, ``("shutdown", None)``;
- core -> front end: ``("ready", {"pid", "rank_pids", "num_kv_blocks", "platform", "device",
  "dtype"})`` once the engine is built (``device`` as torch names it, e.g. "NVIDIA H200"),
  ``("outputs", EngineCoreOutputs)`` after every step (and after aborts), ``("error", message)``
  before the process exits on an exception. A request the core cannot take (it does not decode,
  or the engine refuses it) ends alone: an output with finish_reason ``"error"`` and the reason as
  its stop_reason.

The loop blocks on its input socket while there is no work, so an idle engine costs no CPU; it
wakes once a second to leave if its parent has died, and to fail (an ``error`` message, then exit)
if one of its executor's ranks has died.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import signal
import time
import traceback
from typing import Any

import msgspec

from kvik.config import EngineConfig
from kvik.request import Request
from kvik.sampling_params import SamplingParams
from kvik.scheduler.output import EngineCoreOutput, SchedulerStats

logger = logging.getLogger(__name__)

_PARENT_CHECK_MS = 1000


class EngineCoreRequest(msgspec.Struct, array_like=True):
    """A ``Request`` as it travels to the core: what the front end resolved, nothing derived."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_ids: list[int]
    arrival_time: float
    priority: int
    bad_words_token_ids: list[list[int]]

    @classmethod
    def from_request(cls, request: Request) -> EngineCoreRequest:
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            request.max_tokens,
            sorted(request.eos_token_ids),
            request.arrival_time,
            request.priority,
            request.bad_words_token_ids,
        )

    def to_request(self) -> Request:
        return Request(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params,
            max_tokens=self.max_tokens,
            eos_token_ids=frozenset(self.eos_token_ids),
            arrival_time=self.arrival_time,
            priority=self.priority,
            bad_words_token_ids=self.bad_words_token_ids,
        )


def _request_id(payload: msgspec.Raw) -> str | None:
    """The id of an ``add`` payload that does not decode as an EngineCoreRequest (its first
    field), or None if there is none to read."""
    try:
        fields = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    if isinstance(fields, list) and fields and isinstance(fields[0], str):
        return fields[0]
    return None


def _named_fields(message: str) -> str:
    """msgspec's message about an EngineCoreRequest with the field's name for its position
    (the struct travels as an array: ``$[1][0]`` is ``prompt_token_ids[0]``)."""
    names = EngineCoreRequest.__struct_fields__

    def name(match: re.Match) -> str:
        index = int(match.group(1))
        return names[index] if index < len(names) else match.group(0)

    return re.sub(r"\$\[(\d+)\]", name, message, count=1)


class EngineCoreOutputs(msgspec.Struct, array_like=True):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    # Request id -> time.monotonic() of the step that first scheduled it (for queue-time metrics).
    scheduled: dict[str, float]


_input_decoder = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
_ids_decoder = msgspec.msgpack.Decoder(list[str])
_encoder = msgspec.msgpack.Encoder()


def encode(kind: str, payload: Any) -> bytes:
    return _encoder.encode((kind, payload))


def run_engine_core(
    config: EngineConfig, input_address: str, output_address: str, parent_pid: int | None = None
) -> None:
    """The process's entry point (started with spawn by ``EngineCoreClient``). ``parent_pid``:
    the front end's pid, which the core leaves when it is gone (default: the parent now)."""
    # Taken before anything slow: a front end that dies while the engine is built (seconds to
    # minutes) leaves the core to init, whose pid read afterwards would pass for its parent's.
    if parent_pid is None:
        parent_pid = os.getppid()
    import zmq

    # Ctrl-C, and a SIGTERM sent to the whole group (timeout, systemd), reach this process too:
    # the front end decides when the core stops, so requests in flight can finish first. The core
    # leaves on its "shutdown" message, when its parent is gone, or by SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    input_socket.connect(input_address)
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)
    output_socket.connect(output_address)
    engine = None
    try:
        from kvik.engine.core import EngineCore

        engine = EngineCore(config)
        # What start-up made (the model's modules and parameters, graphs, buffers) lives as long
        # as this process: out of the collector's sight, a full collection during serving walks
        # only what the steps make. (The offline LLM shares its process with the caller's objects,
        # which it must not pin, so only the engine's own process does this.)
        gc.collect()
        gc.freeze()
        output_socket.send(encode("ready", _ready_info(engine)))
        EngineCoreProc(engine, input_socket, output_socket, parent_pid).run()
    except BaseException as e:
        logger.exception("engine core failed")
        message = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        output_socket.send(encode("error", message))
        raise SystemExit(1) from e
    finally:
        if engine is not None:
            engine.shutdown()  # the executor's rank processes, if any, end with the core
        output_socket.close(linger=1000)
        input_socket.close(linger=0)
        context.term()


def _ready_info(engine: Any) -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "rank_pids": engine.executor.rank_pids,
        "num_kv_blocks": engine.num_kv_blocks,
        "platform": engine.platform.name,
        "device": engine.rank0["device"],  # rank 0's, named in its own process
        "dtype": str(engine.config.model.dtype).removeprefix("torch."),
    }


class EngineCoreProc:
    def __init__(
        self, engine: Any, input_socket: Any, output_socket: Any, parent_pid: int | None = None
    ) -> None:
        self.engine = engine  # kvik.engine.core.EngineCore
        self.input = input_socket
        self.output = output_socket
        self.parent_pid = os.getppid() if parent_pid is None else parent_pid
        self.pending: list[EngineCoreOutput] = []  # abort outputs not yet sent
        self.seen_scheduled: set[str] = set()
        self.running = True

    def run(self) -> None:
        while self.running:
            self._handle_inputs(block=not self.engine.has_unfinished_requests())
            self.running = self.running and self._parent_alive()
            if self.pending:
                self._send(self.pending, {})
                self.pending = []
            if self.running and self.engine.has_unfinished_requests():
                self._step()

    def _handle_inputs(self, block: bool) -> None:
        if block:
            while not self.input.poll(_PARENT_CHECK_MS):
                if not self._parent_alive():
                    return
                # An idle engine notices a lost rank too, not only at its next step.
                self.engine.check_health()
        while self.running and self.input.poll(0):
            kind, payload = _input_decoder.decode(self.input.recv())
            if kind == "add":
                self._add(payload)
            elif kind == "abort":
                ids = _ids_decoder.decode(payload)
                self.pending.extend(self.engine.abort_requests(ids))
                self.seen_scheduled.difference_update(ids)
            elif kind == "shutdown":
                self.running = False
            else:
                raise ValueError(f"unknown message kind {kind!r}")

    def _add(self, payload: msgspec.Raw) -> None:
        """Add one request; one the core cannot take (its fields do not decode, or the engine
        refuses it) fails alone, with an ``error`` finish whose stop_reason says why, instead of
        ending the process and every other request with it."""
        try:
            self.engine.add_request(_request_decoder.decode(payload).to_request())
        except Exception as e:
            logger.exception("the engine core refused a request")
            request_id = _request_id(payload)
            # (An id the engine holds is another request's, which the refusal must not end; the
            # front end never reuses a live id, so this is only a guard.)
            if request_id is not None and request_id not in self.engine.scheduler.requests:
                reason = f"the engine core refused the request: {_named_fields(str(e))}"
                self.pending.append(EngineCoreOutput(request_id, [], "error", reason))

    def _parent_alive(self) -> bool:
        if os.getppid() == self.parent_pid:
            return True
        logger.warning("the front end process is gone: engine core exiting")
        self.running = False
        return False

    def _step(self) -> None:
        started = time.monotonic()
        outputs = self.engine.step()
        scheduled = {}
        for request in self.engine.scheduler.running:
            if request.request_id not in self.seen_scheduled:
                self.seen_scheduled.add(request.request_id)
                scheduled[request.request_id] = started
        for out in outputs:
            if out.finish_reason is not None:
                self.seen_scheduled.discard(out.request_id)
        self._send(outputs, scheduled)

    def _send(self, outputs: list[EngineCoreOutput], scheduled: dict[str, float]) -> None:
        payload = EngineCoreOutputs(outputs, self.engine.scheduler.stats, scheduled)
        self.output.send(encode("outputs", payload))
