"""The FastAPI app: OpenAI's routes over an AsyncLLM, with auth, body limits and OpenAI errors."""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import kvik
from kvik.engine.args import EngineArgs
from kvik.engine.async_llm import AsyncLLM, EngineDeadError, EngineRequestError
from kvik.engine.input_processor import encode_text
from kvik_server.errors import APIError, error_body
from kvik_server.metrics import PrometheusStatLogger
from kvik_server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvik_server.responses.routes import add_responses_routes
from kvik_server.responses.serving import Responses
from kvik_server.serving import ChatCompletions, Completions
from kvik_server.tools.choice import ToolOptions

logger = logging.getLogger("kvik_server")

#: Routes that answer without an API key.
PUBLIC_PATHS = frozenset({"/health"})


@dataclass
class ServerSettings:
    served_model_names: list[str] = field(default_factory=list)  # default: the model's name
    api_keys: list[str] = field(default_factory=list)  # none: no auth
    chat_template: str | None = None
    trust_request_chat_template: bool = False  # run a request's own chat_template
    max_body_bytes: int = 8 * 1024 * 1024
    shutdown_timeout_s: float = 10.0
    url: str | None = None  # logged with an example request when ready
    tool_options: ToolOptions = field(default_factory=ToolOptions)
    max_stored_responses: int = 1000


def example_request(url: str, model_name: str, api_keys: list[str]) -> str:
    """The curl command the server logs once ready; with API keys it carries the header they
    need (not the key itself, which the log would keep), else it would get a 401."""
    auth = " -H 'Authorization: Bearer <your API key>'" if api_keys else ""
    return (
        f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
        f'-d \'{{"model": "{model_name}", "messages": [{{"role": "user", "content": "What is the '
        "capital of France?\"}]}'"
    )


