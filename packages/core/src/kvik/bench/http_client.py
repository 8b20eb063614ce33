"""The HTTP client of ``kvik bench serve``, on aiohttp.

Why aiohttp and not httpx: at 16 req/s with ~45 streams in flight the client reads ~4,000 chunks a
second. With httpx (a cancel scope and several anyio awaits per read) the client process was
90-114% busy on the H200 and its TTFT ran 11.6 ms above the server's own histogram (median ratio
1.18); on aiohttp it is 22-27% busy and the gap fell to 7.2 ms (docs/benchmarks.md, the
twenty-seventh session). vLLM's benchmark client is on aiohttp too.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

#: Raised when no server answers at the base URL (refused, unresolvable, gone away).
ConnectionFailed = aiohttp.ClientConnectionError


@dataclass
class Response:
    status_code: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


class BenchClient:
    """A session bound to one base URL; every path is taken relative to it (``/v1/...`` keeps a
    base URL's own path prefix, unlike a URL join)."""

    def __init__(self, base_url: str, headers: dict[str, str], connect_timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = headers
        self.connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> BenchClient:
        # No cap on connections (aiohttp's default is 100): --max-concurrency is the bench's own.
        self._session = aiohttp.ClientSession(
            headers=self.headers,
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
        )
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._session is not None
        await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("BenchClient is used inside `async with`")
        return self._session

    async def get(self, path: str) -> Response:
        async with self.session.get(self.base_url + path) as response:
            return Response(response.status, await response.text(errors="replace"))

    async def stream_lines(
        self, path: str, payload: dict[str, Any]
    ) -> AsyncIterator[tuple[int, str]]:
        """POST ``payload`` as JSON and yield (status, line) for each line of the answer, the
        status of every line being the response's; a non-200 answer yields its whole body once."""
        async with self.session.post(self.base_url + path, json=payload) as response:
            if response.status != 200:
                yield response.status, await response.text(errors="replace")
                return
            async for raw in response.content:
                yield 200, raw.decode(errors="replace").rstrip("\r\n")
