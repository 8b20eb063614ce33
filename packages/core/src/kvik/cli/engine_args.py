"""The engine's command-line options, shared by ``kvik generate``, ``kvik chat`` and ``kvik serve``."""

from __future__ import annotations

import argparse
from typing import Any

from kvik.sampling_params import SamplingParams


def add_engine_arguments(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
    if positional_model:
        parser.add_argument("model_positional", nargs="?", metavar="MODEL", help="same as --model")
    parser.add_argument(
        "--model",
        default=None,
        help="a model folder, a .gguf file, a hub id or an alias "
        "(default: smollm2-135m-instruct, SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    parser.add_argument("--device", default=None, help="platform name (default: automatic)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--seed", type=int, default=0, help="the engine's random seed")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of an accelerator's memory the engine may use (weights, activations, KV cache)",
    )
    parser.add_argument("--no-enable-prefix-caching", action="store_true")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="run the model eagerly: no CUDA graphs"
    )
    parser.add_argument(
        "--cudagraph-mode",
        default=None,
        choices=("none", "full", "piecewise", "full_and_piecewise"),
        help="none, or full: one CUDA graph per padded decode batch size (default where the "
        "platform has graphs); the piecewise modes are not built yet",
    )
    parser.add_argument(
        "--cudagraph-capture-sizes",
        type=_int_list,
        default=None,
        metavar="N,N,...",
        help="padded decode batch sizes to capture (default: 1, 2, 4, 8..256 by 8, 272..512 by "
        "16, up to --max-num-seqs)",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule step N+1 while the device runs step N (default: on for GPUs)",
    )
    parser.add_argument(
        "--enable-nvtx", action="store_true", help="NVTX ranges around each step's phases"
    )
    parser.add_argument("--load-format", default="auto", help="auto, safetensors, gguf or dummy")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``kvik.LLM`` keyword arguments the options ask for."""
    model = getattr(args, "model_positional", None) or args.model
    return dict(
        model=model,
        tokenizer=args.tokenizer,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_enable_prefix_caching,
        enforce_eager=args.enforce_eager,
        load_format=args.load_format,
        cudagraph_mode=args.cudagraph_mode,
        cudagraph_capture_sizes=args.cudagraph_capture_sizes,
        async_scheduling=args.async_scheduling,
        enable_nvtx=args.enable_nvtx,
    )


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 (the default here) is greedy"
    )
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
    )
