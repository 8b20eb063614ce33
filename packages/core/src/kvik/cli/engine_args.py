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
    parser.add_argument(
        "--generation-config",
        default="auto",
        help="where unset sampling options come from: auto (the model's generation config), "
        "vllm or none (kvik's defaults), or a folder holding a generation_config.json",
    )


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
        generation_config=args.generation_config,
    )


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


#: The sampling flags a model's generation config gives defaults for -> its key there.
_MODEL_DEFAULTED = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
#: The command line's own defaults, under the model's: greedy, and longer replies than the API's.
_COMMAND_DEFAULTS = {"temperature": 0.0, "max_new_tokens": 256}


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    model = "default: the model's generation config's"
    parser.add_argument("--max-tokens", type=int, default=None, help=f"{model}, else 256")
    parser.add_argument("--temperature", type=float, default=None, help=f"{model}, else 0 (greedy)")
    parser.add_argument("--top-p", type=float, default=None, help=f"{model}, else 1")
    parser.add_argument("--top-k", type=int, default=None, help=f"{model}, else 0 (off)")
    parser.add_argument("--min-p", type=float, default=None, help=f"{model}, else 0")
    parser.add_argument("--repetition-penalty", type=float, default=None, help=f"{model}, else 1")
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


def sampling_params(args: argparse.Namespace, model_defaults: dict[str, Any]) -> SamplingParams:
    """The flags given, else the model's sampling defaults (``ModelConfig.sampling_defaults``),
    else the command line's own."""
    given = {name: getattr(args, name) for name in _MODEL_DEFAULTED}
    return SamplingParams.from_generation_config(
        {**_COMMAND_DEFAULTS, **model_defaults},
        **{name: value for name, value in given.items() if value is not None},
        seed=args.sampling_seed,
        stop=args.stop,
    )
