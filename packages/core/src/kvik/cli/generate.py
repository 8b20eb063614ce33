"""``kvik generate "prompt"``: complete one prompt (or chat with --chat) and print the text."""

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
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument(
        "--raw",
        action="store_true",
        help="complete the text as is instead of sending it as a user message through the "
        "model's chat template",
    )
    add_engine_arguments(parser)
    add_sampling_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvik import LLM

    try:
        llm = LLM(**engine_kwargs(args))
        params = sampling_params(args, llm.config.model.sampling_defaults)
        if args.raw or llm.get_tokenizer() is None or not _has_chat_template(llm):
            outputs = llm.generate([args.prompt], params, use_tqdm=False)
        else:
            messages = [{"role": "user", "content": args.prompt}]
            outputs = llm.chat(messages, params, use_tqdm=False)
    except (ValueError, OSError) as e:  # OSError: a file the options name is missing
        print(f"kvik generate: {e}", file=sys.stderr)
        return 2
    print(outputs[0].outputs[0].text)
    return 0


def _has_chat_template(llm) -> bool:
    return getattr(llm.get_tokenizer(), "chat_template", None) is not None
