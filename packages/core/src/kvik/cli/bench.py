"""``kvik bench throughput|latency|serve``: the benchmarks, each a module of kvik.bench."""

from __future__ import annotations

import argparse
import importlib
import logging

#: name -> (module, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "throughput": ("kvik.bench.throughput", "offline tokens/s of one batch of random prompts"),
    "latency": ("kvik.bench.latency", "time for one batch, from submission to its last token"),
    "serve": ("kvik.bench.serve", "load a running OpenAI-style server; TTFT, TPOT, ITL, E2EL"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    subparsers = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, (module_path, help_text) in BENCHMARKS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        importlib.import_module(module_path).add_arguments(sub)
        sub.add_argument(
            "--log-level",
            default="warning",
            choices=["debug", "info", "warning", "error"],
            help="the engine's log lines on stderr from this level (info: its memory profile, "
            "the KV cache's size, the CUDA graphs' capture and memory)",
        )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return importlib.import_module(BENCHMARKS[args.benchmark][0]).run(args)
