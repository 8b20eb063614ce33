"""The routes of the Responses API."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvik_server.responses.protocol import ResponsesRequest


def add_responses_routes(
    app: FastAPI,
    respond: Callable[..., Any],
    check_model: Callable[[Request, str | None], None],
    arrival_time: Callable[[Request], float | None],
) -> None:
    """``respond`` runs the work as the other routes do (aborting it if the client leaves);
    a stream comes back as server-sent events with their ``event:`` lines."""

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        check_model(request, body.model)
        work = request.app.state.responses.create(body, arrival_time(request))
        return await respond(request, _as_response(work))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> JSONResponse:
        return JSONResponse(request.app.state.responses.get(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> JSONResponse:
        return JSONResponse(request.app.state.responses.delete(response_id))


class _Body:
    """A finished response's JSON, in the shape ``respond`` returns (it calls model_dump)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def model_dump(self) -> dict[str, Any]:
        return self.body


async def _as_response(work: Any) -> Any:
    result = await work
    if isinstance(result, AsyncIterator):
        return result
    return _Body(result)
