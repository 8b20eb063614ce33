"""The engine's configuration: what the user asked for, resolved against the model and platform."""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


#: What ``dtype`` accepts by name: "auto" (the platform's default) and the names above.
DTYPE_NAMES = ("auto", *_DTYPES)

#: How the weights are read: "auto" by what the model path holds, or random ("dummy").
LoadFormat = Literal["auto", "safetensors", "gguf", "dummy"]
LOAD_FORMATS: tuple[str, ...] = get_args(LoadFormat)

#: The order waiting requests are admitted in: arrival, or (priority, arrival).
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[str, ...] = get_args(SchedulingPolicy)

#: How layers call the small ops (norms, rotary, activation); see kvik.ops.
OpsDispatch = Literal["torch_ops", "direct"]
OPS_DISPATCHES: tuple[str, ...] = get_args(OpsDispatch)

#: What the KV cache stores, as vLLM's ``--kv-cache-dtype``: "auto" (the model's dtype), or FP8
#: e4m3 ("fp8" and "fp8_e4m3" are one format) with per-layer k/v scales (kvik.attention.kv_quant).
KvCacheDtype = Literal["auto", "fp8", "fp8_e4m3"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the KV cache for the ``kv_cache_dtype`` option ``cache_dtype``."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    raise ValueError(
        f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {cache_dtype!r}"
    )


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return _DTYPES[dtype]


@dataclass
class ModelConfig:
    """A model's config, as the engine needs it.

    ``path`` is a Hugging Face folder, or a .gguf file when ``load_format`` is "gguf".
    """

    path: Path
    hf_config: Any  # transformers.PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    load_format: str = "auto"  # "auto" | "safetensors" | "dummy"
    tokenizer: str | None = None
    seed: int = 0
    generation_config: dict[str, Any] = field(default_factory=dict)
    #: The generation-config sampling keys (temperature, top_p, ..., max_new_tokens) that give the
    #: defaults of requests leaving them unset: the model's own under the ``generation_config``
    #: option "auto" (kvik.model_loader.generation_config).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    name: str = ""  # what the user called it (an alias, a path or a hub id)
    #: The quantization method's name (the checkpoint's, or the ``quantization`` option's), or
    #: None for an unquantized model.
    quantization: str | None = None
    #: That method's ``kvik.quantization.QuantizationConfig`` for this model, which gives each
    #: linear layer its method as the model is built; None for an unquantized model.
    quant_config: Any = None
    #: The most logprobs a request may ask for at a position (``logprobs``, ``prompt_logprobs``);
    #: -1: no limit.
    max_logprobs: int = 20

    def __getstate__(self) -> dict[str, Any]:
        # The HF config travels pickled on its own, so that a spawned process (the engine core,
        # a rank) imports its class without transformers' generated docstrings, which import
        # the auto-modeling modules and torch._dynamo (kvik.model_loader.hf_config_classes).
        return {**self.__dict__, "hf_config": pickle.dumps(self.hf_config)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        from kvik.model_loader.hf_config_classes import loads_hf_config

        self.__dict__.update(state, hf_config=loads_hf_config(state["hf_config"]))

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        if not archs:
            raise ValueError(f"{self.path}/config.json names no architecture ('architectures')")
        return archs[0]

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def eos_token_ids(self) -> frozenset[int]:
        """Every EOS id of generation_config.json and config.json."""
        ids: set[int] = set()
        for source in (
            self.generation_config.get("eos_token_id"),
            getattr(self.hf_config, "eos_token_id", None),
        ):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list | tuple):
                ids.update(int(i) for i in source)
        return frozenset(ids)


def read_generation_config(path: Path) -> dict[str, Any]:
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise ValueError(f"{file} is not a valid JSON file: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} holds a JSON {type(config).__name__}, not an object")
    return config


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # exact count; else from kv_cache_memory_bytes or the platform
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    #: The ``kv_cache_dtype`` option: "auto" (the model's dtype) or "fp8" / "fp8_e4m3".
    cache_dtype: str = "auto"
    # The share of an accelerator's memory the engine may use in all (weights, activations and the
    # KV cache), as vLLM's; the KV cache gets what a profiling forward pass leaves of it.
    gpu_memory_utilization: float = 0.9


#: vLLM's CUDA graph modes: FULL graphs hold a whole uniform decode step; PIECEWISE graphs hold the
#: compiled pieces between attention calls (kvik.compilation.piecewise), for any step of a captured
#: token count; "full_and_piecewise" uses FULL for uniform decodes and PIECEWISE for the rest.
CudagraphMode = Literal["none", "full", "piecewise", "full_and_piecewise"]
CUDAGRAPH_MODES: tuple[str, ...] = get_args(CudagraphMode)
PIECEWISE_CUDAGRAPH_MODES = ("piecewise", "full_and_piecewise")

