"""``kvik chat``: an interactive conversation, streamed token by token.

Reads one user message per line from standard input (a terminal or a pipe); an empty line or
end of input ends the chat. ``/reset`` starts a new conversation.
"""

from __future__ import annotations

import argparse
import sys

from kvik.cli.engine_args import (
    add_engine_arguments,
    add_sampling_arguments,
    engine_kwargs,
    sampling_params,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", default=None, help="a system message to start with")
    add_engine_arguments(parser)
    add_sampling_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvik import LLM

    try:
        llm = LLM(**engine_kwargs(args))
        params = sampling_params(args, llm.config.model.sampling_defaults)
    except (ValueError, OSError) as e:  # OSError: a file the options name is missing
        print(f"kvik chat: {e}", file=sys.stderr)
        return 2
    start = [{"role": "system", "content": args.system}] if args.system else []
    conversation = list(start)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print(">>> ", end="", flush=True)
        # Bytes, decoded here: bytes that are not UTF-8 become lone surrogates, which the chat
        # template's tokenization then refuses for that line alone (sys.stdin's own decoding
        # may be strict, and would end the chat with a traceback).
        line = sys.stdin.buffer.readline().decode("utf-8", "surrogateescape")
        if not line or not line.strip():
            return 0
        if line.strip() == "/reset":
            conversation = list(start)
            continue
        conversation.append({"role": "user", "content": line.rstrip("\n")})
        reply = []
        try:
            prompt = llm.input_processor.apply_chat_template(conversation)
            for chunk in llm.stream(prompt, params):
                reply.append(chunk)
                print(chunk, end="", flush=True)
        except ValueError as e:
            # This line cannot be a message (bytes that are not UTF-8, a conversation grown past
            # the model's length; both are refused before a token is made): say so, drop it,
            # and go on with the conversation.
            print(f"kvik chat: {e}", file=sys.stderr)
            conversation.pop()
            if "max_model_len" in str(e) and len(conversation) > len(start):
                # Every later line would be refused the same way: say how to go on.
                print(
                    "kvik chat: the conversation so far fills the model's length: /reset starts "
                    "a new one",
                    file=sys.stderr,
                )
            continue
        print(flush=True)
        conversation.append({"role": "assistant", "content": "".join(reply)})
