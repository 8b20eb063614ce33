"""``kvik serve [MODEL]``: the OpenAI-compatible server (also ``python -m kvik_server.cli``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from kvik.cli.engine_args import add_engine_arguments, engine_args
from kvik.engine.input_processor import chat_template_syntax_error
from kvik_server.reasoning.parsers import REASONING_PARSERS
from kvik_server.tools.parsers import TOOL_PARSERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own options, then every engine option (kvik.cli.engine_args)."""
    server = parser.add_argument_group("server options")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="a key clients must send as 'Authorization: Bearer KEY' (repeatable; "
        "default: $KVIK_API_KEY; none means no auth)",
    )
    server.add_argument(
        "--served-model-name", action="append", default=None, help="name(s) clients use"
    )
    server.add_argument("--chat-template", default=None, help="a Jinja template, or a file of one")
    server.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="run the chat_template a chat request carries (off: such requests get a 400, as in "
        "vLLM; a template is code the server runs)",
    )
    server.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish on SIGINT/SIGTERM",
    )
    server.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug",
                                                "trace"]
    )  # fmt: skip
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs '
        "--tool-call-parser",
    )
    server.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how the model writes tool calls: hermes (<tool_call> JSON: Hermes, Qwen), "
        "llama3_json (Llama 3.1+ JSON), mistral ([TOOL_CALLS] JSON)",
    )
    server.add_argument(
        "--max-stored-responses",
        type=int,
        default=1000,
        help="responses kept for GET /v1/responses/{id} and previous_response_id (the least "
        "recently used go first; 0 stores none)",
    )
    add_engine_arguments(parser, positional_model=True)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvik_server.app import ServerSettings, create_app
    from kvik_server.graceful import GracefulServer
    from kvik_server.tools.choice import ToolOptions

    # uvicorn's "trace" is below logging's levels: DEBUG for kvik's own loggers.
    level = "DEBUG" if args.log_level == "trace" else args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_keys = args.api_key or (
        [os.environ["KVIK_API_KEY"]] if os.environ.get("KVIK_API_KEY") else []
    )
    try:
        check_server_options(args, api_keys)
        chat_template = load_chat_template(args.chat_template)
        options = engine_args(args)
        tool_options = ToolOptions(args.enable_auto_tool_choice, args.tool_call_parser)
        if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {args.reasoning_parser!r}; kvik has "
                f"{', '.join(sorted(REASONING_PARSERS))}"
            )
        if args.max_stored_responses < 0:
            raise ValueError("--max-stored-responses must be >= 0")
        # The engine's configuration, checked here (the model, the platform, the parallel and
        # quantization settings): the app builds the engine in its lifespan, where an error is a
        # traceback and "Application startup failed".
        options.create_engine_config(serving=True)
    except (ValueError, OSError) as e:
        print(f"kvik serve: {e}", file=sys.stderr)
        return 2
    settings = ServerSettings(
        served_model_names=args.served_model_name or [],
        api_keys=api_keys,
        chat_template=chat_template,
        trust_request_chat_template=args.trust_request_chat_template,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout_s=args.shutdown_timeout,
        url=f"http://{args.host}:{args.port}",
        tool_options=tool_options,
        max_stored_responses=args.max_stored_responses,
    )
    app = create_app(options, settings)
    # GracefulServer: uvicorn.run's server, ending late requests with an error at the timeout.
    server = GracefulServer(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level),
        shutdown_timeout_s=args.shutdown_timeout,
    )
    try:
        server.run()
    except KeyboardInterrupt:
        # uvicorn re-raises the SIGINT it shut down for once it is done (uvicorn.run swallows
        # it the same way): Ctrl-C is a normal stop, not a traceback and status 130.
        pass
    if not server.started:
        return 3  # uvicorn.run's exit status when the server did not start
    return 0


def check_server_options(args: argparse.Namespace, api_keys: list[str]) -> None:
    """The server's own options, checked before the engine loads (minutes on a GPU)."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if any(not key for key in api_keys):
        raise ValueError("--api-key must not be empty (leave it out for no authentication)")
    if any(not name.strip() for name in args.served_model_name or ()):
        raise ValueError("--served-model-name must not be empty")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file holding a Jinja template, or the template itself. Text with no
    Jinja in it is most likely a mistyped file name (used as a template, it would be every chat
    prompt), so it is refused; a template that does not parse is refused here rather than at
    every chat request."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        template = path.read_text()
    elif "{{" not in value and "{%" not in value:
        raise ValueError(
            f"--chat-template {value!r} is neither a file nor a Jinja template (no {{{{ or {{% "
            "in it)"
        )
    else:
        template = value
    problem = chat_template_syntax_error(template)
    if problem is not None:
        raise ValueError(f"--chat-template does not parse: {problem}")
    return template


def main(argv: Sequence[str] | None = None) -> int:
    from kvik.cli.main import parse_args

    parser = argparse.ArgumentParser(prog="kvik serve", description=__doc__, allow_abbrev=False)
    add_arguments(parser)
    return run(parse_args(parser, sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