#: vLLM's compilation modes (``CompilationConfig.mode``, formerly ``level``): 0 runs the model
#: eagerly; 3 compiles it with torch.compile split at attention. Modes 1 and 2 (plain
#: torch.compile, trace once) are vLLM's debugging modes and are not built.
COMPILATION_MODE_NONE = 0
COMPILATION_MODE_PIECEWISE = 3
COMPILATION_MODES = (COMPILATION_MODE_NONE, COMPILATION_MODE_PIECEWISE)


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's padded decode batch sizes: 1, 2, 4, then steps of 8 to 256, then of 16 to 512,
    capped by ``max_num_seqs`` (which is always a size, so every decode batch has a graph)."""
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)]
    capped = [s for s in sizes if s < max_num_seqs]
    if max_num_seqs <= 512:
        capped.append(max_num_seqs)
    return capped


def default_compile_cache_dir() -> str:
    return os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvik", "torch_compile"
    )


@dataclass
class CompilationConfig:
    """How steps run: compiled or eager (``mode``), and which CUDA graphs replay them."""

    mode: int = COMPILATION_MODE_NONE
    cudagraph_mode: str = "full"
    #: Padded token counts with graphs, ascending: a uniform decode batch runs in the FULL graph of
    #: the smallest that holds it, another step in the PIECEWISE graphs of the smallest (two or
    #: more tokens) that holds it; eager (or compiled without graphs) above the largest.
    cudagraph_capture_sizes: list[int] = field(default_factory=list)
    #: Where inductor's and Triton's caches go, so that a second start compiles from them.
    cache_dir: str = ""

    def __post_init__(self) -> None:
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(
                f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, "
                f"got {self.cudagraph_mode!r}"
            )
        if self.mode not in COMPILATION_MODES:
            raise ValueError(
                f"compilation mode must be 0 (eager) or 3 (torch.compile split at attention), got "
                f"{self.mode!r}; vLLM's modes 1 and 2 are not built"
            )
        if self.cudagraph_mode in PIECEWISE_CUDAGRAPH_MODES and self.mode != 3:
            raise ValueError(
                f"cudagraph_mode {self.cudagraph_mode!r} captures the compiled pieces of the model: "
                "it needs compilation mode 3"
            )
        sizes = self.cudagraph_capture_sizes
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
            raise ValueError(f"cudagraph_capture_sizes must be positive integers, got {sizes!r}")
        self.cudagraph_capture_sizes = sorted(set(sizes))

    @property
    def use_cudagraphs(self) -> bool:
        return self.cudagraph_mode != "none" and bool(self.cudagraph_capture_sizes)

    @property
    def full_graphs(self) -> bool:
        return self.use_cudagraphs and self.cudagraph_mode in ("full", "full_and_piecewise")

    @property
    def piecewise_graphs(self) -> bool:
        return self.use_cudagraphs and self.cudagraph_mode in PIECEWISE_CUDAGRAPH_MODES

    @property
    def compiled(self) -> bool:
        return self.mode == COMPILATION_MODE_PIECEWISE


#: How the ranks of one engine run: in the engine core's process ("uni", one rank) or one process
#: per rank on this host ("mp"), as vLLM's ``--distributed-executor-backend``.
DistributedExecutorBackend = Literal["uni", "mp"]
DISTRIBUTED_EXECUTOR_BACKENDS: tuple[str, ...] = get_args(DistributedExecutorBackend)


@dataclass
class ParallelConfig:
    """How many ranks run the model and how they are launched."""

    tensor_parallel_size: int = 1
    #: None: "uni" for one rank, "mp" for more.
    distributed_executor_backend: DistributedExecutorBackend | None = None

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(
                "distributed_executor_backend must be one of "
                f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, got {backend!r}"
            )
        if backend == "uni" and tp > 1:
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one rank; tensor_parallel_size={tp} "
                "needs 'mp'"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"


#: Which library turns a grammar into token masks (``--structured-outputs-backend``).
StructuredOutputsBackend = Literal["xgrammar", "guidance"]
STRUCTURED_OUTPUTS_BACKENDS: tuple[str, ...] = get_args(StructuredOutputsBackend)


@dataclass
class StructuredOutputsConfig:
    """Engine-wide settings of constrained decoding."""

    backend: StructuredOutputsBackend = "xgrammar"
    #: The reasoning parser's name (``--reasoning-parser``, e.g. "qwen3", "deepseek_r1"): a
    #: request's grammar starts constraining only after the model's reasoning has ended.
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(
                "structured outputs backend must be one of "
                f"{', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, got {self.backend!r}"
            )


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: Any  # kvik.scheduler.SchedulerConfig
    device: str | None = None
    enforce_eager: bool = False
    compilation: CompilationConfig = field(
        default_factory=lambda: CompilationConfig(cudagraph_mode="none")
    )
    #: Schedule step N+1 while the device runs step N; None lets the platform decide.
    async_scheduling: bool | None = None
    #: NVTX ranges around schedule, prepare, forward, sample and update (for nsys).
    enable_nvtx: bool = False
    #: How the layers call the small ops; None lets the platform decide (the runner then records
    #: its choice here).
    ops_dispatch: OpsDispatch | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    #: Speculative decoding (kvik.spec_decode.config.SpeculativeConfig); None: off.
    speculative: Any = None
