"""``kvik serve [MODEL]``: the OpenAI-compatible server (also ``python -m kvik_server.cli``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from kvik.cli.engine_args import add_engine_arguments, engine_args
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
    server.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish on SIGINT/SIGTERM",
    )
    server.add_argument("--log-level", default="info")
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
    from kvik_server.tools.choice import ToolOptions

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    api_keys = args.api_key or (
        [os.environ["KVIK_API_KEY"]] if os.environ.get("KVIK_API_KEY") else []
    )
    chat_template = args.chat_template
    if chat_template is not None and Path(chat_template).is_file():
        chat_template = Path(chat_template).read_text()
    try:
        options = engine_args(args)
        tool_options = ToolOptions(args.enable_auto_tool_choice, args.tool_call_parser)
        if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {args.reasoning_parser!r}; kvik has "
                f"{', '.join(sorted(REASONING_PARSERS))}"
            )
        if args.max_stored_responses < 0:
            raise ValueError("--max-stored-responses must be >= 0")
    except ValueError as e:
        print(f"kvik serve: {e}", file=sys.stderr)
        return 2
    settings = ServerSettings(
        served_model_names=args.served_model_name or [],
        api_keys=api_keys,
        chat_template=chat_template,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout_s=args.shutdown_timeout,
        url=f"http://{args.host}:{args.port}",
        tool_options=tool_options,
        max_stored_responses=args.max_stored_responses,
    )
    app = create_app(options, settings)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from kvik.cli.main import parse_args

    parser = argparse.ArgumentParser(prog="kvik serve", description=__doc__, allow_abbrev=False)
    add_arguments(parser)
    return run(parse_args(parser, sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
