"""The process of one rank under ``MultiprocExecutor``: a ``Worker`` driven over ZMQ.

Messages from the executor (msgspec msgpack, ``(kind, payload)``): ``("rpc", [method, args])``,
``("step", StepMessage)``, ``("shutdown", None)``. Replies, each ``(rank, kind, payload)``:
``("ready", None)`` once the worker is built, ``("rpc", result)``, ``("step", ModelRunnerOutput)``
from rank 0 only, ``("error", text)`` before the process exits on an exception.

Steps overlap as in the engine core: while a launched step runs on the device, the rank waits for
whichever comes first, the next message or the step's end. A next step that comes first is
launched before the running one is collected, so the device goes from one step to the next
without waiting for the host (under asynchronous scheduling the engine core sends step N+1 before
it waits for N); a step that ends first has its tokens sent at once, so a synchronous engine core,
which waits for them before it sends anything, never waits on a rank.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from typing import TYPE_CHECKING, Any

import msgspec

from kvik.executor.schedule_wire import RankRequests, StepMessage

if TYPE_CHECKING:
    from kvik.config import EngineConfig
    from kvik.platforms.base import Platform
    from kvik.worker.step_io import PendingStep

logger = logging.getLogger(__name__)

#: How often a rank waiting for work checks that the engine core is still there.
_PARENT_CHECK_MS = 1000

_message_decoder = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_step_decoder = msgspec.msgpack.Decoder(StepMessage)
_encoder = msgspec.msgpack.Encoder()


def encode(*parts: Any) -> bytes:
    return _encoder.encode(parts)


def run_rank(
    config: EngineConfig,
    platform: type[Platform],
    rank: int,
    local_rank: int,
    distributed_init_method: str,
    input_address: str,
    output_address: str,
    parent_pid: int | None = None,
) -> None:
    """The entry point of a rank's process (spawned by ``MultiprocExecutor``). ``parent_pid``:
    the engine core's pid, which the rank leaves when it is gone (default: the parent now)."""
    # Taken before the worker is built: a parent that dies meanwhile leaves the rank to init,
    # whose pid read afterwards would pass for its parent's.
    if parent_pid is None:
        parent_pid = os.getppid()
    import zmq

    # Ctrl-C reaches the whole process group: the engine core decides when ranks stop. SIGTERM
    # keeps its default (the executor's last resort before SIGKILL).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s"
    )
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.connect(output_address)
    worker = None
    try:
        from kvik.worker.worker import Worker

        worker = Worker(
            config,
            platform,
            rank=rank,
            local_rank=local_rank,
            distributed_init_method=distributed_init_method,
        )
        outputs.send(encode(rank, "ready", None))
        RankLoop(worker, inputs, outputs, parent_pid).run()
    except BaseException as e:
        logger.exception("rank %d failed", rank)
        outputs.send(encode(rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1) from e
    finally:
        if worker is not None:
            worker.shutdown()
        outputs.close(linger=1000)
        inputs.close(linger=0)
        context.term()


class RankLoop:
    def __init__(
        self, worker: Any, inputs: Any, outputs: Any, parent_pid: int | None = None
    ) -> None:
        self.worker = worker
        self.inputs = inputs
        self.outputs = outputs
        self.requests = RankRequests()
        self.parent_pid = os.getppid() if parent_pid is None else parent_pid
        self.sends_outputs = worker.rank == 0

    def run(self) -> None:
        pending: PendingStep | None = None
        while True:
            if pending is not None and not self._next_message_before(pending):
                self._send_output(pending)  # it ended first: hand its tokens back now
                pending = None
            if pending is None:
                while not self.inputs.poll(_PARENT_CHECK_MS):
                    if os.getppid() != self.parent_pid:
                        logger.warning("the engine core is gone: rank exiting")
                        return
            kind, payload = _message_decoder.decode(self.inputs.recv())
            if kind == "step":
                scheduler_output = self.requests.scheduler_output(_step_decoder.decode(payload))
                launched = self.worker.launch(scheduler_output)
                if pending is not None:
                    self._send_output(pending)
                pending = launched
                continue
            if pending is not None:  # an rpc or shutdown comes after the steps before it
                self._send_output(pending)
                pending = None
            if kind == "rpc":
                method, args = msgspec.msgpack.decode(payload)
                result = getattr(self.worker, method)(*args)
                self.outputs.send(encode(self.worker.rank, "rpc", result))
            elif kind == "shutdown":
                return
            else:
                raise ValueError(f"unknown message kind {kind!r}")

    def _next_message_before(self, pending: PendingStep) -> bool:
        """Whether a message arrives before ``pending`` ends on the device. Spins: a step lasts
        milliseconds, and a sleep or a blocking poll (ZMQ's granularity is a millisecond) would
        add its own latency to every step."""
        while not self.inputs.poll(0):
            if pending.ready():
                return False
        return True

    def _send_output(self, pending: PendingStep) -> None:
        output = pending.collect()
        if self.sends_outputs:
            self.outputs.send(encode(0, "step", output))
