"""uvicorn's server with a graceful shutdown that ends late requests with an error.

On SIGINT/SIGTERM uvicorn stops accepting connections and waits ``timeout_graceful_shutdown`` for
the requests in flight; then it cancels their tasks, which cuts each connection in the middle of
its body (the client sees an incomplete read, not why) and logs a CancelledError traceback a
request. ``GracefulServer`` ends them itself when ``--shutdown-timeout`` is over
(``AsyncLLM.end_requests``): a stream's last event is an error saying the server is shutting down,
followed by ``[DONE]``, and an unstreamed request gets a 503. uvicorn's own timeout stays as a
backstop, ``BACKSTOP_S`` later, for a connection that still does not close.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

logger = logging.getLogger("kvik_server")


class GracefulServer(uvicorn.Server):
    #: Seconds after ``shutdown_timeout_s`` at which uvicorn cancels what is still running.
    BACKSTOP_S = 5.0

    def __init__(self, config: uvicorn.Config, shutdown_timeout_s: float) -> None:
        config.timeout_graceful_shutdown = shutdown_timeout_s + self.BACKSTOP_S
        super().__init__(config)
        self.shutdown_timeout_s = shutdown_timeout_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout_s, self.end_requests)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def end_requests(self) -> None:
        """The requests still running when the shutdown timeout is over end with an error."""
        engine = getattr(self.config.app.state, "engine", None)
        if engine is None or not self.server_state.tasks:
            return
        logger.warning(
            "ending %d request(s) still running after --shutdown-timeout (%g s)",
            len(self.server_state.tasks),
            self.shutdown_timeout_s,
        )
        engine.end_requests(
            f"the server is shutting down: the request did not finish within its "
            f"{self.shutdown_timeout_s:g} s shutdown timeout"
        )