def create_app(engine_args: EngineArgs, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    if not settings.served_model_names:
        from kvik.model_loader.default_model import ALIAS

        settings.served_model_names = [engine_args.model or ALIAS]
    model_name = settings.served_model_names[0]
    stat_logger = PrometheusStatLogger(model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = await AsyncLLM.create(engine_args, [stat_logger])
        # What start-up made (torch, transformers, the tokenizer, the app) lives as long as the
        # server: out of the collector's sight, an old-generation collection while streaming
        # walks only what requests make, rather than pausing every stream for all of it.
        gc.collect()
        gc.freeze()
        app.state.engine = engine
        app.state.completions = Completions(engine, model_name)
        app.state.chat = ChatCompletions(
            engine,
            model_name,
            settings.chat_template,
            settings.tool_options,
            settings.trust_request_chat_template,
        )
        app.state.responses = Responses(
            app.state.chat, settings.max_stored_responses, settings.tool_options
        )
        if settings.url:
            logger.info("kvik is serving %s at %s", model_name, settings.url)
            logger.info("try: %s", example_request(settings.url, model_name, settings.api_keys))
        try:
            yield
        finally:
            await engine.shutdown(settings.shutdown_timeout_s)

    app = FastAPI(title="kvik", version=kvik.__version__, lifespan=lifespan)
    app.state.settings = settings
    app.state.stat_logger = stat_logger
    _add_error_handlers(app)
    _add_routes(app)
    add_responses_routes(app, _respond, _check_model, _arrival_time)
    # Each add_middleware wraps what is there, so the last added runs first: the arrival time is
    # noted, then every request is authenticated before anything reads its body.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(AuthMiddleware, api_keys=settings.api_keys)
    app.add_middleware(ArrivalTimeMiddleware)
    return app


def _arrival_time(request: Request) -> float | None:
    return request.scope.get(ArrivalTimeMiddleware.KEY)


class ArrivalTimeMiddleware:
    """Outermost: notes when each request came in (``time.monotonic()``), before its body is read
    and validated, so that the server's latency metrics start where the client's clock does."""

    KEY = "kvik.arrival_time"

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[self.KEY] = time.monotonic()
        await self.app(scope, receive, send)


def _engine(request: Request) -> AsyncLLM:
    return request.app.state.engine


def _check_model(request: Request, model: str | None) -> None:
    names = request.app.state.settings.served_model_names
    if model is not None and model not in names:
        raise APIError(
            f"the model {model!r} does not exist; this server serves {names}", 404, "model"
        )


def _add_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        return Response(status_code=200 if _engine(request).is_healthy else 503)

    @app.get("/version")
    async def version(request: Request) -> dict[str, str | None]:
        # Beside vLLM's one key, where the engine runs: `kvik bench serve` takes the roofline's
        # device from here.
        info = _engine(request).client.ready_info
        return {"version": kvik.__version__} | {
            key: info.get(key) for key in ("platform", "device", "dtype")
        }

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        registry = request.app.state.stat_logger.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        engine = _engine(request)
        data = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "kvik",
                "root": str(engine.config.model.path),
                "max_model_len": engine.config.model.max_model_len,
            }
            for name in request.app.state.settings.served_model_names
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(request, body.model)
        work = request.app.state.completions.create(body, _arrival_time(request))
        return await _respond(request, work)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(request, body.model)
        work = request.app.state.chat.create(body, _arrival_time(request))
        return await _respond(request, work)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        _check_model(request, body.model)
        engine = _engine(request)
        if body.messages is not None:
            tokens = request.app.state.chat.prompt(body)["prompt_token_ids"]
        else:
            tokens = encode_text(
                engine.tokenizer, body.prompt, add_special_tokens=body.add_special_tokens
            )
        return {
            "count": len(tokens),
            "max_model_len": engine.config.model.max_model_len,
            "tokens": list(tokens),
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
        _check_model(request, body.model)
        engine = _engine(request)
        vocab = engine.config.model.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(f"tokens must be ids in [0, {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}


async def _respond(request: Request, work: Awaitable[Any]) -> Response:
    """Run a completion; a stream becomes server-sent events, anything else JSON. A client that
    disconnects before a non-streamed answer is ready has its request aborted."""
    task = asyncio.ensure_future(work)
    disconnected = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnected.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)
    result = task.result()
    if isinstance(result, AsyncIterator):
        return EventStreamResponse(result)
    return JSONResponse(result.model_dump())


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(StreamingResponse):
    """Server-sent events whose generator is always closed, so a request whose client went away
    is aborted at once rather than whenever the garbage collector gets to it."""

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _add_error_handlers(app: FastAPI) -> None:
    def reply(message: str, status: int, param: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(message, status, param), status_code=status)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return reply(e.message, e.status, e.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return reply(f"malformed JSON: {first.get('ctx', {}).get('error', 'invalid')}", 400)
        if tuple(first.get("loc", ())) == ("body",) and first.get("type") in _NOT_AN_OBJECT:
            # The body as a whole: the error said "body: Field required" or "Input should be a
            # valid dictionary", naming neither the body's type nor the Content-Type at fault.
            return reply(_body_error(first, request.headers.get("content-type")), 400)
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body') or 'body'}: "
            f"{err.get('msg', 'invalid')}"
            for err in errors[:5]
        )
        return reply(message or "invalid request", 400, ".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if isinstance(e.__cause__, UnicodeDecodeError):
            # FastAPI's "There was an error parsing the body" named no fault.
            cause = e.__cause__
            return reply(
                f"malformed JSON: the body is not valid {cause.encoding.upper()} "
                f"({cause.reason} at byte {cause.start})",
                400,
            )
        return reply(str(e.detail), e.status_code)

    @app.exception_handler(ValueError)
    async def value_error(request: Request, e: ValueError) -> JSONResponse:
        return reply(str(e), 400, _value_error_param(str(e)))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, e: EngineDeadError) -> JSONResponse:
        return reply(str(e), 503)

    @app.exception_handler(EngineRequestError)
    async def engine_refused(request: Request, e: EngineRequestError) -> JSONResponse:
        return reply(str(e), 500)


#: Pydantic's errors for a body that is missing or not an object (a validator of the whole body
#: raises value_error at the same place, with its own message).
_NOT_AN_OBJECT = frozenset({"missing", "model_attributes_type"})


def _body_error(error: dict[str, Any], content_type: str | None) -> str:
    """What is wrong with a body that is not a JSON object (FastAPI leaves a body that is not
    sent as application/json unparsed, as bytes: curl -d sends form data unless told)."""
    body = error.get("input")
    if error.get("type") == "missing" or body == b"":
        return "the request body is empty: send a JSON object"
    if isinstance(body, bytes | bytearray):
        return (
            "the request body must be JSON sent with 'Content-Type: application/json'; it came "
            + (f"as {content_type!r}" if content_type else "without a Content-Type")
        )
    return f"the request body must be a JSON object, got {_JSON_TYPES.get(type(body), 'a value')}"


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number"}
_JSON_TYPES |= {bool: "a boolean", type(None): "null"}


#: Request fields that the engine's ValueErrors name first ("logit_bias must hold token ids ...").
_REQUEST_FIELDS = (
    frozenset(CompletionRequest.model_fields)
    | frozenset(ChatCompletionRequest.model_fields)
    | {"max_output_tokens"}  # the Responses API's max_tokens
)
_LEADING_FIELD = re.compile(r"^(?:invalid |the given )?([a-z_]+)\b(?:\.[a-z_]+)?")
_MESSAGE = re.compile(r"^message (\d+)\b")


def _value_error_param(message: str) -> str | None:
    """The request field an engine ValueError is about, where its message starts with one (the
    engine does not know the request's fields, only its own, which share their names)."""
    if match := _MESSAGE.match(message):
        return f"messages.{match.group(1)}"
    match = _LEADING_FIELD.match(message)
    if match and match.group(1) in _REQUEST_FIELDS:
        return match.group(1)
    return None


class AuthMiddleware:
    """Every route but PUBLIC_PATHS needs ``Authorization: Bearer <key>``: one check, here, so a
    new route is covered without anyone remembering."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.keys = [key.encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        # Compare with every key, so the time taken does not say which (or whether one) matched.
        matched = [hmac.compare_digest(token.strip(), key) for key in self.keys]
        if scheme.lower() == b"bearer" and any(matched):
            return await self.app(scope, receive, send)
        response = JSONResponse(
            error_body("missing or invalid API key", 401),
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)


class BodyLimitMiddleware:
    """Answer 413 to a body over ``max_bytes``, whether it says its length or streams it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"the request body is over the limit of {self.max_bytes} bytes"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            response = JSONResponse(error_body(message, 413), status_code=413)
            return await response(scope, receive, send)
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message_in = await receive()
            if message_in["type"] == "http.request":
                received += len(message_in.get("body", b""))
                if received > self.max_bytes:
                    # Raised while the route reads its body; the HTTP error handler answers.
                    raise HTTPException(413, message)
            return message_in

        await self.app(scope, counting_receive, send)
