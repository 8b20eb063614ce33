"""The engine's options, and their resolution into an EngineConfig.

``EngineArgs`` is the one list of them: ``LLM(**kwargs)`` takes exactly its fields, the server's
``AsyncLLM`` takes an instance, and the flags of ``kvik generate/chat/serve/bench`` are made from
its fields (kvik.cli.engine_args), so an option means the same thing, with the same checks,
wherever it is given. A field's type, default and ``option(..., help)`` are all a new option needs;
where vLLM has the same option, the field has vLLM's name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from kvik.config import (
    DTYPE_NAMES,
    PIECEWISE_CUDAGRAPH_MODES,
    CacheConfig,
    CompilationConfig,
    CudagraphMode,
    DistributedExecutorBackend,
    EngineConfig,
    KvCacheDtype,
    LoadFormat,
    OpsDispatch,
    ParallelConfig,
    SchedulingPolicy,
    StructuredOutputsBackend,
    StructuredOutputsConfig,
    default_capture_sizes,
    default_compile_cache_dir,
)
from kvik.engine.options import check_value, option, option_specs, unknown_option_message
from kvik.spec_decode.config import parse_speculative_config


@dataclass
class EngineArgs:
    """The engine's options; ``kvik <command> --help`` shows each one's help text."""

    model: str | None = option(
        None,
        "a model folder, a .gguf file, a hub id or an alias "
        "(default: smollm2-135m-instruct, SmolLM2-135M-Instruct)",
    )
    tokenizer: str | None = option(None, "a tokenizer folder or hub id (default: the model's)")
    device: str | None = option(
        None,
        "the platform to run on, by name (default: $KVIK_DEVICE, else the present platform of "
        "highest priority)",
    )
    dtype: str | torch.dtype = option(
        "auto",
        "the dtype of weights and activations; auto: the platform's default",
        choices=DTYPE_NAMES,
    )
    quantization: str | None = option(
        None,
        "the quantization method: by default the checkpoint's (its quantization_config); on an "
        "unquantized checkpoint, a method to quantize it with as it loads (fp8: FP8 weights per "
        "output channel, FP8 activations per token); `kvik env` lists each platform's methods",
        metavar="METHOD",
    )
    seed: int = option(0, "the engine's random seed (sampling without a per-request seed)")
    load_format: LoadFormat = option(
        "auto",
        "how to read the weights: auto (by what the model path holds), safetensors, gguf, or "
        "dummy (random weights of the model's shapes)",
    )
    max_model_len: int | None = option(
        None, "the longest sequence, prompt and output, in tokens (default: the model's context)"
    )
    max_num_seqs: int | None = option(
        None,
        "the most requests in one step (default: the platform's; 512 on a GPU of 70 GiB or "
        "more, else 256)",
    )
    max_num_batched_tokens: int | None = option(
        None,
        "the most tokens in one step (default: the platform's; on a GPU 512 for a server, 16384 "
        "offline on one of 70 GiB or more, else 8192; and at least max_model_len when chunked "
        "prefill is off)",
    )
    enable_chunked_prefill: bool = option(
        True,
        "split a long prompt over several steps, so that decoding requests keep running beside "
        "it (off: a prompt runs whole, so max_num_batched_tokens must hold max_model_len)",
    )
    scheduling_policy: SchedulingPolicy = option(
        "fcfs",
        "the order waiting requests are admitted and running ones preempted in: fcfs (arrival), "
        "or priority (each request's priority, lower first, then arrival)",
    )
    enable_prefix_caching: bool = option(
        True, "reuse the KV cache of prompt prefixes that earlier requests computed"
    )
    block_size: int = option(16, "tokens per KV cache block")
    num_kv_blocks: int | None = option(
        None, "the KV cache's block count, exactly (overrides kv_cache_memory_bytes)"
    )
    kv_cache_memory_bytes: int | None = option(
        None,
        "bytes for the KV cache (default: the platform's; on a GPU, what a profiling forward "
        "pass leaves of gpu_memory_utilization)",
    )
    kv_cache_dtype: KvCacheDtype = option(
        "auto",
        "what the KV cache stores: auto (the model's dtype), or fp8 / fp8_e4m3 (float8 e4m3 "
        "with the checkpoint's per-layer k/v scales, else 1.0: one byte an element, so twice "
        "the tokens of a bf16 cache in the same memory)",
    )
    gpu_memory_utilization: float = option(
        0.9,
        "share of an accelerator's memory the engine may use (weights, activations, KV cache)",
    )
    enforce_eager: bool = option(False, "run the model eagerly: no torch.compile, no CUDA graphs")
    cudagraph_mode: CudagraphMode | None = option(
        None,
        "none; full: a CUDA graph per padded decode batch size; piecewise: graphs of the "
        "compiled pieces between attention calls, for any step; full_and_piecewise (default "
        "where the platform has graphs): full for decode steps, piecewise for the others",
    )
    cudagraph_capture_sizes: list[int] | None = option(
        None,
        "padded token counts to capture (default: 1, 2, 4, 8..256 by 8, 272..512 by 16, "
        "up to max_num_seqs)",
        metavar="N",
    )
    compilation_config: str | None = option(
        None,
        "JSON with vLLM's keys that apply: mode (or level) 0 or 3, cudagraph_mode, "
        "cudagraph_capture_sizes, cache_dir (default ~/.cache/kvik/torch_compile)",
        metavar="JSON",
    )
    async_scheduling: bool | None = option(
        None, "schedule step N+1 while the device runs step N (default: on for GPUs)"
    )
    ops_dispatch: OpsDispatch | None = option(
        None,
        "how layers call the small ops (norms, rotary, activation): torch_ops (through "
        "torch.ops.kvik, reaching the platform's kernels) or direct (the PyTorch references as "
        "plain calls); default: the platform's choice",
    )
    enable_nvtx: bool = option(False, "NVTX ranges around each step's phases (for nsys)")
    tensor_parallel_size: int = option(
        1,
        "ranks that share each layer's weights and heads (one process and device each)",
        aliases=("-tp",),
    )
    distributed_executor_backend: DistributedExecutorBackend | None = option(
        None,
        "how ranks run: uni (one rank, in the engine core's process) or mp (one process per "
        "rank on this host); default: uni for one rank, mp for more",
    )
    speculative_config: str | dict | None = option(
        None,
        "speculative decoding, JSON with vLLM's keys: method (ngram, draft_model, eagle3), "
        "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, model, "
        "disable_by_batch_size (with one in-process rank; scheduling is then synchronous)",
        metavar="JSON",
    )
    max_logprobs: int = option(
        20,
        "the most logprobs (and prompt logprobs) a request may ask for at each position, as "
        "vLLM's; -1: no limit (a request's -1, the whole vocabulary, needs it)",
    )
    generation_config: str = option(
        "auto",
        "where requests' unset sampling options come from: auto (the model's generation "
        "config), vllm or none (kvik's defaults), or a folder holding a generation_config.json",
    )
    structured_outputs_backend: StructuredOutputsBackend = option(
        "xgrammar",
        "the library that compiles structured-output grammars (JSON schema, regex, choice, "
        "EBNF) into token masks: xgrammar (guidance is not built into kvik)",
    )
    reasoning_parser: str | None = option(
        None,
        "the model's reasoning format (qwen3, deepseek_r1: reasoning ends at </think>); a "
        "request's grammar then constrains only what follows the reasoning",
        metavar="NAME",
    )

    def __post_init__(self) -> None:
        for spec in option_specs(type(self)):
            setattr(self, spec.name, check_value(spec, getattr(self, spec.name)))
        self._check_ranges()

    @classmethod
    def from_options(cls, caller: str = "EngineArgs()", **options: Any) -> EngineArgs:
        """``EngineArgs(**options)``, but an unknown keyword is a TypeError naming it and the
        closest option, said as from ``caller``."""
        known = [spec.name for spec in option_specs(cls)]
        for name in options:
            if name not in known:
                raise TypeError(unknown_option_message(caller, name, known))
        return cls(**options)

    def _check_ranges(self) -> None:
        _check_positive(
            block_size=self.block_size,
            tensor_parallel_size=self.tensor_parallel_size,
        )
        _check_positive(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            max_model_len=self.max_model_len,
            optional=True,
        )
        if not 0 <= self.seed < 2**32:
            # What Python's, NumPy's and PyTorch's generators are all seeded with.
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= -1, got {self.max_logprobs}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )

    def create_engine_config(self, serving: bool = False) -> EngineConfig:
        """The engine's configuration; ``serving``: for a server (``AsyncLLM``), whose defaults
        favour latency where they differ (``Platform.default_max_num_batched_tokens``)."""
        from kvik.model_loader.loader import check_tensor_parallel, load_model_config
        from kvik.platforms.selection import select_platform
        from kvik.quantization.resolve import check_platform_supports
        from kvik.scheduler.scheduler import SchedulerConfig
        from kvik.spec_decode.config import check_speculative_engine
        from kvik.structured_output.manager import check_settings

        # Fields may have been set after construction: check them again.
        self.__post_init__()
        parallel = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
        )
        platform = select_platform(self.device)
        max_num_seqs = self.max_num_seqs or platform.default_max_num_seqs()
        compilation = self._compilation_config(platform.graph_support != "none", max_num_seqs)
        model_config = load_model_config(
            self.model,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            load_format=self.load_format,
            platform_default_dtype=platform.default_dtype(),
            seed=self.seed,
            tokenizer=self.tokenizer,
            generation_config=self.generation_config,
            quantization=self.quantization,
        )
        model_config.max_logprobs = self.max_logprobs
        check_platform_supports(platform, model_config.quantization)
        check_tensor_parallel(model_config, parallel.tensor_parallel_size)
        structured_outputs = StructuredOutputsConfig(
            backend=self.structured_outputs_backend, reasoning_parser=self.reasoning_parser
        )
        check_settings(structured_outputs)
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = platform.default_max_num_batched_tokens(serving)
            if not self.enable_chunked_prefill:
                max_num_batched_tokens = max(max_num_batched_tokens, model_config.max_model_len)
        elif (
            not self.enable_chunked_prefill and max_num_batched_tokens < model_config.max_model_len
        ):
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_model_len "
                f"({model_config.max_model_len}) when chunked prefill is off"
            )
        config = EngineConfig(
            model=model_config,
            cache=CacheConfig(
                block_size=self.block_size,
                num_blocks=self.num_kv_blocks,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
                cache_dtype=self.kv_cache_dtype,
                gpu_memory_utilization=float(self.gpu_memory_utilization),
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=model_config.max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy,
            ),
            device=platform.name,
            enforce_eager=self.enforce_eager,
            compilation=compilation,
            async_scheduling=self.async_scheduling,
            enable_nvtx=self.enable_nvtx,
            ops_dispatch=self.ops_dispatch,
            parallel=parallel,
            structured_outputs=structured_outputs,
            speculative=parse_speculative_config(self.speculative_config),
        )
        # Here as well as in EngineCore: a server refuses before its engine process starts.
        check_speculative_engine(config)
        return config

    def _compilation_config(
        self, platform_has_graphs: bool, max_num_seqs: int
    ) -> CompilationConfig:
        """The flags and ``compilation_config``'s JSON resolved into one CompilationConfig: where
        the platform has graphs and nothing says otherwise, vLLM's default (compiled, FULL graphs
        for decode steps and PIECEWISE for the others); eager elsewhere."""
        given = parse_compilation_config(self.compilation_config)
        mode_flag, sizes_flag = self.cudagraph_mode, self.cudagraph_capture_sizes
        for key, flag in (("cudagraph_mode", mode_flag), ("cudagraph_capture_sizes", sizes_flag)):
            if key in given and flag is not None and given[key] != flag:
                raise ValueError(
                    f"{key} is given twice, {flag!r} as an option and {given[key]!r} in "
                    "compilation_config"
                )
        mode = given.get("cudagraph_mode", mode_flag)
        level = given.get("mode")
        if self.enforce_eager:
            if mode not in (None, "none") or level not in (None, 0):
                raise ValueError(
                    "enforce_eager turns torch.compile and CUDA graphs off, but "
                    f"cudagraph_mode={mode!r} / compilation mode {level!r} asks for them"
                )
            mode, level = "none", 0
        if mode is None:
            mode = "full_and_piecewise" if platform_has_graphs else "none"
            if level == 0 and platform_has_graphs:
                mode = "full"  # eager model: FULL graphs still hold decode steps
        if level is None:
            level = 3 if mode in PIECEWISE_CUDAGRAPH_MODES else 0
        sizes = given.get("cudagraph_capture_sizes", sizes_flag)
        if sizes is None:
            sizes = default_capture_sizes(max_num_seqs) if mode != "none" else []
        return CompilationConfig(
            mode=level,
            cudagraph_mode=mode,
            cudagraph_capture_sizes=list(sizes),
            cache_dir=given.get("cache_dir") or default_compile_cache_dir(),
        )


#: compilation_config keys kvik reads (vLLM's names), and the keys vLLM has that kvik does not.
_COMPILATION_KEYS = ("mode", "level", "cudagraph_mode", "cudagraph_capture_sizes", "cache_dir")


def parse_compilation_config(text: str | None) -> dict[str, Any]:
    """``--compilation-config``'s JSON as a dict of kvik's keys ("level" read as "mode", vLLM's
    upper-case cudagraph modes accepted); unknown keys are an error that names them."""
    if text is None:
        return {}
    try:
        given = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"compilation_config is not valid JSON: {error}") from None
    if not isinstance(given, dict):
        raise ValueError(f"compilation_config must be a JSON object, got {text!r}")
    unknown = sorted(set(given) - set(_COMPILATION_KEYS))
    if unknown:
        raise ValueError(
            f"compilation_config keys {unknown} are not supported; kvik reads "
            f"{', '.join(_COMPILATION_KEYS)}"
        )
    if "level" in given:
        if "mode" in given and given["mode"] != given["level"]:
            raise ValueError("compilation_config gives both mode and level, and they differ")
        given["mode"] = given.pop("level")
    if "mode" in given and (not isinstance(given["mode"], int) or isinstance(given["mode"], bool)):
        raise ValueError(f"compilation_config mode must be an integer, got {given['mode']!r}")
    if isinstance(given.get("cudagraph_mode"), str):
        given["cudagraph_mode"] = given["cudagraph_mode"].lower()
    sizes = given.get("cudagraph_capture_sizes")
    if sizes is not None and not isinstance(sizes, list):
        raise ValueError(f"cudagraph_capture_sizes must be a list, got {sizes!r}")
    if "cache_dir" in given and not isinstance(given["cache_dir"], str):
        raise ValueError(
            f"compilation_config cache_dir must be a string, got {given['cache_dir']!r}"
        )
    return given


def _check_positive(optional: bool = False, **values: Any) -> None:
    for name, value in values.items():
        if value is None and optional:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
