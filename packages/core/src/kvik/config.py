"""The engine's configuration: what the user asked for, resolved against the model and platform."""

from __future__ import annotations

import json
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
    with open(file) as f:
        return json.load(f)


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # exact count; else from kv_cache_memory_bytes or the platform
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    # The share of an accelerator's memory the engine may use in all (weights, activations and the
    # KV cache), as vLLM's; the KV cache gets what a profiling forward pass leaves of it.
    gpu_memory_utilization: float = 0.9


#: vLLM's CUDA graph modes. kvik builds "none" and "full" (FULL graphs for uniform decode steps,
#: eager for the others); the piecewise modes come with the torch.compile path.
CudagraphMode = Literal["none", "full", "piecewise", "full_and_piecewise"]
CUDAGRAPH_MODES: tuple[str, ...] = get_args(CudagraphMode)
BUILT_CUDAGRAPH_MODES = ("none", "full")


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's padded decode batch sizes: 1, 2, 4, then steps of 8 to 256, then of 16 to 512,
    capped by ``max_num_seqs`` (which is always a size, so every decode batch has a graph)."""
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)]
    capped = [s for s in sizes if s < max_num_seqs]
    if max_num_seqs <= 512:
        capped.append(max_num_seqs)
    return capped


@dataclass
class CompilationConfig:
    """How steps are replayed: CUDA graphs for uniform decode batches of the padded sizes."""

    cudagraph_mode: str = "full"
    #: Padded decode batch sizes with a graph, ascending; a decode batch runs in the smallest that
    #: holds it, or eagerly above the largest.
    cudagraph_capture_sizes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(
                f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, "
                f"got {self.cudagraph_mode!r}"
            )
        if self.cudagraph_mode not in BUILT_CUDAGRAPH_MODES:
            raise ValueError(
                f"cudagraph_mode {self.cudagraph_mode!r} needs piecewise graphs under "
                "torch.compile, which kvik does not have yet; use 'full' (graphs for decode steps, "
                "eager otherwise) or 'none'"
            )
        sizes = self.cudagraph_capture_sizes
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
            raise ValueError(f"cudagraph_capture_sizes must be positive integers, got {sizes!r}")
        self.cudagraph_capture_sizes = sorted(set(sizes))

    @property
    def use_cudagraphs(self) -> bool:
        return self.cudagraph_mode != "none" and bool(self.cudagraph_capture_sizes)


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
