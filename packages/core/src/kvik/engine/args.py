"""The engine's user-facing options, and their resolution into an EngineConfig.

Shared by the offline ``LLM``, the server's ``AsyncLLM`` and the command line, so that an option
means the same thing, with the same checks, wherever it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvik.config import CacheConfig, CompilationConfig, EngineConfig, default_capture_sizes

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass
class EngineArgs:
    """The options of ``LLM(...)``; ``num_kv_blocks`` sets the KV cache's block count exactly,
    otherwise ``kv_cache_memory_bytes`` or the platform's default decides it."""

    model: str | None = None
    device: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    load_format: str = "auto"
    tokenizer: str | None = None
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    #: "none", "full" (FULL graphs for decode steps); None: "full" where the platform has graphs.
    cudagraph_mode: str | None = None
    cudagraph_capture_sizes: list[int] | None = None
    #: None: on where the platform's device runs asynchronously to the host (GPUs).
    async_scheduling: bool | None = None
    enable_nvtx: bool = False
    #: Where requests' unset sampling options come from: "auto" (the model's generation config),
    #: "vllm" or "none" (kvik's defaults), or a folder holding a generation_config.json.
    generation_config: str = "auto"

    def create_engine_config(self) -> EngineConfig:
        from kvik.model_loader.loader import load_model_config
        from kvik.platforms.selection import select_platform
        from kvik.scheduler.scheduler import SchedulerConfig

        _check_positive(max_num_seqs=self.max_num_seqs, block_size=self.block_size)
        _check_positive(
            max_num_batched_tokens=self.max_num_batched_tokens,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            max_model_len=self.max_model_len,
            optional=True,
        )
        if not (
            isinstance(self.gpu_memory_utilization, int | float)
            and not isinstance(self.gpu_memory_utilization, bool)
            and 0 < self.gpu_memory_utilization <= 1
        ):
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        platform = select_platform(self.device)
        compilation = self._compilation_config(platform.graph_support != "none")
        model_config = load_model_config(
            self.model,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            load_format=self.load_format,
            platform_default_dtype=platform.default_dtype(),
            seed=self.seed,
            tokenizer=self.tokenizer,
            generation_config=self.generation_config,
        )
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
            if not self.enable_chunked_prefill:
                max_num_batched_tokens = max(max_num_batched_tokens, model_config.max_model_len)
        elif (
            not self.enable_chunked_prefill and max_num_batched_tokens < model_config.max_model_len
        ):
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_model_len "
                f"({model_config.max_model_len}) when chunked prefill is off"
            )
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(
                block_size=self.block_size,
                num_blocks=self.num_kv_blocks,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
                gpu_memory_utilization=float(self.gpu_memory_utilization),
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=model_config.max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy,
            ),
            device=platform.name,
            enforce_eager=self.enforce_eager,
            compilation=compilation,
            async_scheduling=self.async_scheduling,
            enable_nvtx=bool(self.enable_nvtx),
        )

    def _compilation_config(self, platform_has_graphs: bool) -> CompilationConfig:
        mode = self.cudagraph_mode
        if mode is None:
            mode = "full" if platform_has_graphs and not self.enforce_eager else "none"
        elif self.enforce_eager and mode != "none":
            raise ValueError(
                f"enforce_eager turns CUDA graphs off, but cudagraph_mode={mode!r} asks for them"
            )
        sizes = self.cudagraph_capture_sizes
        if sizes is None:
            sizes = default_capture_sizes(self.max_num_seqs) if mode != "none" else []
        elif not isinstance(sizes, list | tuple):
            raise ValueError(f"cudagraph_capture_sizes must be a list of integers, got {sizes!r}")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be a bool, got {self.async_scheduling!r}")
        return CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=list(sizes))


def _check_positive(optional: bool = False, **values: Any) -> None:
    for name, value in values.items():
        if value is None and optional:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
