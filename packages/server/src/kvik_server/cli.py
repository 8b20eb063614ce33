"""``kvik serve [MODEL]``: the OpenAI-compatible server (also ``python -m kvik_server.cli``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from kvik.cli.engine_args import add_engine_arguments, engine_kwargs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser, positional_model=True)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="a key clients must send as 'Authorization: Bearer KEY' (repeatable; "
        "default: $KVIK_API_KEY; none means no auth)",
    )
    parser.add_argument(
        "--served-model-name", action="append", default=None, help="name(s) clients use"
    )
    parser.add_argument("--chat-template", default=None, help="a Jinja template, or a file of one")
    parser.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish on SIGINT/SIGTERM",
    )
    parser.add_argument("--log-level", default="info")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvik.engine.args import EngineArgs
    from kvik_server.app import ServerSettings, create_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    api_keys = args.api_key or (
        [os.environ["KVIK_API_KEY"]] if os.environ.get("KVIK_API_KEY") else []
    )
    chat_template = args.chat_template
    if chat_template is not None and Path(chat_template).is_file():
        chat_template = Path(chat_template).read_text()
    engine_args = EngineArgs(**engine_kwargs(args))
    settings = ServerSettings(
        served_model_names=args.served_model_name or [],
        api_keys=api_keys,
        chat_template=chat_template,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout_s=args.shutdown_timeout,
        url=f"http://{args.host}:{args.port}",
    )
    app = create_app(engine_args, settings)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvik serve", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
